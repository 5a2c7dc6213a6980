// ZeRO stage 1 on the parameters' device (DeepSpeed ZeRO-1, Megatron-Core's distributed
// optimizer): the optimizer state, and the fp32 master weights of reduced-precision
// parameters, are partitioned across the data-parallel group.
//
// The parameters become views of one flat buffer on their device, laid out end to end in the
// order given and padded as offload::padded_numel() says (the layout of optimizer offload, so
// checkpoints of the two reshard into each other). Rank r owns the flat elements
// shard_range(numel, ranks, r). One step, after the reducer reduced each gradient to its owner
// (gradient_owners(), ReducerOptions::owned): the rank gathers its range of the gradients into a
// flat gradient shard, updates its master shard with ATen's fused kernels (make_optimizer's
// rules over one flat tensor), writes the new weights into its range of the flat buffer, and
// the ranks all-gather the ranges, so every rank ends the step with the same full weights.
//
// Memory per rank: the parameters and gradients in full (as DDP), the optimizer state (and
// fp32 master of bf16/fp16 parameters) divided by the group size, plus a gradient shard in the
// master dtype (for fp32/fp64 parameters, once attached to the reducer, a view of its storage).
// Communication per step: the reduction to owners (a reduce-scatter's bytes) and the
// all-gather of the weights: the bytes of an all-reduce, as the ZeRO paper counts.
//
// As in optimizer offload, the update is one flat tensor: a parameter without a gradient is
// updated with a zero gradient (moments decay, weight decay applies) instead of being skipped.
// All parameters share one device and dtype. Not thread-safe; collective over dp in step(),
// and in load_shard_state() never (each rank loads its own range).
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "dtrain/dist/communicator.h"
#include "dtrain/engine/optim/offload.h"
#include "dtrain/engine/optim/optim.h"

namespace dtrain::engine {

class ShardedOptimizer : public Optimizer {
 public:
  // Throws dtrain::Error as make_optimizer() does, and for parameters of several devices or
  // dtypes. The parameters must already agree across dp (the trainer broadcasts rank 0's).
  ShardedOptimizer(std::vector<at::Tensor> params, const OptimizerOptions& options, dist::Communicator& dp);
  // ZeRO-3: also the parameters are partitioned. unit_starts (ascending, starting at 0) cut
  // the parameters into units of consecutive parameters; each unit's parameters become views
  // of a flat buffer of its own whose storage is released at once and materialized only by
  // gather_unit() (until release_unit()), while this rank keeps its range of the weights in a
  // buffer of its own between steps. step() updates that range only (no all-gather).
  ShardedOptimizer(std::vector<at::Tensor> params, const OptimizerOptions& options, dist::Communicator& dp,
                   std::vector<size_t> unit_starts);
  // ZeRO-3 with the optimizer offloaded (the ZeRO-Offload layout of stage 3, --shard=parameters
  // --offload=optimizer): as above, but this rank's fp32 master range and optimizer state live
  // in host memory (pinned when the parameters are on a GPU; offload.host_mem_limit_gb caps it)
  // and the CPU optimizer (offload::CpuOptimizer, offload.threads) updates them; the new weights
  // go back to the rank's range of the weights on the device. The device keeps only that range
  // and its gradients. offload's streaming and delayed-update options are not used (the trainer
  // refuses them).
  ShardedOptimizer(std::vector<at::Tensor> params, const OptimizerOptions& options, dist::Communicator& dp,
                   std::vector<size_t> unit_starts, const OffloadOptions& offload);
  ~ShardedOptimizer() override;

  // ZeRO-3 (the constructor with units): the number of units, the parameter indices of unit k
  // ([first, last)) and its elements of the flat space.
  int units() const;
  std::pair<size_t, size_t> unit_params(int k) const;
  FlatRange unit_range(int k) const;
  // Materializes unit k's buffer and issues the broadcasts of its pieces from their owners
  // over dp (the owner first copies its piece in): the parameters hold the unit's current
  // weights once every returned Work completes. Collective over dp, in the same order on
  // every rank; a no-op returning nothing while the unit is gathered already.
  std::vector<dist::WorkPtr> gather_unit(int k);
  // Releases unit k's buffer (its parameters' storage then holds no bytes). Local; a no-op
  // when released already. The caller makes sure nothing still reads them (pending work).
  void release_unit(int k);
  bool unit_gathered(int k) const;

  void step(const at::Tensor& grad_multiplier) override;
  // Reads this rank's range of the gradients straight from the reducer's storage when the
  // reducer keeps it as one run in the master dtype (GradReducer::flat_gradients): the
  // gradient shard buffer is then not needed.
  void attach(GradReducer& reducer) override;
  void zero_grad() override;
  void set_lr(double lr) override;
  double lr() const override;
  const OptimizerOptions& options() const override { return options_; }
  std::vector<std::pair<std::string, at::Tensor>> state() const override { return {}; }
  void load_state(const std::vector<std::pair<std::string, at::Tensor>>& state) override;
  const std::vector<at::Tensor>& params() const override { return params_; }
  std::vector<FlatRange> gradient_owners() const override;
  std::vector<at::Tensor> device_state() const override;
  std::optional<ShardLayout> shard_layout() const override;
  ShardState shard_state() const override;
  void load_shard_state(const ShardState& state) override;
  // Offloaded: the host memory held (the range's master, state and gradient staging); else 0.
  int64_t host_bytes() const override;

