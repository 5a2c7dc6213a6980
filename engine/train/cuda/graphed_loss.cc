// --cuda_graph's capture and replay (needs CUDA headers: compiled only with DTRAIN_WITH_CUDA,
// see engine/CMakeLists.txt; no_cuda/graphed_loss.cc is the stand-in).
#include "dtrain/engine/train/graphed_loss.h"

#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/CUDAEvent.h>
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>

#include "dtrain/dist/error.h"

namespace dtrain::engine {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Autocast without its cast cache: a cached cast made before the capture would be read by
// the graph as a constant (the weights' later values never reach it).
class CapturingAutocast {
 public:
  CapturingAutocast(AmpMode amp) : cache_(at::autocast::is_autocast_cache_enabled()) {
    at::autocast::set_autocast_cache_enabled(false);
    guard_ = std::make_unique<AutocastGuard>(c10::kCUDA, amp);
  }
  ~CapturingAutocast() {
    guard_.reset();
    at::autocast::set_autocast_cache_enabled(cache_);
  }

 private:
  bool cache_;
  std::unique_ptr<AutocastGuard> guard_;
};

class CudaGraphedLoss final : public GraphedLoss {
 public:
  at::cuda::CUDAGraph forward_graph;
  at::cuda::CUDAGraph backward_graph;
  std::vector<at::Tensor> inputs;        // the batch fields the graphs read
  at::Tensor loss;                       // written by forward_graph
  at::Tensor grad_out;                   // d(result)/d(loss), read by backward_graph
  std::vector<at::Tensor> grads;         // written by backward_graph (undefined: no gradient)
  std::vector<at::Tensor> params;        // those requiring a gradient at the capture
  std::vector<at::Tensor> all_params;    // every parameter given, with at the capture:
  std::vector<const void*> data_at_capture;
  std::vector<bool> requires_grad_at_capture;

  std::string stale() const override {
    for (size_t i = 0; i < all_params.size(); ++i) {
      const at::Tensor& p = all_params[i];
      if (p.data_ptr() != data_at_capture[i]) {
        return "parameter " + std::to_string(i) + " (shape " + c10::str(p.sizes()) + ") moved to other memory";
      }
      if (p.requires_grad() != requires_grad_at_capture[i]) {
        return "parameter " + std::to_string(i) + (p.requires_grad() ? " was unfrozen" : " was frozen");
      }
    }
    return "";
  }

  bool matches(const Batch& batch) const override {
    if (batch.fields.size() != inputs.size()) return false;
    for (size_t i = 0; i < inputs.size(); ++i) {
      const at::Tensor& f = batch.fields[i];
      if (!f.defined() || f.sizes() != inputs[i].sizes() || f.scalar_type() != inputs[i].scalar_type() ||
          f.device() != inputs[i].device()) {
        return false;
      }
    }
    return true;
  }
  at::Tensor run(const Batch& batch) override;
};

struct ReplayFn : torch::autograd::Function<ReplayFn> {
  static at::Tensor forward(AutogradContext* ctx, int64_t self, at::TensorList params) {
    auto* g = reinterpret_cast<CudaGraphedLoss*>(self);
    ctx->saved_data["self"] = self;
    g->forward_graph.replay();
    return g->loss.detach();  // overwritten by the next replay, as the graph's other tensors
  }
  static variable_list backward(AutogradContext* ctx, variable_list grad) {
    auto* g = reinterpret_cast<CudaGraphedLoss*>(ctx->saved_data["self"].toInt());
    if (grad[0].defined()) {
      g->grad_out.copy_(grad[0].reshape(g->grad_out.sizes()));
    } else {
      g->grad_out.zero_();
    }
    g->backward_graph.replay();
    variable_list out;
    out.reserve(g->grads.size() + 1);
    out.emplace_back();  // `self`
    // Into a parameter's .grad autograd adds the gradient, or takes it over where .grad is
    // undefined (the reducer's one-rank gradients after zero_grad): a graph output taken over
    // would be overwritten by the next replay (the next micro-batch's), so that one is a copy.
    for (size_t i = 0; i < g->grads.size(); ++i) {
      const at::Tensor& t = g->grads[i];
      if (!t.defined()) {
        out.emplace_back();
      } else {
        out.push_back(g->params[i].grad().defined() ? t.detach() : t.clone());
      }
    }
    return out;
  }
};

at::Tensor CudaGraphedLoss::run(const Batch& batch) {
  {
    at::NoGradGuard no_grad;
    for (size_t i = 0; i < inputs.size(); ++i) inputs[i].copy_(batch.fields[i], /*non_blocking=*/true);
  }
  return ReplayFn::apply(reinterpret_cast<int64_t>(this), at::TensorList(params));
}

// The eager passes before a capture (cuBLAS workspaces, the allocator's blocks, lazily built
// state): the gradients are computed with autograd::grad, never accumulated into .grad.
void warm_up(const GraphedLoss::Fn& fn, const Batch& batch, const std::vector<at::Tensor>& params, AmpMode amp,
             int passes) {
  for (int i = 0; i < passes; ++i) {
    at::Tensor loss;
    {
      CapturingAutocast autocast(amp);
      loss = fn(batch);
    }
    DTRAIN_CHECK(loss.defined() && loss.numel() == 1, "--cuda_graph: the loss function must return a scalar");
    torch::autograd::grad({loss.reshape({})}, params, {}, /*retain_graph=*/false, /*create_graph=*/false,
                          /*allow_unused=*/true);
  }
}

// Ends a capture that failed (fn threw, or a host synchronization invalidated it). A capture
// that cannot end leaves the allocator routing this thread's allocations to the graph's pool and
// the pool held: CUDAGraph::capture_end throws before it stops the routing (when the stream's
// capture was invalidated) and the graph's reset() releases only a capture that ended. Both
// are undone here, so the eager fallback gets that memory back and no later allocation is
// filtered for a graph that no longer exists.
void end_failed_capture(at::cuda::CUDAGraph& graph, at::cuda::MempoolId_t pool) {
  try {
    graph.capture_end();
    return;  // ended: the graph's reset() releases the pool
  } catch (...) {
  }
  const c10::DeviceIndex dev = c10::cuda::current_device();
  try {
    c10::cuda::CUDACachingAllocator::endAllocateToPool(dev, pool);
  } catch (...) {  // capture_end stopped the routing before it threw (instantiation failed)
  }
  c10::cuda::CUDACachingAllocator::releasePool(dev, pool);
}

void capture_into(CudaGraphedLoss& g, const GraphedLoss::Fn& fn, AmpMode amp) {
  Batch batch;
  batch.fields = g.inputs;
  const at::cuda::MempoolId_t pool = at::cuda::graph_pool_handle();
  g.grad_out = at::ones({}, at::TensorOptions().dtype(at::kFloat).device(g.inputs.front().device()));
  at::Tensor loss;
  // Thread-local capture: another thread's CUDA calls (a communicator's watchdog querying the
  // events of a collective in flight) stay legal, and cannot invalidate this capture.
  g.forward_graph.capture_begin(pool, cudaStreamCaptureModeThreadLocal);
  try {
    {
      CapturingAutocast autocast(amp);
      loss = fn(batch).reshape({});
    }
    g.forward_graph.capture_end();
  } catch (...) {
    end_failed_capture(g.forward_graph, pool);
    throw;
  }
  DTRAIN_CHECK(loss.requires_grad(), "--cuda_graph: the loss does not depend on any trained parameter");
  g.grad_out = g.grad_out.to(loss.scalar_type());
  // The same pool: replayed in the order captured. Autograd's device thread launches into the
  // capturing stream, so its kernels are captured too.
  g.backward_graph.capture_begin(pool, cudaStreamCaptureModeThreadLocal);
  try {
    g.grads = torch::autograd::grad({loss}, g.params, {g.grad_out}, /*retain_graph=*/false,
                                    /*create_graph=*/false, /*allow_unused=*/true);
    g.backward_graph.capture_end();
  } catch (...) {
    end_failed_capture(g.backward_graph, pool);
    throw;
  }
  g.loss = loss.detach();
}

}  // namespace

