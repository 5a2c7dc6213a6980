// Optimizer offload in the engine (ZeRO-Offload style): an engine::Optimizer whose fp32
// master weights and state live in (pinned) host memory, partitioned across the ranks of
// the data-parallel group, updated by offload::CpuOptimizer.
//
// One step (after the reducer averaged the gradients: on every rank, or only each rank's
// shard with ReducerOptions::owned, which the trainer sets): rank r copies the gradients of
// its shard of the flat parameter space to the host (streamed per bucket during backward,
// see attach()), updates its shard there, copies the new weights back into the
// parameters, and the ranks all-gather the shards, so every rank ends the step with the same
// full weights. Host memory per rank falls with the group size; the GPU keeps parameters and
// gradients only. With the delayed update (OffloadOptions::delayed_update_after) the CPU
// update of one step overlaps the next step's forward and backward.
//
// The parameters become views of one flat device buffer (their values and autograd identity
// are kept), so the all-gather writes them in place. Not thread-safe. Collective over dp.
#pragma once

#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "dtrain/dist/communicator.h"
#include "dtrain/engine/checkpoint.h"
#include "dtrain/engine/optim.h"
#include "dtrain/engine/reducer.h"

namespace dtrain::offload {
class PinnedPool;
}

namespace dtrain::engine {

struct OffloadOptions {
  double host_mem_limit_gb = 0;  // cap of the pinned host pool (0: no cap besides MemAvailable)
  int threads = 0;               // CPU optimizer threads (0: OMP_NUM_THREADS or the cores)
  // Gradient streaming (after attach()): each bucket's part of this rank's shard is copied
  // to pinned host memory as soon as the reducer has averaged it, while backward goes on,
  // so step() finds the gradients on the host. "auto": when the parameters are on a GPU;
  // "on": for CPU parameters too (one extra copy; used by tests); "off": step() reads .grad.
  std::string stream_gradients = "auto";
  // One-step-delayed parameter update (ZeRO-Offload's DPU) from the step after this many
  // ordinary steps (steps taken before a resume count): step t's CPU update then runs in
  // the background while step t + 1's forward and backward run on the weights of step
  // t - 1. < 0: off. See OffloadedOptimizer::flush().
  int64_t delayed_update_after = -1;
  // Trainer: with data parallelism (every parameter on one device, in one dtype),
  // reduce each gradient only to the rank whose shard holds it (ReducerOptions::owned)
  // instead of all-reducing it: the optimizer reads only its shard, so this moves about
  // half the bytes. The gradient norm (clipping, metrics) is then taken over each rank's
  // shard and summed across the ranks.
  bool reduce_to_owner = true;
};

// Parses --offload: "none", "optimizer", "layers", "all" (throws naming the accepted values).
struct OffloadChoice {
  bool optimizer = false;
  bool layers = false;
};
OffloadChoice parse_offload(const std::string& text);

class OffloadedOptimizer : public Optimizer {
 public:
  // params: same dtype and device, contiguous. dp: the data-parallel group (the shards).
  // Throws dtrain::Error for bad options (stream_gradients not auto/on/off) and what
  // CpuOptimizer throws (host memory over the cap, ...).
  OffloadedOptimizer(std::vector<at::Tensor> params, const OptimizerOptions& options,
                     dist::Communicator& dp, const OffloadOptions& offload);
  ~OffloadedOptimizer() override;  // finishes an update in flight (its result is dropped)
  // With the delayed update after its warm-up: publishes the update in flight (its new
  // weights go into the parameters), then starts this step's update in the background and
  // returns. Otherwise synchronous: the parameters hold the new weights on return.
  void step() override;
  void zero_grad() override;
  void set_lr(double lr) override;
  double lr() const override;
  const OptimizerOptions& options() const override { return options_; }
  // This rank's shard only, as 1-D fp32 tensors of its real elements: "master", the rule's
  // arrays ("exp_avg", ...), and "step" (0-dim); see shard_begin()/shard_end(). Flushes.
  std::vector<std::pair<std::string, at::Tensor>> state() const override;
  void load_state(const std::vector<std::pair<std::string, at::Tensor>>& state) override;
  const std::vector<at::Tensor>& params() const override { return params_; }

  // Gradient streaming: observes reducer's buckets (reducer over the same parameters, in
  // any order, possibly more: those not given to this optimizer are ignored). Streams when
  // OffloadOptions::stream_gradients says so (streams_gradients()). The reducer must
  // outlive this optimizer or be detached (attach(nullptr)).
  void attach(GradReducer* reducer);
  bool streams_gradients() const;
  // Streamed copies are taken before the caller unscales or clips the gradients: before
  // touching the gradients after backward, call wait_streamed_gradients() (the calling
  // thread's current stream then waits for the copies; no host sync), and tell the optimizer
  // the factor it multiplied them by in place (1/loss scale x clipping coefficient) with
  // set_streamed_gradient_factor() before step() (used by that step only).
  void wait_streamed_gradients();
  void set_streamed_gradient_factor(double factor);
  // Completes the update in flight (delayed update): afterwards the parameters hold every
  // step's update. The next step() then trains on the newest weights. Call before saving or
  // exporting the model; a no-op otherwise. Collective over dp when an update is in flight.
  void flush();
  bool update_in_flight() const;
  // When the last finished CPU update ran (for the timeline): taken once; empty when no
  // update finished since the last call. background: it ran on the updater thread (delayed).
  struct UpdateTiming {
    std::chrono::steady_clock::time_point start, end;
    bool background = false;
  };
  std::optional<UpdateTiming> take_update_timing();

  int64_t numel() const;        // elements of all parameters
  int64_t shard_begin() const;  // this rank's real elements of the flat space
  int64_t shard_end() const;
  int64_t host_bytes() const;   // pinned host memory held (master, state, buffers)
  // Loads this rank's shard from the shards other ranks saved (any old group size): each
  // entry holds old rank files' state() and their [begin, end) ranges. Flushes first.
  void load_resharded(const std::vector<std::pair<std::pair<int64_t, int64_t>, NamedTensors>>& old);

 private:
  struct Impl;
  OptimizerOptions options_;
  std::vector<at::Tensor> params_;
  std::unique_ptr<Impl> impl_;
};

// The optimizer of --offload=all on a GPU: device parameters through an OffloadedOptimizer,
// host-resident parameters (layer offload) through the fused CPU optimizer. state() holds the
// host part ("<index in params>.<name>"); offloaded() the partitioned part.
std::unique_ptr<Optimizer> make_offload_optimizer(std::vector<at::Tensor> params, const OptimizerOptions& options,
                                                  dist::Communicator& dp, const OffloadOptions& offload,
                                                  c10::Device device);
// The partitioned optimizer inside opt (itself or a composite's part), or nullptr.
OffloadedOptimizer* offloaded_part(Optimizer* opt);

}  // namespace dtrain::engine
