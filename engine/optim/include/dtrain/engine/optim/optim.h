// Optimizers over a list of parameters, run as ATen's fused multi-tensor kernels
// (_fused_adam_, _fused_adamw_, _fused_sgd_, _fused_adagrad_) on the parameters' device, with
// a _foreach_ fallback where a fused kernel does not exist for that device. Semantics equal
// torch.optim's (same update formulas, same defaults); see each field.
//
// Synchronous on the host with respect to the queued device work (kernels are enqueued on
// the current stream). Not thread-safe. Parameters and gradients are owned by the caller;
// state tensors are owned by the optimizer, on the parameters' device and dtype.
#pragma once

#include <ATen/core/Tensor.h>

#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "dtrain/engine/core/shard.h"
#include "dtrain/offload/update_rule.h"

namespace dtrain::engine {

class GradReducer;

// The update rule's fields (name, lr, weight_decay, momentum, betas, eps, ...) with their
// defaults are offload::UpdateRuleOptions, shared with the CPU optimizer of optimizer offload.
// Adagrad's eps: the value 1e-8 (the field's default) stands for torch's Adagrad default,
// 1e-10; any other value is used as given (effective_eps(), from the rule table of
// dtrain/offload/update_rule.h, which every name lookup goes through: rule_traits()).
struct OptimizerOptions : offload::UpdateRuleOptions {
  // true: ATen's fused kernels where the device has them (the _foreach_ implementation of
  // the same formulas otherwise, and for fp16/bf16 sgd on the CPU, where torch's fused kernel
  // skips elements, pytorch/pytorch#191763); false: always the _foreach_ implementation.
  bool fused = true;
};

using offload::effective_eps;
using offload::Rule;
using offload::rule_traits;

// Throws dtrain::Error for an unknown name (the message lists the known ones), a negative
// or non-finite lr, and, for the fields the named optimizer uses: betas outside [0, 1),
// negative or non-finite eps / weight decay / momentum / dampening / lr_decay /
// initial_accumulator_value, nesterov without momentum or with dampening.
void validate(const OptimizerOptions& options);

// When an optimizer's last update ran on the host (for the timeline). background: it ran on
// a thread of its own while the caller went on (the delayed update of optimizer offload).
struct UpdateTiming {
  std::chrono::steady_clock::time_point start, end;
  bool background = false;
};

// The contract between the trainer and every optimizer: replicated, partitioned across the
// data-parallel group, offloaded to the host, or updating in the background. The trainer
// drives any optimizer through this interface alone. The methods after load_state() have
// defaults that describe a replicated optimizer updating every parameter on the calling
// thread; partitioned and asynchronous optimizers override them.
class Optimizer {
 public:
  virtual ~Optimizer() = default;
  // One update of every parameter whose gradient is defined. Parameters without a gradient
  // are skipped (and their state not advanced), as in torch.optim. Runs under no-grad.
  // grad_multiplier: undefined (1), or a one-element floating tensor on any device by which
  // every gradient is multiplied before the update (before weight decay): the trainer passes
  // 1 / loss scale x the clipping coefficient, so it never rewrites the gradients. The
  // optimizer reads the gradients; ATen's fused kernels (used here as torch.optim's fused
  // path uses them, grad_scale = 1 / grad_multiplier) write the multiplied gradient back into
  // .grad. A gradient must have its parameter's device, dtype, sizes and strides (as autograd
  // makes them); otherwise throws dtrain::Error before anything is updated. Host work is a
  // scan of which gradients are defined; the tensor lists are rebuilt only when that set (or a
  // gradient tensor) changes.
  virtual void step(const at::Tensor& grad_multiplier) = 0;
  void step() { step(at::Tensor()); }
  // Whether step_unless() can drop an update on the device, without the host reading the
  // flag: the fused Adam/AdamW kernels (their found_inf; on the CPU too, where it saves
  // nothing). Default: false.
  virtual bool skips_on_device() const { return false; }
  // step(grad_multiplier), dropped on the device where `skip` (one element, any floating
  // dtype, on the parameters' device) is nonzero: then no parameter or state changes, as with
  // skip_step(). Only where skips_on_device(); otherwise throws dtrain::Error.
  virtual void step_unless(const at::Tensor& grad_multiplier, const at::Tensor& skip);
  // This step's update is dropped (e.g. its fp16 gradients overflowed): nothing is updated,
  // and the optimizer has stopped reading this step's gradients when it returns, so the caller
  // may zero them. Default: nothing to do.
  virtual void skip_step() {}
  // Sets every gradient to zero in place (keeps the tensors: the reducer's bucket views
  // must survive). Undefined gradients stay undefined.
  virtual void zero_grad() = 0;
  // Takes effect from the next step(). Throws dtrain::Error for a negative or non-finite lr.
  virtual void set_lr(double lr) = 0;
  virtual double lr() const = 0;
  virtual const OptimizerOptions& options() const = 0;
  // Replicated named state for checkpoints: "<param index>.<state name>" -> tensor. For the
  // replicated optimizers of make_optimizer(), every parameter's (allocated at construction
  // with the values torch gives new state: zeros, and initial_accumulator_value for adagrad's
  // sum):
  //   every optimizer: "step" (float32, 0-dim: updates taken by that parameter);
  //   sgd with momentum != 0: "momentum_buffer" (set to the gradient by a parameter's first
  //   update, as torch does); adam/adamw: "exp_avg", "exp_avg_sq", and "max_exp_avg_sq"
  //   with amsgrad; adagrad: "sum".
  // Moment/sum/buffer tensors have the parameter's device, dtype and sizes (no float32
  // master state for reduced-precision parameters: as torch.optim). The returned tensors
  // alias the live state (sgd's "step" is a fresh copy): clone them to keep a snapshot.
  // A partitioned optimizer returns only what is replicated (see shard_state()).
  // load_state() copies values in (any device/dtype); it requires exactly the names state()
  // gives, each with the right sizes, and throws dtrain::Error naming the first missing,
  // unknown or mis-shaped entry, before changing anything. It syncs with the host.
  virtual std::vector<std::pair<std::string, at::Tensor>> state() const = 0;
  virtual void load_state(const std::vector<std::pair<std::string, at::Tensor>>& state) = 0;
  virtual const std::vector<at::Tensor>& params() const = 0;

