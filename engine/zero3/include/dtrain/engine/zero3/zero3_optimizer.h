// ZeRO-3 (--shard=parameters; FSDP's layout): the weights, their gradients and the optimizer
// state are partitioned across the data-parallel group, unit by unit.
//
// Units are runs of consecutive parameters (unit_starts: the parameter index where each
// begins, ascending from 0), typically one model block each. Unit k's n_k elements (its
// parameters end to end) are padded to ranks x c_k = offload::padded_numel(n_k, ranks) and
// split evenly: rank r holds the unit's elements [r c_k, (r + 1) c_k), of which those below
// n_k are real (shard_range(n_k, ranks, r) of shard.h). This rank's pieces of every unit, end
// to end, are its shard: its weights between steps, its gradients and its optimizer state
// (and float32 master of bfloat16 weights) all have that layout.
//
// - Weights: each unit's parameters are views of a buffer of its own (ranks x c_k elements)
//   that holds bytes only while the unit is gathered. gather_unit(k) is one all_gather of the
//   ranks' pieces into it; release_unit(k) frees it. ParameterUnits (parameter_units.h) calls
//   them around each unit's forward and backward.
// - Gradients: bucket_comm() is the reducer's strategy (ReducerOptions::bucket_comm): one
//   bucket per unit, padded, reduce-scattered (averaged) straight into this rank's gradient
//   shard, and released as soon as that completes, so between steps a rank holds only its
//   shard of the gradients and no parameter has a .grad.
// - step(): the shard's update (ATen's fused rules over one flat tensor; with `offload`, the
//   CPU optimizer over a host copy of the master and state, ZeRO-Offload's layout of stage 3),
//   then every unit is released (a gathered unit would hold the old weights).
//
// Per step and rank the bytes of the weights move three times (gather for forward, gather for
// backward, reduce-scatter), as in the ZeRO paper. Padding elements have zero weights and
// gradients and stay zero. As in the other partitioned optimizers a parameter without a
// gradient is updated with a zero one (moments decay, weight decay applies).
//
// Checkpoints: shard_layout() is this rank's ranges of the flat space with the units' bounds
// (shard.h), so the checkpoint layer reshards ZeRO-3 states into every other layout and back.
// Not thread-safe except as ParameterUnits uses it. Collective over dp in gather_unit() (the
// same units in the same order on every rank) and never in step().
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "dtrain/dist/communicator.h"
#include "dtrain/engine/optim/offload.h"
#include "dtrain/engine/optim/optim.h"
#include "dtrain/engine/parallel/bucket_comm.h"

namespace dtrain::engine {

class Zero3Optimizer : public Optimizer {
 public:
  // params: one dtype (floating point) and device, contiguous, the same values on every rank
  // (the trainer broadcasts rank 0's). offload: the master and state on the host (pinned when
  // the parameters are on a GPU; host_mem_limit_gb caps it) updated by offload.threads CPU
  // threads; its streaming and delayed-update options are not used. Throws dtrain::Error as
  // make_optimizer() does, for bad units, and for parameters of several dtypes or devices.
  Zero3Optimizer(std::vector<at::Tensor> params, const OptimizerOptions& options, dist::Communicator& dp,
                 std::vector<size_t> unit_starts, const OffloadOptions* offload = nullptr);
  ~Zero3Optimizer() override;

  int units() const;
  // Parameter indices of unit k: [first, last).
  std::pair<size_t, size_t> unit_params(int k) const;
  // Materializes unit k's buffer and issues the all_gather of its pieces (this rank's from its
  // shard): the parameters hold the unit's current weights once the returned work completes.
  // A no-op returning nothing while the unit is gathered already.
  std::vector<dist::WorkPtr> gather_unit(int k);
  // Frees unit k's buffer (its parameters then hold no bytes). Local; the caller makes sure
  // nothing still reads them.
  void release_unit(int k);
  bool unit_gathered(int k) const;

  // The out-of-memory replay (the trainer's back-off). The other ranks go on through a step's
  // unit gathers and gradient reduce-scatters after one rank failed in it, so that rank runs
  // the step again from its start (on less data) to take part in the rest. begin_step() marks
  // a step's start; issued_in_step() counts the collectives this optimizer issued since (its
  // gathers and reduce-scatters, nothing else). replay_step() makes the next issued_in_step()
  // of them complete at once without communicating (a gather leaves zeros in the unit, a
  // reduce-scatter leaves the gradient shard as it is): the other ranks had those already, and
  // the communicator's sequence numbers of the ones after stay matched with theirs because the
  // skipped ones are never issued. replaying() is how many are still to skip (0 once the replay
  // reached where the failure was); begin_step() throws dtrain::Error while it is not 0.
  void begin_step();
  int64_t issued_in_step() const;
  void replay_step();
  int64_t replaying() const;

  // The reducer's bucket strategy for these parameters (in this order): give it to
  // ReducerOptions::bucket_comm of a reducer over params() on dp. Valid beyond this optimizer.
  std::shared_ptr<BucketComm> bucket_comm() const;
  // This rank's gradient shard in the weights' dtype (averaged after a synchronized backward;
  // padding zero): what the gradient norm and the finite check read.
  at::Tensor gradient_shard() const;
  // Where each of shard_layout()'s ranges begins in gradient_shard() (and in the weights'
  // shard): a range is a unit's real elements, followed in the shard by the unit's padding.
  std::vector<int64_t> shard_positions() const;

  using Optimizer::step;
  void step(const at::Tensor& grad_multiplier) override;
  void zero_grad() override;
  void set_lr(double lr) override;
  double lr() const override;
  const OptimizerOptions& options() const override { return options_; }
  std::vector<std::pair<std::string, at::Tensor>> state() const override { return {}; }
  void load_state(const std::vector<std::pair<std::string, at::Tensor>>& state) override;
  const std::vector<at::Tensor>& params() const override { return params_; }
  std::vector<at::Tensor> device_state() const override;
  int64_t host_bytes() const override;  // offloaded: the host memory held; else 0
  std::optional<ShardLayout> shard_layout() const override;
  // "master", the rule's arrays (1-D, float32 or the master dtype, the real elements of the
  // layout's ranges end to end) and "step" (0-dim).
  ShardState shard_state() const override;
  void load_shard_state(const ShardState& state) override;

  struct Impl;

 private:
  OptimizerOptions options_;
  std::vector<at::Tensor> params_;
  std::unique_ptr<Impl> impl_;
};

// ZeRO-3's unit buffers: a tensor whose storage holds bytes only while its unit is gathered
// (views of it keep their offsets). release_unit_storage() frees the bytes;
// materialize_unit_storage() allocates them again (uninitialized) from the storage's
// allocator. Both work on the tensor's device whatever the calling thread's current device is
// (the CUDA caching allocator allocates on the current device; autograd's threads, a writer
// thread or a caller that never set one would otherwise get GPU 0's memory). Synchronous on
// the host; not thread-safe for one tensor.
void release_unit_storage(const at::Tensor& t);
void materialize_unit_storage(const at::Tensor& t);

}  // namespace dtrain::engine

#include "dtrain/dist/glog_compat.h"  // last: keeps glog's LOG macros whatever the include order
