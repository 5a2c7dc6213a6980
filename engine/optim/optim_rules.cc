// The update rules: SGD, Adam/AdamW and Adagrad, each as one call of ATen's fused
// multi-tensor kernel per group, or as _foreach_ ops computing torch.optim's single-tensor
// formulas where the fused kernel is not implemented (or OptimizerOptions::fused is off).
// Per-parameter scalars of the _foreach_ path (bias corrections, Adagrad's decayed lr) come
// from the host step counts, so neither path syncs with the device.
#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <cmath>

#include "optim_internal.h"

namespace dtrain::engine::optim_detail {
namespace {

using TensorVector = std::vector<at::Tensor>;

// The gradients times the step's multiplier, with L2 weight decay added (a new list), or the
// gradients themselves.
TensorVector with_weight_decay(const ParamGroup& group, double weight_decay) {
  TensorVector grads = group.multiplied_grads();
  if (weight_decay == 0.0) return grads;
  return at::_foreach_add(grads, group.params, weight_decay);
}

class Sgd final : public MultiTensorOptimizer {
 public:
  Sgd(std::vector<at::Tensor> params, const OptimizerOptions& options)
      : MultiTensorOptimizer(std::move(params), options,
                             options.momentum != 0.0 ? std::vector<std::string>{"momentum_buffer"}
                                                     : std::vector<std::string>{},
                             0.0, /*device_steps=*/false,
                             /*split_first_step=*/options.momentum != 0.0) {}

 protected:
  void update(ParamGroup& group) override {
    const OptimizerOptions& o = options_;
    bool has_buffer = o.momentum != 0.0;
    // torch's CPU _fused_sgd_ leaves the vectorized blocks of fp16/bf16 parameters unchanged
    // (pytorch/pytorch#191763, seen in 2.11 to 2.13): those take the _foreach_ path.
    bool cpu_low_precision = group.device.is_cpu() && at::isReducedFloatingType(group.dtype);
    if (!cpu_low_precision && try_fused(group)) {
      try {
        at::_fused_sgd_(group.params, group.grads,
                        has_buffer ? at::TensorList(group.slots[0]) : at::TensorList(),
                        o.weight_decay, o.momentum, o.lr, o.dampening, o.nesterov,
                        /*maximize=*/false, /*is_first_step=*/has_buffer && group.first_step,
                        group.fused_grad_scale());
        return;
      } catch (const c10::NotImplementedError&) {
        remember_no_fused(group);
      }
    }
    TensorVector d = with_weight_decay(group, o.weight_decay);
    if (has_buffer) {
      TensorVector& bufs = group.slots[0];
      if (group.first_step) {
        at::_foreach_copy_(bufs, d);
      } else {
        at::_foreach_mul_(bufs, o.momentum);
        at::_foreach_add_(bufs, d, 1.0 - o.dampening);
      }
      d = o.nesterov ? at::_foreach_add(d, bufs, o.momentum) : bufs;
    }
    at::_foreach_add_(group.params, d, -o.lr);
  }
};

class Adam final : public MultiTensorOptimizer {
 public:
  Adam(std::vector<at::Tensor> params, const OptimizerOptions& options)
      : MultiTensorOptimizer(std::move(params), options, slot_names(options.amsgrad), 0.0,
                             /*device_steps=*/true, /*split_first_step=*/false),
        decoupled_(rule_traits(options.name).decoupled_weight_decay) {}

 protected:
  void update(ParamGroup& group) override {
    const OptimizerOptions& o = options_;
    // slots: step, exp_avg, exp_avg_sq[, max_exp_avg_sq]
    at::TensorList max_sqs = o.amsgrad ? at::TensorList(group.slots[3]) : at::TensorList();
    if (try_fused(group)) {
      try {
        auto fused = decoupled_ ? &fused_adamw : &fused_adam;
        fused(group.params, group.grads, group.slots[1], group.slots[2], max_sqs, group.slots[0],
              o.lr, o.beta1, o.beta2, o.weight_decay, o.eps, o.amsgrad, group.fused_grad_scale(),
              group.skip.defined() ? std::optional<at::Tensor>(group.skip) : std::nullopt);
        return;
      } catch (const c10::NotImplementedError&) {
        remember_no_fused(group);
      }
    }
    if (dropped(group)) return;
    update_foreach(group);
  }
  bool fused_kernels_skip() const override { return true; }

 private:
  static std::vector<std::string> slot_names(bool amsgrad) {
    std::vector<std::string> names = {"exp_avg", "exp_avg_sq"};
    if (amsgrad) names.push_back("max_exp_avg_sq");
    return names;
  }
  // The fused kernels with the lr overload chosen (double) and maximize off.
  static void fused_adam(at::TensorList p, at::TensorList g, at::TensorList m, at::TensorList v,
                         at::TensorList vmax, at::TensorList steps, double lr, double beta1,
                         double beta2, double wd, double eps, bool amsgrad,
                         const std::optional<at::Tensor>& grad_scale, const std::optional<at::Tensor>& found_inf) {
    at::_fused_adam_(p, g, m, v, vmax, steps, lr, beta1, beta2, wd, eps, amsgrad, false, grad_scale, found_inf);
  }
  static void fused_adamw(at::TensorList p, at::TensorList g, at::TensorList m, at::TensorList v,
                          at::TensorList vmax, at::TensorList steps, double lr, double beta1,
                          double beta2, double wd, double eps, bool amsgrad,
                          const std::optional<at::Tensor>& grad_scale, const std::optional<at::Tensor>& found_inf) {
    at::_fused_adamw_(p, g, m, v, vmax, steps, lr, beta1, beta2, wd, eps, amsgrad, false, grad_scale, found_inf);
  }