 private:
  struct Impl;
  void init(std::vector<size_t> unit_starts, const OffloadOptions* offload);
  OptimizerOptions options_;
  std::vector<at::Tensor> params_;
  std::unique_ptr<Impl> impl_;
};

// ZeRO-3's units in a training step (the forward and backward hooks libtorch's C++ modules
// lack): run(k, forward) gathers unit k (waiting for its prefetch), issues the gather of unit
// k + 1, runs the unit's forward, and releases unit k again. With grad mode on, the output is
// tied to a backward step that gathers unit k again (prefetching unit k - 1) before anything
// of the unit's backward runs, and a hook on each of its parameters' gradients releases the
// unit once every one of them was computed. Runs each unit's forward and backward with only
// it (and the one prefetched) materialized: the peak holds about two units' weights plus the
// activations. Single-threaded (the training thread's forward; autograd's thread for
// backward); collective over dp through the optimizer's gathers (every rank must run the same
// units in the same order). Each of its calls (and its gradient hooks) makes the units' device
// current while it runs, so gathers and releases land there from any thread.
class ParameterUnits {
 public:
  explicit ParameterUnits(ShardedOptimizer& optimizer);
  ~ParameterUnits();
  ParameterUnits(const ParameterUnits&) = delete;
  ParameterUnits& operator=(const ParameterUnits&) = delete;
  at::Tensor run(int k, const std::function<at::Tensor()>& forward);
  // run()'s parts, for a unit whose forward is recomputed in backward (activation
  // checkpointing's hooks: before_forward / after_forward around the forward, before_backward
  // before the recomputation, which the gradient hooks then follow).
  void before_forward(int k);
  void after_forward(int k);
  void before_backward(int k);
  // Gathers every unit and waits (for reading or saving the whole weights), or releases every
  // unit (and drops pending prefetches after waiting for them).
  void gather_all();
  void release_all();
  int units() const;

  // For the timeline: what happened to each unit since the last take_events() (recording
  // only after record_events(true)). A gather's transfer where the backend measured it (MPI:
  // its executor thread), else from issue to the end of the wait; a computation from the
  // unit's gather being ready to its release (forward: the unit's forward; backward: until
  // its last gradient).
  struct Event {
    std::string name;  // "gather", "forward", "backward"
    int unit = 0;
    std::chrono::steady_clock::time_point start, end;
  };
  void record_events(bool on);
  std::vector<Event> take_events();

  struct State;  // shared with the backward steps

 private:
  std::shared_ptr<State> state_;
};

// ZeRO-3's units from parameter-name prefixes (TrainerOptions::shard_unit_starts, the examples'
// --shard_units): names are the trainer's parameters in order; the first parameter under each
// prefix begins a unit (the index returned). tensor_parallel[j] (optional) says parameter j is a
// tensor-parallel shard, for the message. Throws dtrain::Error naming the prefix and the fix for:
// no prefix, a prefix under which no parameter lies, a first parameter that begins no unit, and
// a unit that would begin inside a layer (between two parameters of one module, e.g. a
// tensor-parallel linear's weight and bias): a unit's forward must find all of its layers'
// weights gathered.
std::vector<size_t> unit_starts_of(const std::vector<std::string>& names, const std::vector<std::string>& prefixes,
                                   const std::vector<bool>& tensor_parallel = {});

// ZeRO-3's unit buffers: a tensor whose storage holds bytes only while its unit is gathered
// (views of it keep their offsets). release_unit_storage() frees the bytes;
// materialize_unit_storage() allocates them again (uninitialized) from the storage's
// allocator. Both work on the tensor's device whatever the calling thread's current device is
// (the CUDA caching allocator allocates on the current device; autograd's threads, a writer
// thread or a caller that never set one would otherwise get GPU 0's memory). Synchronous on
// the host; not thread-safe for one tensor.
void release_unit_storage(const at::Tensor& t);
void materialize_unit_storage(const at::Tensor& t);

// "none" | "optimizer" (ZeRO-1) | "gradients" (ZeRO-2: the same optimizer, and the reducer
// releases the gradient buckets this rank does not own, ReducerOptions::release_unowned):
// --shard. "parameters" (ZeRO-3: ShardedOptimizer with units and ParameterUnits, in the
// trainer with TrainerOptions::shard_unit_starts); anything else throws dtrain::Error listing
// the choices.
enum class ShardMode { kNone, kOptimizer, kGradients, kParameters };
ShardMode parse_shard_mode(const std::string& text);

}  // namespace dtrain::engine

#include "dtrain/dist/glog_compat.h"  // last: keeps glog's LOG macros whatever the include order
