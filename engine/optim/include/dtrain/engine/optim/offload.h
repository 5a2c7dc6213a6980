// Optimizer offload in the engine (ZeRO-Offload style): an engine::Optimizer whose fp32
// master weights and state live in (pinned) host memory, partitioned across the ranks of
// the data-parallel group, updated by offload::CpuOptimizer.
//
// One step (after the reducer averaged the gradients: on every rank, or only each rank's
// shard with ReducerOptions::owned, from gradient_owners()): rank r copies the gradients of
// its shard of the flat parameter space to the host (streamed per bucket during backward,
// see attach()), updates its shard there, copies the new weights back into the
// parameters, and the ranks all-gather the shards, so every rank ends the step with the same
// full weights. Host memory per rank falls with the group size; the GPU keeps parameters and
// gradients only. With the delayed update (OffloadOptions::delayed_update_after) the CPU
// update of one step overlaps the next step's forward and backward.
//
// The parameters become views of one flat device buffer (their values and autograd identity
// are kept), so the all-gather writes them in place. Not thread-safe. Collective over dp.
//
// One rank with host parameters (CPU training; layer offload's streamed blocks) and the
// delayed update: no gradient or weight is copied. The update takes the parameters' own
// gradient tensors when the attached reducer leaves them as autograd's (.grad is undefined
// after step(); the next backward makes new ones), and the new weights are published by
// swapping two buffers: the parameters (same identity) are views of one or the other, so a
// tensor taken of a parameter's data before a step is not the parameter after it.
#pragma once

#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "dtrain/dist/communicator.h"
#include "dtrain/engine/optim/optim.h"

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
  std::string stream_gradients = "auto";  // parsed by parse_stream_gradients()
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

// Gradient streaming mode (OffloadOptions::stream_gradients).
enum class StreamGradients { kAuto, kOn, kOff };
// "auto", "on", "off"; throws dtrain::Error naming the accepted values otherwise.
StreamGradients parse_stream_gradients(const std::string& text);

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
  // returns. Otherwise synchronous: the parameters hold the new weights on return. The
  // multiplier is applied by the CPU kernels (read on the host: a device multiplier syncs).
  using Optimizer::step;
  void step(const at::Tensor& grad_multiplier) override;
  // Waits for this step's streamed gradient copies (the calling thread's current stream waits
  // for them; no host sync) and forgets them.
  void skip_step() override;
  void zero_grad() override;
  void set_lr(double lr) override;
  double lr() const override;
  const OptimizerOptions& options() const override { return options_; }
  // Nothing is replicated: state() is empty and load_state() accepts only an empty state.
  // The whole state is partitioned: see shard_state().
  std::vector<std::pair<std::string, at::Tensor>> state() const override;
  void load_state(const std::vector<std::pair<std::string, at::Tensor>>& state) override;
  const std::vector<at::Tensor>& params() const override { return params_; }

  // With OffloadOptions::reduce_to_owner and more than one rank: each rank's shard.
  std::vector<FlatRange> gradient_owners() const override;
  // Gradient streaming: observes reducer's buckets (reducer over the same parameters, in
  // any order, possibly more: those not given to this optimizer are ignored). Streams when
  // OffloadOptions::stream_gradients says so (streams_gradients()). Copies are taken of the
  // gradients as the reducer leaves them (the caller must not change them before step() or
  // skip_step(); the multiplier of step() is applied by the update).
  void attach(GradReducer& reducer) override;
  bool streams_gradients() const;
  // Completes the update in flight (delayed update): afterwards the parameters hold every
  // step's update. The next step() then trains on the newest weights. Call before saving or
  // exporting the model; a no-op otherwise. Collective over dp when an update is in flight.
  void flush() override;
  bool update_in_flight() const;
  int64_t host_bytes() const override;  // pinned host memory held (master, state, buffers)
  // Outside host_bytes(): the delayed update's buffer of new weights (on the parameters'
  // device: the device for a GPU's parameters, the host for host ones), once made.
  std::vector<at::Tensor> device_state() const override;
  std::optional<UpdateTiming> take_update_timing() override;
  // This rank's shard: "master", the rule's arrays ("exp_avg", ...) as 1-D fp32 tensors of
  // its real elements, and "step" (0-dim). shard_state() waits for an update in flight
  // (without publishing it); load_shard_state() drops it.
  std::optional<ShardLayout> shard_layout() const override;
  ShardState shard_state() const override;
  void load_shard_state(const ShardState& state) override;

 private:
  struct Impl;
  OptimizerOptions options_;
  std::vector<at::Tensor> params_;
  std::unique_ptr<Impl> impl_;
};

// The optimizer of --offload: an OffloadedOptimizer over params, or, where some parameters
// already live on the host (layer offload of --offload=all on a GPU; `streamed` lists more to
// treat so, as layer offload's blocks are on a GPU), a composite of an OffloadedOptimizer over
// the device parameters and, over the host ones, the fused CPU optimizer of make_optimizer()
// or an OffloadedOptimizer of their own: with the delayed update (both parts then take the
// update one step late; one data-parallel rank: dtrain::Error otherwise), and for bfloat16 or
// float16 weights (their float32 master; on more ranks each rank's whole copy, the same
// update everywhere). The composite's replicated state() holds the host part's as
// make_optimizer() names it either way (composite_optimizer.cc).
std::unique_ptr<Optimizer> make_offload_optimizer(std::vector<at::Tensor> params, const OptimizerOptions& options,
                                                  dist::Communicator& dp, const OffloadOptions& offload,
                                                  c10::Device device, const std::vector<at::Tensor>& streamed = {});

// The optimizer of layer offload with the delayed update (--offload=layers
// --offload_delayed_update_after=N): the streamed blocks' parameters (`streamed`, and on a
// device every parameter living on the host) are updated by an OffloadedOptimizer with the
// delayed update (dtrain's CPU kernels, step t's update running beside step t + 1's forward and
// backward, which stream the weights of step t - 1), the others by make_optimizer() as each
// step ends (as ZenFlow splits the update: the resident part at once, the streamed part late).
// One data-parallel rank. Throws dtrain::Error without delayed_update_after, on more ranks, or
// when no parameter is streamed.
std::unique_ptr<Optimizer> make_layer_offload_optimizer(std::vector<at::Tensor> params,
                                                        const std::vector<at::Tensor>& streamed,
                                                        const OptimizerOptions& options, dist::Communicator& dp,
                                                        const OffloadOptions& offload, c10::Device device);

}  // namespace dtrain::engine

#include "dtrain/dist/glog_compat.h"  // last: keeps glog's LOG macros whatever the include order
