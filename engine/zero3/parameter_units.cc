// ZeRO-3's units in a step: gather before a unit's forward and again before its backward,
// prefetch the next unit on the communicator while the current one computes, release as soon
// as the unit's computation is done (parameter_units.h).
#include <ATen/ATen.h>
#include <c10/core/DeviceGuard.h>
#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>
#include <mutex>

#include "dtrain/dist/error.h"
#include "dtrain/engine/zero3/parameter_units.h"

namespace dtrain::engine {

namespace {

// "blocks.0.attn.qkv.weight" -> "blocks.0.attn.qkv" (its module; "" for a top-level parameter).
std::string module_of(const std::string& name) {
  const auto dot = name.rfind('.');
  return dot == std::string::npos ? std::string() : name.substr(0, dot);
}

}  // namespace

std::vector<size_t> unit_starts_of(const std::vector<std::string>& names, const std::vector<std::string>& prefixes,
                                   const std::vector<bool>& tensor_parallel) {
  DTRAIN_CHECK(!prefixes.empty(), "--shard=parameters needs the model's units (--shard_units, or "
               "TrainerOptions::shard_unit_starts: where each unit's parameters begin); this model gives none. "
               "Name them, or use --shard=gradients");
  DTRAIN_CHECK(!names.empty(), "--shard=parameters: the model has no trainable parameters");
  std::vector<size_t> starts;
  std::vector<bool> used(prefixes.size(), false);
  for (size_t j = 0; j < names.size(); ++j) {
    bool begins = false;
    for (size_t i = 0; i < prefixes.size(); ++i) {
      if (!used[i] && names[j].compare(0, prefixes[i].size(), prefixes[i]) == 0) used[i] = begins = true;
    }
    if (!begins) continue;
    const std::string layer = module_of(names[j]);
    DTRAIN_CHECK(j == 0 || layer.empty() || module_of(names[j - 1]) != layer, "--shard=parameters: unit ",
                 starts.size(), " would begin at '", names[j], "', inside the ",
                 j < tensor_parallel.size() && tensor_parallel[j] ? "tensor-parallel " : "", "layer '", layer,
                 "' (its '", names[j - 1], "' falls in the unit before): a unit must hold whole layers. End the "
                 "prefix at a layer, e.g. '", layer, ".'");
    starts.push_back(j);
  }
  for (size_t i = 0; i < prefixes.size(); ++i) {
    DTRAIN_CHECK(used[i], "--shard=parameters: no parameter's name begins with the unit prefix '", prefixes[i],
                 "' (the first is '", names.front(), "', the last '", names.back(), "')");
  }
  DTRAIN_CHECK(starts.front() == 0, "--shard=parameters: the first parameter, '", names.front(),
               "', begins no unit (the units must name where every unit begins; add a prefix of it)");
  return starts;
}

struct ParameterUnits::State {
  using Clock = std::chrono::steady_clock;
  Zero3Optimizer* optimizer = nullptr;
  std::vector<std::vector<dist::WorkPtr>> pending;  // per unit: its gather in flight
  std::vector<Clock::time_point> issued, ready;     // per unit: its gather's issue, and when it was ready
  std::vector<const char*> phase;                   // per unit: "forward" or "backward" while gathered
  bool recording = false;
  std::vector<ParameterUnits::Event> events;
  std::vector<int> grads_left;                      // per unit: gradients still to come in this backward
  std::vector<std::pair<at::Tensor, unsigned>> hooks;
  std::mutex mutex;  // forward runs on the training thread, backward on autograd's
  // The units' device, made current around every unit operation (guard()): the gathers'
  // allocations, copies and waits land there whichever thread runs them (the training thread,
  // autograd's, a checkpoint's). nullopt on the CPU.
  std::optional<c10::Device> device;
  c10::OptionalDeviceGuard guard() const { return c10::OptionalDeviceGuard(device); }

