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

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "dtrain/dist/communicator.h"
#include "dtrain/engine/optim/optim.h"

namespace dtrain::engine {

class ShardedOptimizer : public Optimizer {
 public:
  // Throws dtrain::Error as make_optimizer() does, and for parameters of several devices or
  // dtypes. The parameters must already agree across dp (the trainer broadcasts rank 0's).
  ShardedOptimizer(std::vector<at::Tensor> params, const OptimizerOptions& options, dist::Communicator& dp);
  ~ShardedOptimizer() override;

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

 private:
  struct Impl;
  OptimizerOptions options_;
  std::vector<at::Tensor> params_;
  std::unique_ptr<Impl> impl_;
};

// "none" | "optimizer" (ZeRO-1) | "gradients" (ZeRO-2: the same optimizer, and the reducer
// releases the gradient buckets this rank does not own, ReducerOptions::release_unowned):
// --shard. "parameters" (ZeRO-3: Zero3Optimizer and ParameterUnits, zero3/, in the trainer
// with TrainerOptions::shard_unit_starts); anything else throws dtrain::Error listing
// the choices.
enum class ShardMode { kNone, kOptimizer, kGradients, kParameters };
ShardMode parse_shard_mode(const std::string& text);

}  // namespace dtrain::engine

#include "dtrain/dist/glog_compat.h"  // last: keeps glog's LOG macros whatever the include order
