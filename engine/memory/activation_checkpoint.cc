#include "dtrain/engine/memory/activation_checkpoint.h"

#include <algorithm>
#include <exception>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Context.h>
#include <ATen/autocast_mode.h>
#include <ATen/core/ivalue.h>
#include <c10/core/Event.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <glog/logging.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/engine.h>

#include "dtrain/dist/error.h"
#include "dtrain/engine/parallel/grad_norm.h"

namespace dtrain::engine {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// The autocast settings of this thread for the devices checkpointing records (CPU, CUDA).
struct AutocastState {
  bool cpu_enabled = false;
  at::ScalarType cpu_dtype = at::kBFloat16;
  bool cuda_enabled = false;
  at::ScalarType cuda_dtype = at::kHalf;
  bool cache_enabled = true;

  static AutocastState current() {
    AutocastState s;
    s.cpu_enabled = at::autocast::is_autocast_enabled(c10::kCPU);
    s.cpu_dtype = at::autocast::get_autocast_dtype(c10::kCPU);
    s.cuda_enabled = at::autocast::is_autocast_enabled(c10::kCUDA);
    s.cuda_dtype = at::autocast::get_autocast_dtype(c10::kCUDA);
    s.cache_enabled = at::autocast::is_autocast_cache_enabled();
    return s;
  }

  void apply() const {
    at::autocast::set_autocast_enabled(c10::kCPU, cpu_enabled);
    at::autocast::set_autocast_dtype(c10::kCPU, cpu_dtype);
    at::autocast::set_autocast_enabled(c10::kCUDA, cuda_enabled);
    at::autocast::set_autocast_dtype(c10::kCUDA, cuda_dtype);
    at::autocast::set_autocast_cache_enabled(cache_enabled);
  }
};

// Enters a recorded autocast state for a scope the way torch.autocast does (nesting count,
// cast cache dropped when the outermost region ends) and restores the previous one.
class ScopedAutocast {
 public:
  explicit ScopedAutocast(const AutocastState& state) : prev_(AutocastState::current()) {
    state.apply();
    at::autocast::increment_nesting();
  }
  ~ScopedAutocast() {
    if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
    prev_.apply();
  }
  ScopedAutocast(const ScopedAutocast&) = delete;
  ScopedAutocast& operator=(const ScopedAutocast&) = delete;

 private:
  AutocastState prev_;
};

// States of the default generators: the CPU one and those of the CUDA devices in use.
struct RngState {
  at::Tensor cpu;
  std::vector<std::pair<c10::Device, at::Tensor>> cuda;
};

at::Tensor get_generator_state(at::Generator gen) {
  std::lock_guard<std::mutex> lock(gen.mutex());
  return gen.get_state();
}

void set_generator_state(at::Generator gen, const at::Tensor& state) {
  std::lock_guard<std::mutex> lock(gen.mutex());
  gen.set_state(state);
}

RngState capture_rng(const std::vector<c10::Device>& cuda_devices) {
  RngState s;
  s.cpu = get_generator_state(at::detail::getDefaultCPUGenerator());
  for (const c10::Device& d : cuda_devices) {
    s.cuda.emplace_back(d, get_generator_state(at::globalContext().defaultGenerator(d)));
  }
  return s;
}

void restore_rng(const RngState& s) {
  set_generator_state(at::detail::getDefaultCPUGenerator(), s.cpu);
  for (const auto& [device, state] : s.cuda) {
    set_generator_state(at::globalContext().defaultGenerator(device), state);
  }
}

// Sets the generators to `saved` for a scope and puts back the states they had before.
class ForkedRng {
 public:
  ForkedRng(const RngState& saved, const std::vector<c10::Device>& cuda_devices)
      : outer_(capture_rng(cuda_devices)) {
    restore_rng(saved);
  }
  ~ForkedRng() {
    try {
      restore_rng(outer_);
    } catch (const std::exception& e) {
      LOG(ERROR) << "checkpoint: could not restore the random-number state: " << e.what();
    }
  }
  ForkedRng(const ForkedRng&) = delete;
  ForkedRng& operator=(const ForkedRng&) = delete;

 private:
  RngState outer_;
};

// What backward needs besides the saved inputs; lives as long as the autograd node.
// Runs a hook pair around a scope; the second even when the scope throws.
class HookScope {
 public:
  HookScope(const std::function<void()>& before, const std::function<void()>& after) : after_(after) {
    if (before) before();
  }
  ~HookScope() noexcept(false) {
    if (!after_) return;
    if (std::uncaught_exceptions() > 0) {
      try {
        after_();
      } catch (const std::exception& e) {
        LOG(ERROR) << "checkpoint hook failed while unwinding: " << e.what();
      }
    } else {
      after_();
    }
  }
  HookScope(const HookScope&) = delete;
  HookScope& operator=(const HookScope&) = delete;

