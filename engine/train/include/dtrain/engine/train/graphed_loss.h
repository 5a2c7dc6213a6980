#pragma once
// --cuda_graph: the loss function's forward and backward captured as two CUDA graphs and
// replayed each step, so that the host no longer launches the model's hundreds of kernels one
// by one (as torch.cuda.make_graphed_callables does for a module). The loss comes back as a
// tensor whose backward replays the backward graph and hands the parameters' gradients to
// autograd, so gradient accumulation, the reducer's hooks and the optimizer work as without
// graphs.
//
// Capture needs: a CUDA device; a loss function with no host synchronization, no host-side
// decision on tensor values and no collective inside; fixed batch shapes (a batch of other
// shapes runs eagerly); parameters updated in place (one that moved to other memory, or was
// frozen or unfrozen, since the capture is noticed by stale(): the trainer captures again). Dropout draws from
// the CUDA generator registered with the graph: fresh masks each replay, from another
// position of the random stream than an eager run.
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "dtrain/engine/data/data.h"
#include "dtrain/engine/optim/amp.h"

namespace dtrain::engine {

class GraphedLoss {
 public:
  using Fn = std::function<at::Tensor(const Batch&)>;
  virtual ~GraphedLoss() = default;
  // Runs `warmup` eager forward+backward passes of fn on `sample` (gradients discarded), then
  // captures one of each. Throws dtrain::Error naming the reason when the capture fails (the
  // caller then trains eagerly).
  static std::unique_ptr<GraphedLoss> capture(const Fn& fn, const Batch& sample,
                                              const std::vector<at::Tensor>& params, AmpMode amp,
                                              int warmup);
  // Whether `batch` has the captured batch's field shapes and dtypes.
  virtual bool matches(const Batch& batch) const = 0;
  // Why the graphs no longer describe the step ("" while they do): a parameter's storage moved
  // (set_data, a loaded state that replaced a tensor) or its requires_grad changed since the
  // capture. The graphs read the captured addresses: replayed, they would train the old memory
  // without a word, so the caller captures again.
  virtual std::string stale() const = 0;
  // The loss of `batch` (copied into the graph's inputs), connected to the parameters.
  virtual at::Tensor run(const Batch& batch) = 0;
};

// Whether this build can capture CUDA graphs (DTRAIN_WITH_CUDA).
bool cuda_graphs_compiled();

// Counts the calling thread's host synchronizations with a CUDA device while alive: c10's sync
// debug mode (what torch.cuda.set_sync_debug_mode("warn") sets), its warnings counted instead
// of printed (other warnings pass on). Without CUDA it counts nothing. Not nestable.
class SyncCounter {
 public:
  SyncCounter();
  ~SyncCounter();
  SyncCounter(const SyncCounter&) = delete;
  SyncCounter& operator=(const SyncCounter&) = delete;
  int64_t count() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace dtrain::engine