  // ---- partitioned, offloaded and asynchronous optimizers ----------------------------------
  // The range of the flat gradient space (the parameters of params() end to end) that each
  // rank of the data-parallel group reads in step(), entry r for rank r, when every rank
  // reads only its own part (the reducer then reduces each gradient to its owner only,
  // ReducerOptions::owned); empty: every rank reads every gradient (all-reduce).
  virtual std::vector<FlatRange> gradient_owners() const { return {}; }
  // Lets the optimizer watch reducer's buckets (e.g. to copy each bucket's gradients to the
  // host while backward goes on). Call once, after both exist; reducer must outlive this
  // optimizer. Default: the optimizer reads the gradients in step().
  virtual void attach(GradReducer& reducer) {}
  // Completes an update still in flight so that the parameters hold every step's update
  // (before saving or evaluating the model). Collective over the data-parallel group when an
  // update is in flight. Default: nothing is ever in flight.
  virtual void flush() {}
  // For the memory report: pinned host memory this optimizer holds, and its state tensors
  // that live on a device (default: none on the host; the tensors of state()).
  virtual int64_t host_bytes() const { return 0; }
  virtual std::vector<at::Tensor> device_state() const;
  // When a host update ran, each finished one taken once, oldest first (empty when none is
  // left): call until empty. Background updates can finish two to a step under load; none is
  // dropped. Default: empty.
  virtual std::optional<UpdateTiming> take_update_timing() { return std::nullopt; }
  // The partitioned part of the state: its layout (shard.h) on this rank, or empty when the
  // optimizer is replicated. shard_state() returns this rank's part (tensors copied to the
  // host, finishing an update in flight first without publishing it); load_shard_state()
  // loads the state of exactly shard_layout() (assemble_shard() builds it from any saved
  // layout) and throws dtrain::Error naming a missing, unknown or mis-sized entry or another
  // layout, before changing anything. Defaults: nothing partitioned; load_shard_state()
  // accepts only an empty state.
  virtual std::optional<ShardLayout> shard_layout() const { return std::nullopt; }
  virtual ShardState shard_state() const { return {}; }
  virtual void load_shard_state(const ShardState& state);
};

// For optimizers over one flat buffer (offload, --shard): throws dtrain::Error, naming `who`,
// for an empty list or parameters of more than one dtype or device.
void check_one_flat_space(const std::vector<at::Tensor>& params, const std::string& who);

// Creates the optimizer named by options.name over params (leaf tensors requiring grad,
// dense, non-overlapping; any mix of devices and floating dtypes: each (device, dtype) is
// one group of kernel launches). Allocates the state (see state()) now. Throws
// dtrain::Error as validate() does, or for an empty parameter list, a parameter listed
// twice, a non-leaf or non-floating-point parameter.
std::unique_ptr<Optimizer> make_optimizer(std::vector<at::Tensor> params,
                                          const OptimizerOptions& options);

// Learning-rate schedules: lr(step) for step = 0, 1, ... (the step about to be taken).
// With W = warmup_steps, T = total_steps, m = min_lr_ratio:
//   step < W:          (step + 1) / W                  (every schedule; first step lr > 0)
//   constant:          1 after the warm-up
//   cosine, W <= step < T:  m + (1 - m) * (1 + cos(pi * (step - W) / (T - W))) / 2
//   linear, W <= step < T:  m + (1 - m) * (1 - (step - W) / (T - W))
//   cosine/linear, step >= T: m
// So the factor is 1 at step W and decays towards m, reached at step T (not taken in a
// run of T steps). Up to step T equal to torch's LinearLR(1/W, 1, W - 1) then
// CosineAnnealingLR(T - W, eta_min = m) or LinearLR(1, m, T - W), joined by SequentialLR at
// milestone W (after T, CosineAnnealingLR rises again; this schedule stays at m).
struct ScheduleOptions {
  std::string name = "constant";  // "constant", "cosine" (warm-up then cosine), "linear"
  int64_t warmup_steps = 0;       // linear ramp from 0 to the base lr over these steps
  int64_t total_steps = 0;        // cosine/linear decay ends here (needed for those)
  double min_lr_ratio = 0.0;      // floor of the decay, as a fraction of the base lr
};
// Throws dtrain::Error for an unknown name (listing the known ones), negative warmup_steps,
// min_lr_ratio outside [0, 1], and for cosine/linear: total_steps <= 0 or < warmup_steps.
void validate(const ScheduleOptions& options);
// The factor in [min_lr_ratio, 1] (or (0, 1] during warm-up) that multiplies the base lr
// at this step. Throws dtrain::Error as validate() does, or for a negative step.
double schedule_factor(const ScheduleOptions& options, int64_t step);

// Scales the gradients in place by min(1, max_norm / (norm + 1e-6)), where norm is
// given (possibly already combined across ranks), as torch.nn.utils.clip_grad_norm_.
// Enqueues work, no host sync. A non-finite norm makes the gradients non-finite (check
// first, e.g. with the loss scaler). Throws dtrain::Error for a negative or non-finite
// max_norm or a norm that is not a single-element tensor.
// Returns the factor applied, min(1, max_norm / (norm + 1e-6)), as a 0-dim tensor on the
// norm's device.
at::Tensor clip_grads(const std::vector<at::Tensor>& grads, const at::Tensor& norm, double max_norm);
// The factor clip_grads() applies, min(1, max_norm / (norm + 1e-6)), as a 0-dim float32
// tensor on the norm's device, without touching any gradient (pass it to
// Optimizer::step(grad_multiplier)). Throws as clip_grads() does.
at::Tensor clip_coefficient(const at::Tensor& norm, double max_norm);

}  // namespace dtrain::engine

#include "dtrain/dist/glog_compat.h"  // last: keeps glog's LOG macros whatever the include order