 private:
  const std::function<void()>& after_;
};

struct CheckpointState : torch::CustomClassHolder {
  TensorFn fn;
  CheckpointHooks hooks;
  std::vector<at::Tensor> params;  // not SavedVariables: refilling them in place is allowed
  std::vector<bool> input_requires_grad;
  std::vector<c10::Device> cuda_devices;
  RngState rng;
  AutocastState autocast;
};

std::vector<c10::Device> cuda_devices_of(at::TensorList a, at::TensorList b) {
  std::vector<c10::Device> devices;
  for (at::TensorList list : {a, b}) {
    for (const at::Tensor& t : list) {
      if (!t.defined() || !t.is_cuda()) continue;
      if (std::find(devices.begin(), devices.end(), t.device()) == devices.end()) {
        devices.push_back(t.device());
      }
    }
  }
  return devices;
}

constexpr const char* kStateKey = "dtrain_checkpoint_state";

// Copies to the host whose wait is left to the end of the autograd backward that made them
// (CheckpointHooks::defer_host_gradient_wait): each queues an engine callback that waits for
// every one recorded by then (any thread's; the first callback of a backward takes them all, the
// others find none; copies of a backward that failed before its callbacks ran are waited for by
// the next one).
struct DeferredCopies {
  std::mutex mu;
  std::vector<c10::Event> pending;  // guarded by mu
};

DeferredCopies& deferred_copies() {
  static DeferredCopies* d = new DeferredCopies();  // never destroyed: callbacks may run at exit
  return *d;
}

void wait_for_deferred_copies() {
  std::vector<c10::Event> events;
  {
    DeferredCopies& d = deferred_copies();
    std::lock_guard<std::mutex> lock(d.mu);
    events.swap(d.pending);
  }
  for (c10::Event& e : events) e.synchronize();
}

// The stream the streamed blocks' gradients leave the device on, one per device, taken from the
// pool once: beside the compute stream, so the next blocks' backward kernels do not queue
// behind the copies (the link runs both ways at once: the weights' prefetch comes in on the
// layer streamer's own stream).
c10::Stream gradient_copy_stream(c10::Device device) {
  static std::mutex mu;
  static std::vector<std::pair<c10::Device, c10::Stream>> streams;
  std::lock_guard<std::mutex> lock(mu);
  for (const auto& [d, s] : streams) {
    if (d == device) return s;
  }
  c10::impl::VirtualGuardImpl impl(device.type());
  streams.emplace_back(device, impl.getStreamFromGlobalPool(device, /*isHighPriority=*/false));
  return streams.back().second;
}

void defer_until_backward_ends(c10::Event copied) {
  DeferredCopies& d = deferred_copies();
  {
    std::lock_guard<std::mutex> lock(d.mu);
    d.pending.push_back(std::move(copied));
  }
  torch::autograd::Engine::get_default_engine().queue_callback(wait_for_deferred_copies);
}

// Gradient slots returned by CheckpointFunction::backward: [state (none), inputs..., params...].
struct CheckpointFunction : torch::autograd::Function<CheckpointFunction> {
  static variable_list forward(AutogradContext* ctx, c10::intrusive_ptr<CheckpointState> state,
                               at::TensorList inputs, at::TensorList params) {
    state->params = params.vec();
    state->cuda_devices = cuda_devices_of(inputs, params);
    state->autocast = AutocastState::current();
    state->rng = capture_rng(state->cuda_devices);
    for (const at::Tensor& x : inputs)
      state->input_requires_grad.push_back(x.defined() && x.requires_grad());
    ctx->save_for_backward(inputs.vec());
    ctx->set_materialize_grads(false);
    std::vector<at::Tensor> outputs;
    {
      HookScope hooks(state->hooks.before_forward, state->hooks.after_forward);
      outputs = state->fn(inputs.vec());
    }
    ctx->saved_data[kStateKey] = at::IValue::make_capsule(std::move(state));
    return outputs;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs);
};

variable_list recompute_and_differentiate(const CheckpointState& state, std::vector<at::Tensor>& inputs,
                                          const variable_list& grad_outputs);

// Reruns fn on detached copies of the inputs under the forward's RNG and autocast state.
std::vector<at::Tensor> recompute(const CheckpointState& state, std::vector<at::Tensor>& inputs) {
  for (size_t i = 0; i < inputs.size(); ++i) {
    if (!inputs[i].defined()) continue;
    inputs[i] = inputs[i].detach();
    if (state.input_requires_grad[i]) inputs[i].requires_grad_(true);
  }
  ForkedRng fork(state.rng, state.cuda_devices);
  at::AutoGradMode enable_grad(true);
  ScopedAutocast autocast(state.autocast);
  return state.fn(inputs);
}

variable_list CheckpointFunction::backward(AutogradContext* ctx, variable_list grad_outputs) {
  DTRAIN_CHECK(!at::GradMode::is_enabled(),
               "checkpoint: backward with create_graph=true (double backward) through a "
               "checkpointed block is not supported; run that block without checkpointing");
  auto state = c10::static_intrusive_pointer_cast<CheckpointState>(
      ctx->saved_data.at(kStateKey).toCapsule());
  std::vector<at::Tensor> inputs = ctx->get_saved_variables();
  variable_list result = recompute_and_differentiate(*state, inputs, grad_outputs);
  // Parameters may live on another device than the computation (layer offload): their
  // gradients go where they are. Device-to-host: every copy of the block into pinned memory
  // (asynchronous, at full bandwidth), then one wait for the last, instead of a synchronous
  // pageable copy per parameter. The host must wait here: autograd accumulates a CPU gradient
  // on the CPU as soon as this returns.
  const size_t first_param = 1 + inputs.size();
  // Whether autograd adopts the host copies as the parameters' gradients without reading them
  // (none has a gradient yet) and the caller lets the wait for them wait (see the hooks).
  bool adopted = state->hooks.defer_host_gradient_wait;
  for (const at::Tensor& p : state->params) adopted = adopted && !(p.defined() && p.grad().defined());
  std::vector<size_t> to_host;  // the slots copied to the host
  for (size_t j = 0; j < state->params.size(); ++j) {
    const at::Tensor& g = result[first_param + j];
    const at::Tensor& p = state->params[j];
    if (g.defined() && p.defined() && p.device().is_cpu() && g.is_cuda()) to_host.push_back(j);
  }
  // Adopted copies: their norms taken on the device now, so the gradient norm after backward
  // reads none of them on the host (note_device_norm; a later change of one makes it read).
  std::vector<at::Tensor> norms;
  if (adopted && !to_host.empty()) {
    std::vector<at::Tensor> device_grads;
    bool any_double = false;
    for (size_t j : to_host) {
      device_grads.push_back(result[first_param + j]);
      any_double = any_double || device_grads.back().scalar_type() == at::kDouble;
    }
    norms = at::_foreach_norm(device_grads, 2, any_double ? at::kDouble : at::kFloat);
  }
  // The copies run on a side stream that first waits for the compute stream (which made the
  // gradients); each device gradient is marked used there, so the caching allocator does not
  // hand its memory to the next block's kernels before its copy has read it.
  std::optional<c10::Device> copied_from;
  std::optional<c10::Stream> side;
  for (size_t j = 0; j < state->params.size(); ++j) {
    at::Tensor& g = result[first_param + j];
    const at::Tensor& p = state->params[j];
    if (!g.defined() || !p.defined() || g.device() == p.device()) continue;
    if (p.device().is_cpu() && g.is_cuda()) {
      c10::impl::VirtualGuardImpl impl(g.device().type());
      if (!side) {
        copied_from = g.device();
        side = gradient_copy_stream(g.device());
        c10::Event produced(g.device().type());
        produced.record(impl.getStream(g.device()));
        produced.block(*side);
      }
      DTRAIN_CHECK(g.device() == *copied_from, "checkpoint: a block's parameter gradients are on ", *copied_from,
                   " and ", g.device(), "; keep a checkpointed block's computation on one device");
      at::Tensor host = at::empty(g.sizes(), g.options().device(c10::kCPU).pinned_memory(true));
      {
        c10::StreamGuard on_side(*side);
        host.copy_(g, /*non_blocking=*/true);
      }
      impl.recordDataPtrOnStream(g.storage().data_ptr(), *side);
      g = host;
    } else {
      g = g.to(p.device());
    }
  }
  for (size_t k = 0; k < norms.size(); ++k) note_device_norm(result[first_param + to_host[k]], norms[k]);
  if (copied_from) {
    c10::Event copied(copied_from->type());
    copied.record(*side);
    if (adopted) {
      defer_until_backward_ends(std::move(copied));
    } else {
      copied.synchronize();
    }
  }
  return result;
}

variable_list recompute_and_differentiate(const CheckpointState& cstate, std::vector<at::Tensor>& inputs,
                                          const variable_list& grad_outputs) {
  const CheckpointState* state = &cstate;
  HookScope hooks(state->hooks.before_recompute, state->hooks.after_recompute);
  std::vector<at::Tensor> outputs = recompute(*state, inputs);
  DTRAIN_CHECK(outputs.size() == grad_outputs.size(), "checkpoint: fn returned ",
               grad_outputs.size(), " tensors in forward but ", outputs.size(),
               " when recomputed in backward; fn must be a pure function of its inputs, "
               "params and the random-number state");

  variable_list diff_outputs, diff_grads;
  for (size_t i = 0; i < outputs.size(); ++i) {
    if (outputs[i].defined() && outputs[i].requires_grad() && grad_outputs[i].defined()) {
      diff_outputs.push_back(outputs[i]);
      diff_grads.push_back(grad_outputs[i]);
    }
  }
  const size_t n_in = inputs.size();
  variable_list result(1 + n_in + state->params.size());
  variable_list wrt;
  std::vector<size_t> slot;
  for (size_t i = 0; i < n_in; ++i) {
    if (inputs[i].defined() && inputs[i].requires_grad()) {
      wrt.push_back(inputs[i]);
      slot.push_back(1 + i);
    }
  }
  for (size_t j = 0; j < state->params.size(); ++j) {
    const at::Tensor& p = state->params[j];
    if (p.defined() && p.requires_grad()) {
      wrt.push_back(p);
      slot.push_back(1 + n_in + j);
    }
  }
  if (diff_outputs.empty() || wrt.empty()) return result;
  variable_list grads = torch::autograd::grad(diff_outputs, wrt, diff_grads,
                                              /*retain_graph=*/false, /*create_graph=*/false,
                                              /*allow_unused=*/true);
  for (size_t k = 0; k < grads.size(); ++k) result[slot[k]] = std::move(grads[k]);
  return result;
}

bool any_requires_grad(const std::vector<at::Tensor>& tensors) {
  for (const at::Tensor& t : tensors) {
    if (t.defined() && t.requires_grad()) return true;
  }
  return false;
}

}  // namespace

