// Optimizers over a list of parameters, run as ATen's fused multi-tensor kernels
// (_fused_adam_, _fused_adamw_, _fused_sgd_, _fused_adagrad_) on the parameters' device, with
// a _foreach_ fallback where a fused kernel does not exist for that device. Semantics equal
// torch.optim's (same update formulas, same defaults); see each field.
//
// Synchronous on the host with respect to the queued device work (kernels are enqueued on
// the current stream). Not thread-safe. Parameters and gradients are owned by the caller;
// state tensors are owned by the optimizer, on the parameters' device and dtype.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

namespace dtrain::engine {

struct OptimizerOptions {
  std::string name = "adamw";  // "sgd", "adam", "adamw", "adagrad"
  double lr = 1e-3;
  double weight_decay = 0.0;   // adamw: decoupled; others: L2 added to the gradient
  // sgd
  double momentum = 0.0;
  double dampening = 0.0;
  bool nesterov = false;
  // adam / adamw
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;           // adagrad uses eps too (torch default 1e-10 is applied for adagrad
                               // when this field is left at its default)
  bool amsgrad = false;
  // adagrad
  double lr_decay = 0.0;
  double initial_accumulator_value = 0.0;
};

// Throws dtrain::Error for an unknown name, a negative or non-finite lr, betas outside
// [0, 1), negative eps / weight decay / momentum, nesterov without momentum.
void validate(const OptimizerOptions& options);

class Optimizer {
 public:
  virtual ~Optimizer() = default;
  // One update of every parameter whose gradient is defined. Parameters without a gradient
  // are skipped (and their state not advanced), as in torch.optim.
  virtual void step() = 0;
  // Sets every gradient to zero in place (keeps the tensors: the reducer's bucket views
  // must survive). Undefined gradients stay undefined.
  virtual void zero_grad() = 0;
  virtual void set_lr(double lr) = 0;
  virtual double lr() const = 0;
  virtual const OptimizerOptions& options() const = 0;
  // Named state for checkpoints: "<param index>.<state name>" -> tensor (e.g. "3.exp_avg",
  // "3.step"). load_state() checks names and shapes and throws dtrain::Error on mismatch.
  virtual std::vector<std::pair<std::string, at::Tensor>> state() const = 0;
  virtual void load_state(const std::vector<std::pair<std::string, at::Tensor>>& state) = 0;
  virtual const std::vector<at::Tensor>& params() const = 0;
};

// Creates the optimizer named by options.name over params (leaf tensors requiring grad).
// Throws dtrain::Error as validate() does, or for an empty parameter list.
std::unique_ptr<Optimizer> make_optimizer(std::vector<at::Tensor> params,
                                          const OptimizerOptions& options);

// Learning-rate schedules: lr(step) for step = 0, 1, ... (the step about to be taken).
struct ScheduleOptions {
  std::string name = "constant";  // "constant", "cosine" (warm-up then cosine), "linear"
  int64_t warmup_steps = 0;       // linear ramp from 0 to the base lr over these steps
  int64_t total_steps = 0;        // cosine/linear decay ends here (needed for those)
  double min_lr_ratio = 0.0;      // floor of the decay, as a fraction of the base lr
};
void validate(const ScheduleOptions& options);
// The factor (0..1] that multiplies the base lr at this step.
double schedule_factor(const ScheduleOptions& options, int64_t step);

// Global L2 norm of the given gradients (undefined ones skipped), computed in float32 on
// their device and returned as a 0-dim float tensor (no host sync).
at::Tensor grad_norm(const std::vector<at::Tensor>& grads);
// Scales the gradients in place by min(1, max_norm / (norm + 1e-6)), where norm is
// given (possibly already combined across ranks). No host sync.
void clip_grads(const std::vector<at::Tensor>& grads, const at::Tensor& norm, double max_norm);

}  // namespace dtrain::engine
