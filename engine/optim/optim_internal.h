// Private to the optimizer sources: the multi-tensor base class shared by SGD, Adam(W) and
// Adagrad. Not installed.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <unordered_set>
#include <utility>
#include <vector>

#include "dtrain/engine/optim/optim.h"

namespace dtrain::engine::optim_detail {

// Throws dtrain::Error unless p is a defined, dense, non-overlapping floating-point leaf tensor
// not already in `seen` (which it is added to); `index` names it.
void check_param(const at::Tensor& p, size_t index, std::unordered_set<const void*>& seen);

// The parameters of one (device, dtype) with defined gradients, as the lists the fused and
// _foreach_ kernels take. slots[s][k] is state slot s of params[k].
struct ParamGroup {
  c10::Device device = c10::kCPU;
  at::ScalarType dtype = at::kFloat;
  // sgd: these parameters take their first update (momentum buffer = gradient).
  bool first_step = false;
  std::vector<int64_t> indices;  // into Optimizer::params()
  std::vector<at::Tensor> params;
  std::vector<at::Tensor> grads;
  std::vector<std::vector<at::Tensor>> slots;
  std::vector<int64_t> host_steps;  // updates taken by params[k], including this one
  // This step's gradient multiplier (Optimizer::step) on the group's device, float32 0-dim,
  // and its reciprocal, the grad_scale ATen's fused kernels divide by; undefined: 1.
  at::Tensor multiplier;
  at::Tensor grad_scale;
  // step_unless(): nonzero drops the update (float32 0-dim on the group's device); undefined:
  // update. The fused kernels' found_inf.
  at::Tensor skip;
  // The gradients times the multiplier (a new list when there is one): for the _foreach_ path.
  std::vector<at::Tensor> multiplied_grads() const;
  std::optional<at::Tensor> fused_grad_scale() const {
    return grad_scale.defined() ? std::optional<at::Tensor>(grad_scale) : std::nullopt;
  }
};

// Keeps the state slots, the per-parameter step counts on the host, and the cached groups;
// a subclass supplies the update of one group.
class MultiTensorOptimizer : public Optimizer {
 public:
  using Optimizer::step;
  void step(const at::Tensor& grad_multiplier) override;
  bool skips_on_device() const override;
  void step_unless(const at::Tensor& grad_multiplier, const at::Tensor& skip) override;
  void zero_grad() override;
  void set_lr(double lr) override;
  double lr() const override { return options_.lr; }
  const OptimizerOptions& options() const override { return options_; }
  std::vector<std::pair<std::string, at::Tensor>> state() const override;
  void load_state(const std::vector<std::pair<std::string, at::Tensor>>& state) override;
  const std::vector<at::Tensor>& params() const override { return params_; }

 protected:
  // slot_names: the per-parameter state besides "step", each allocated like its parameter
  // and filled with slot_init; device_steps: whether "step" is also kept as a float32 0-dim
  // tensor on the parameter's device (slot 0 of ParamGroup::slots then, the fused kernels
  // read it there); split_first_step: group parameters that take their first update apart.
  MultiTensorOptimizer(std::vector<at::Tensor> params, const OptimizerOptions& options,
                       std::vector<std::string> slot_names, double slot_init, bool device_steps,
                       bool split_first_step);

  // Updates one group; "step" tensors (if kept) are already incremented and host_steps
  // count this update. Enqueues work on the current stream, no host sync.
  virtual void update(ParamGroup& group) = 0;

  // Whether the fused kernels may be tried for this group; remember_no_fused() records
  // that one was not implemented for the group's device type and dtype.
  bool try_fused(const ParamGroup& group) const;
  void remember_no_fused(const ParamGroup& group);
  // Whether update()'s fused kernels honour ParamGroup::skip (subclasses that pass it on).
  virtual bool fused_kernels_skip() const { return false; }
  // For update()'s paths other than a fused kernel: whether this step's update is dropped
  // (reads group.skip on the host: a synchronization, on the rare groups without a fused kernel).
  bool dropped(const ParamGroup& group);

  OptimizerOptions options_;

 private:
  bool grads_changed();
  void rebuild_groups();

  std::vector<at::Tensor> params_;
  std::vector<std::string> slot_names_;         // with "step" first when device_steps_
  std::vector<std::vector<at::Tensor>> slots_;  // [slot][param]
  bool device_steps_;
  bool split_first_step_;
  std::vector<int64_t> host_steps_;
  std::vector<const c10::TensorImpl*> cached_grads_;  // nullptr: undefined at last scan
  std::vector<ParamGroup> groups_;
  bool groups_stale_ = true;
  std::vector<std::pair<c10::DeviceType, at::ScalarType>> no_fused_;
  at::Tensor skip_;  // inside step_unless()
};

std::unique_ptr<Optimizer> make_sgd(std::vector<at::Tensor> params,
                                    const OptimizerOptions& options);
std::unique_ptr<Optimizer> make_adam(std::vector<at::Tensor> params,
                                     const OptimizerOptions& options);
std::unique_ptr<Optimizer> make_adagrad(std::vector<at::Tensor> params,
                                        const OptimizerOptions& options);

}  // namespace dtrain::engine::optim_detail