  int units() const { return optimizer->units(); }
  // Issues unit k's gather unless it is gathered or in flight (k outside the units: nothing).
  void prefetch(int k) {
    if (k < 0 || k >= units() || optimizer->unit_gathered(k)) return;
    if (recording) issued[k] = Clock::now();
    pending[k] = optimizer->gather_unit(k);
  }
  // Waits for unit k's gather in flight, recording its transfer.
  void finish(int k) {
    if (pending[k].empty()) return;
    for (const dist::WorkPtr& w : pending[k]) w->wait();
    if (recording) {
      Clock::time_point start = issued[k], end = Clock::now(), s2, e2;
      if (pending[k].front()->timing(&start, &s2) && pending[k].back()->timing(&e2, &end)) {
        start = std::max(start, issued[k]);
      }
      events.push_back({"gather", k, start, end});
    }
    pending[k].clear();
  }
  // Unit k gathered and its all_gather complete.
  void ensure(int k, const char* why) {
    prefetch(k);
    finish(k);
    if (recording && phase[k] == nullptr) {
      phase[k] = why;
      ready[k] = Clock::now();
    }
  }
  void release(int k) {
    finish(k);  // never free what a transfer writes
    if (recording && phase[k] != nullptr && optimizer->unit_gathered(k)) {
      events.push_back({phase[k], k, ready[k], Clock::now()});
    }
    phase[k] = nullptr;
    optimizer->release_unit(k);
  }
  void check(int k) const {
    DTRAIN_CHECK(k >= 0 && k < units(), "ParameterUnits: unit ", k, " of ", units());
  }
  void before_forward(int k) {
    check(k);
    const c10::OptionalDeviceGuard on_device = guard();
    std::lock_guard<std::mutex> lock(mutex);
    ensure(k, "forward");
    prefetch(k + 1);
  }
  void after_forward(int k) {
    check(k);
    const c10::OptionalDeviceGuard on_device = guard();
    std::lock_guard<std::mutex> lock(mutex);
    release(k);
  }
  void before_backward(int k) {
    check(k);
    const c10::OptionalDeviceGuard on_device = guard();
    std::lock_guard<std::mutex> lock(mutex);
    ensure(k, "backward");
    const auto [first, last] = optimizer->unit_params(k);
    grads_left[k] = static_cast<int>(last - first);
    prefetch(k - 1);
  }
};

namespace {

// The state, carried through the autograd context's IValues.
struct StateHolder : torch::CustomClassHolder {
  explicit StateHolder(std::shared_ptr<ParameterUnits::State> s) : state(std::move(s)) {}
  std::shared_ptr<ParameterUnits::State> state;
};

// Identity in forward; in backward, before anything of unit k's backward runs (the gradient
// of its output arrives here first): gather unit k again, prefetch unit k - 1, and count the
// unit's gradients to come.
struct GatherBeforeBackward : public torch::autograd::Function<GatherBeforeBackward> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x,
                            std::shared_ptr<ParameterUnits::State> state, int64_t k) {
    ctx->saved_data["k"] = k;
    ctx->saved_data["state"] = c10::IValue::make_capsule(c10::make_intrusive<StateHolder>(std::move(state)));
    return x.view_as(x);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const int k = static_cast<int>(ctx->saved_data["k"].toInt());
    auto holder = c10::static_intrusive_pointer_cast<StateHolder>(ctx->saved_data["state"].toCapsule());
    holder->state->before_backward(k);
    return {grads[0], at::Tensor(), at::Tensor()};
  }
};

}  // namespace

ParameterUnits::ParameterUnits(Zero3Optimizer& optimizer) : state_(std::make_shared<State>()) {
  State& s = *state_;
  s.optimizer = &optimizer;
  const c10::Device device = optimizer.params().front().device();
  if (!device.is_cpu()) s.device = device;
  s.pending.resize(optimizer.units());
  s.issued.resize(optimizer.units());
  s.ready.resize(optimizer.units());
  s.phase.assign(optimizer.units(), nullptr);
  s.grads_left.assign(optimizer.units(), 0);
  // Once the last gradient of a unit in this backward was computed, nothing of its backward
  // reads its weights any more: release them.
  std::weak_ptr<State> weak = state_;
  for (int k = 0; k < optimizer.units(); ++k) {
    const auto [first, last] = optimizer.unit_params(k);
    for (size_t j = first; j < last; ++j) {
      at::Tensor p = optimizer.params()[j];
      const unsigned handle = p.register_hook([weak, k](const at::Tensor&) {
        std::shared_ptr<State> s = weak.lock();
        if (!s) return;
        const c10::OptionalDeviceGuard on_device = s->guard();
        std::lock_guard<std::mutex> lock(s->mutex);
        if (s->grads_left[k] > 0 && --s->grads_left[k] == 0) s->release(k);
      });
      s.hooks.emplace_back(p, handle);
    }
  }
}

ParameterUnits::~ParameterUnits() {
  for (auto& [p, handle] : state_->hooks) p.remove_hook(handle);
  try {
    release_all();
  } catch (...) {  // a destructor must not throw; the communicator reports its own failures
  }
}

int ParameterUnits::units() const { return state_->units(); }

at::Tensor ParameterUnits::run(int k, const std::function<at::Tensor()>& forward) {
  state_->before_forward(k);
  at::Tensor y = forward();
  if (at::GradMode::is_enabled() && y.requires_grad()) y = GatherBeforeBackward::apply(y, state_, k);
  state_->after_forward(k);
  return y;
}

void ParameterUnits::before_forward(int k) { state_->before_forward(k); }
void ParameterUnits::after_forward(int k) { state_->after_forward(k); }
void ParameterUnits::before_backward(int k) { state_->before_backward(k); }

void ParameterUnits::gather_all() {
  State& s = *state_;
  const c10::OptionalDeviceGuard on_device = s.guard();
  std::lock_guard<std::mutex> lock(s.mutex);
  for (int k = 0; k < s.units(); ++k) s.prefetch(k);
  for (int k = 0; k < s.units(); ++k) s.finish(k);
}

void ParameterUnits::record_events(bool on) {
  std::lock_guard<std::mutex> lock(state_->mutex);
  state_->recording = on;
}

std::vector<ParameterUnits::Event> ParameterUnits::take_events() {
  std::lock_guard<std::mutex> lock(state_->mutex);
  std::vector<Event> out;
  out.swap(state_->events);
  return out;
}

Zero3Optimizer& ParameterUnits::optimizer() const { return *state_->optimizer; }

void ParameterUnits::release_all() {
  State& s = *state_;
  const c10::OptionalDeviceGuard on_device = s.guard();
  std::lock_guard<std::mutex> lock(s.mutex);
  for (int k = 0; k < s.units(); ++k) {
    s.grads_left[k] = 0;
    s.release(k);
  }
}

}  // namespace dtrain::engine