bool cuda_graphs_compiled() { return true; }

struct SyncCounter::Impl final : c10::WarningHandler {
  c10::WarningHandler* previous = c10::WarningUtils::get_warning_handler();
  c10::cuda::SyncDebugMode mode = c10::cuda::warning_state().get_sync_debug_mode();
  int64_t count = 0;
  void process(const c10::Warning& w) override {
    if (w.msg().find("synchronizing CUDA operation") != std::string::npos) {
      ++count;
    } else if (previous) {
      previous->process(w);
    }
  }
};

SyncCounter::SyncCounter() : impl_(std::make_unique<Impl>()) {
  c10::WarningUtils::set_warning_handler(impl_.get());
  c10::cuda::warning_state().set_sync_debug_mode(c10::cuda::SyncDebugMode::L_WARN);
}

SyncCounter::~SyncCounter() {
  c10::cuda::warning_state().set_sync_debug_mode(impl_->mode);
  c10::WarningUtils::set_warning_handler(impl_->previous);
}

int64_t SyncCounter::count() const { return impl_->count; }

std::unique_ptr<GraphedLoss> GraphedLoss::capture(const Fn& fn, const Batch& sample,
                                                  const std::vector<at::Tensor>& params, AmpMode amp,
                                                  int warmup) {
  DTRAIN_CHECK(!sample.fields.empty(), "--cuda_graph: the batch has no fields");
  const c10::Device device = sample.fields.front().device();
  DTRAIN_CHECK(device.is_cuda(), "--cuda_graph needs the batch on a CUDA device, not ", device);
  auto g = std::make_unique<CudaGraphedLoss>();
  for (const at::Tensor& p : params) {
    if (p.requires_grad()) g->params.push_back(p);
    g->all_params.push_back(p);
    g->data_at_capture.push_back(p.data_ptr());
    g->requires_grad_at_capture.push_back(p.requires_grad());
  }
  DTRAIN_CHECK(!g->params.empty(), "--cuda_graph: no parameter requires a gradient");
  for (const at::Tensor& f : sample.fields) {
    DTRAIN_CHECK(f.device() == device, "--cuda_graph: the batch's fields are on ", device, " and ", f.device());
    g->inputs.push_back(f.clone());
  }
  c10::cuda::CUDAGuard device_guard(device);
  // Capture on a side stream that first waits for the work queued so far (the graphs are then
  // replayed on the current stream).
  c10::cuda::CUDAStream current = c10::cuda::getCurrentCUDAStream(device.index());
  c10::cuda::CUDAStream side = c10::cuda::getStreamFromPool(false, device.index());
  at::cuda::CUDAEvent ready;
  ready.record(current);
  ready.block(side);
  {
    c10::cuda::CUDAStreamGuard stream_guard(side);
    Batch batch;
    batch.fields = g->inputs;
    warm_up(fn, batch, g->params, amp, std::max(warmup, 1));
    side.synchronize();
    // The warm-up's blocks are cached for the side stream, which nothing allocates on after the
    // capture (a whole step's activations kept reserved for nothing): returned, as
    // torch.cuda.graph does before it captures.
    c10::cuda::CUDACachingAllocator::emptyCache();
    capture_into(*g, fn, amp);
  }
  at::cuda::CUDAEvent captured;
  captured.record(side);
  captured.block(current);
  return g;
}

}  // namespace dtrain::engine