  void update_foreach(ParamGroup& group) {
    const OptimizerOptions& o = options_;
    TensorVector d;
    if (decoupled_) {
      if (o.weight_decay != 0.0) at::_foreach_mul_(group.params, 1.0 - o.lr * o.weight_decay);
      d = group.multiplied_grads();
    } else {
      d = with_weight_decay(group, o.weight_decay);
    }
    TensorVector& exp_avgs = group.slots[1];
    TensorVector& exp_avg_sqs = group.slots[2];
    at::_foreach_lerp_(exp_avgs, d, 1.0 - o.beta1);
    at::_foreach_mul_(exp_avg_sqs, o.beta2);
    at::_foreach_addcmul_(exp_avg_sqs, d, d, 1.0 - o.beta2);
    std::vector<at::Scalar> neg_step_sizes, bias_correction2_sqrts;
    for (int64_t step : group.host_steps) {
      double n = static_cast<double>(step);
      neg_step_sizes.emplace_back(-o.lr / (1.0 - std::pow(o.beta1, n)));
      bias_correction2_sqrts.emplace_back(std::sqrt(1.0 - std::pow(o.beta2, n)));
    }
    TensorVector denom;
    if (o.amsgrad) {
      at::_foreach_maximum_(group.slots[3], exp_avg_sqs);
      denom = at::_foreach_sqrt(group.slots[3]);
    } else {
      denom = at::_foreach_sqrt(exp_avg_sqs);
    }
    at::_foreach_div_(denom, bias_correction2_sqrts);
    at::_foreach_add_(denom, o.eps);
    at::_foreach_addcdiv_(group.params, exp_avgs, denom, neg_step_sizes);
  }

  bool decoupled_;
};

class Adagrad final : public MultiTensorOptimizer {
 public:
  Adagrad(std::vector<at::Tensor> params, const OptimizerOptions& options)
      : MultiTensorOptimizer(std::move(params), options, {"sum"}, options.initial_accumulator_value,
                             /*device_steps=*/true,
                             /*split_first_step=*/false),
        eps_(effective_eps(options)) {}

 protected:
  void update(ParamGroup& group) override {
    const OptimizerOptions& o = options_;
    // slots: step, sum
    if (try_fused(group)) {
      try {
        at::_fused_adagrad_(group.params, group.grads, group.slots[1], group.slots[0], o.lr,
                            o.lr_decay, o.weight_decay, eps_, /*maximize=*/false, group.fused_grad_scale(),
                            group.skip.defined() ? std::optional<at::Tensor>(group.skip) : std::nullopt);
        return;
      } catch (const c10::NotImplementedError&) {
        remember_no_fused(group);
      }
    }
    TensorVector d = with_weight_decay(group, o.weight_decay);
    if (group.skip.defined()) {
      // Dropped on the device (no host read): the step's direction becomes zero, so the sums
      // and the weights stay as they were; where(), not a product, so NaN and Inf go too.
      // Without lr_decay the learning rate does not depend on the host's step count.
      const at::Tensor dropped = group.skip.ne(0);
      for (at::Tensor& t : d) t = at::where(dropped, at::Scalar(0.0), t);
    }
    std::vector<at::Scalar> neg_clrs;
    for (int64_t step : group.host_steps) {
      neg_clrs.emplace_back(-o.lr / (1.0 + static_cast<double>(step - 1) * o.lr_decay));
    }
    at::_foreach_addcmul_(group.slots[1], d, d, 1.0);
    TensorVector std_dev = at::_foreach_sqrt(group.slots[1]);
    at::_foreach_add_(std_dev, eps_);
    at::_foreach_addcdiv_(group.params, d, std_dev, neg_clrs);
  }

  // The fused kernel (CPU and CUDA) drops a flagged update itself; the _foreach_ path (fused
  // off, or a dtype without a fused kernel) drops it by where(), which needs a learning rate
  // that does not count host steps (lr_decay 0, the default).
  bool skips_on_device() const override { return options_.lr_decay == 0.0; }

 private:
  double eps_;
};

}  // namespace

std::unique_ptr<Optimizer> make_sgd(std::vector<at::Tensor> params,
                                    const OptimizerOptions& options) {
  return std::make_unique<Sgd>(std::move(params), options);
}

std::unique_ptr<Optimizer> make_adam(std::vector<at::Tensor> params,
                                     const OptimizerOptions& options) {
  return std::make_unique<Adam>(std::move(params), options);
}

std::unique_ptr<Optimizer> make_adagrad(std::vector<at::Tensor> params,
                                        const OptimizerOptions& options) {
  return std::make_unique<Adagrad>(std::move(params), options);
}

}  // namespace dtrain::engine::optim_detail