std::vector<at::Tensor> checkpoint(const TensorFn& fn, const std::vector<at::Tensor>& inputs,
                                   const std::vector<at::Tensor>& params) {
  return checkpoint(fn, inputs, params, CheckpointHooks{});
}

std::vector<at::Tensor> checkpoint(const TensorFn& fn, const std::vector<at::Tensor>& inputs,
                                   const std::vector<at::Tensor>& params, const CheckpointHooks& hooks) {
  DTRAIN_CHECK(static_cast<bool>(fn), "checkpoint: fn is empty; pass the block's forward function");
  if (!at::GradMode::is_enabled() || (!any_requires_grad(inputs) && !any_requires_grad(params))) {
    HookScope scope(hooks.before_forward, hooks.after_forward);
    return fn(inputs);
  }
  auto state = c10::make_intrusive<CheckpointState>();
  state->fn = fn;
  state->hooks = hooks;
  return CheckpointFunction::apply(std::move(state), at::TensorList(inputs),
                                   at::TensorList(params));
}

at::Tensor checkpoint(const std::function<at::Tensor(const at::Tensor&)>& fn, const at::Tensor& input,
                      const std::vector<at::Tensor>& params, const CheckpointHooks& hooks) {
  DTRAIN_CHECK(static_cast<bool>(fn), "checkpoint: fn is empty; pass the block's forward function");
  TensorFn wrapped = [fn](const std::vector<at::Tensor>& xs) { return std::vector<at::Tensor>{fn(xs[0])}; };
  return checkpoint(wrapped, {input}, params, hooks)[0];
}

at::Tensor checkpoint(const std::function<at::Tensor(const at::Tensor&)>& fn,
                      const at::Tensor& input, const std::vector<at::Tensor>& params) {
  DTRAIN_CHECK(static_cast<bool>(fn), "checkpoint: fn is empty; pass the block's forward function");
  TensorFn wrapped = [fn](const std::vector<at::Tensor>& xs) {
    return std::vector<at::Tensor>{fn(xs[0])};
  };
  return checkpoint(wrapped, {input}, params)[0];
}

}  // namespace dtrain::engine
