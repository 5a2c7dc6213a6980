// Automatic mixed precision: an autocast guard and a dynamic loss scaler with the semantics
// of PyTorch's GradScaler.
#pragma once

#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/DeviceType.h>

namespace dtrain::dist {
class Communicator;
}

namespace dtrain::engine {

enum class AmpMode { kOff, kBf16, kFp16 };
// "off", "bf16", "fp16"; throws dtrain::Error naming the accepted values otherwise.
AmpMode parse_amp(const std::string& text);
const char* to_string(AmpMode mode);

// The dtype the trained weights are kept in (--param_dtype): "float32" (or "fp32") or
// "bfloat16" (or "bf16"); throws dtrain::Error naming the accepted values otherwise. With
// bfloat16 weights the gradients are bfloat16 too (half the bytes to reduce and to copy to the
// host) and a partitioned or offloaded optimizer keeps the float32 master weights.
at::ScalarType parse_param_dtype(const std::string& text);

// While alive, ops on `device` run under autocast to the mode's dtype (kBf16: bfloat16,
// kFp16: float16; CPU and CUDA support both). kOff does nothing at all: it neither enables
// nor disables autocast. Restores the previous autocast state (enabled, dtype) of that
// device type on destruction and, when the outermost guard ends, clears the autocast cast
// cache, as torch.autocast does (the cache holds low-precision copies of weights, which an
// optimizer step would make stale). Autocast state is thread-local: create and destroy the
// guard on one thread; nest guards LIFO. Throws dtrain::Error for a device type without
// autocast (e.g. meta) unless the mode is kOff. Not copyable.
class AutocastGuard {
 public:
  AutocastGuard(c10::DeviceType device, AmpMode mode);
  ~AutocastGuard();
  AutocastGuard(const AutocastGuard&) = delete;
  AutocastGuard& operator=(const AutocastGuard&) = delete;

 private:
  c10::DeviceType device_;
  bool active_ = false;
  bool prev_enabled_ = false;
  c10::ScalarType prev_dtype_;
};

// 1.0 (float32, on the tensors' device) if any element of `tensors` is inf or NaN, else 0.0;
// undefined and empty tensors are skipped (no tensor left: 0.0 on the CPU). The tensors must
// share one device; their dtypes may differ. Reads only; no host sync.
at::Tensor any_nonfinite(const std::vector<at::Tensor>& tensors);

struct LossScalerOptions {
  bool enabled = true;          // false: scale 1, never skips (bf16 and fp32 runs)
  double init_scale = 65536.0;  // 2^16
  double growth_factor = 2.0;
  double backoff_factor = 0.5;
  int64_t growth_interval = 2000;
};

// Dynamic loss scaling (GradScaler semantics):
//   scaled = scaler.scale(loss); scaled.backward();
//   bool ok = scaler.unscale(grads, comm);   // before clipping; false: inf/NaN found
//   if (ok) optimizer.step();
//   scaler.update();                         // once per step, whether skipped or not
// The scale and growth tracker live on `device` (as float32 / int32 tensors); update() uses
// ATen's _amp_update_scale_ and unscale() _amp_foreach_non_finite_check_and_unscale_.
// update() backs the scale off (x backoff_factor) after a step with inf/NaN gradients and
// grows it (x growth_factor) after growth_interval consecutive finite steps.
//
// unscale(grads, comm): multiplies every defined gradient in place by 1/scale (the reciprocal
// taken in double and rounded to float, as GradScaler does) and checks for inf/NaN. Grads may
// be any floating dtype and live on any devices (grouped per device and dtype; sparse grads
// contribute their values); undefined ones are skipped; a non-floating one throws before any
// is touched. Unscaled gradients are garbage in a step that returns false. With comm (size
// > 1) the found-inf flag is all-reduced with max over its ranks (a collective: every rank
// must call unscale on it in the same step) so every rank skips the same steps; pass nullptr
// for a single process. unscale() syncs with the host once (to return); it increments
// skipped_steps() when it returns false.
//
// Misuse throws dtrain::Error: unscale() (or check_finite()) twice without update() in
// between, or update() without either since the last update() (pass an empty list when a step has no grads).
// A disabled scaler (options.enabled = false) does nothing: scale() returns loss itself,
// unscale() returns true without touching grads or comm, update() returns, scale_value()
// is 1, state() is empty and load_state() ignores its argument.
// Not thread-safe; kernels run on the current stream of `device`.
class LossScaler {
 public:
  // Throws dtrain::Error for options out of range (init_scale <= 0, growth_factor <= 1,
  // backoff_factor outside (0, 1), growth_interval < 1) when enabled.
  LossScaler(LossScalerOptions options, c10::Device device);
  // loss * scale (a new tensor in the autograd graph, float32 or wider, on loss's device).
  at::Tensor scale(const at::Tensor& loss) const;
  bool unscale(const std::vector<at::Tensor>& grads, dist::Communicator* comm);
  // unscale() without touching the gradients: only the inf/NaN check (read-only, one pass
  // over each gradient), agreed over comm the same way. The caller then multiplies the
  // gradients by inverse_scale() where it uses them (Optimizer::step's grad_multiplier).
  // Either this or unscale() once per step, then update().
  bool check_finite(const std::vector<at::Tensor>& grads, dist::Communicator* comm);
  // 1 / scale as GradScaler computes it (reciprocal in double, rounded to float): a float32
  // 0-dim tensor on the scaler's device. 1 when disabled.
  at::Tensor inverse_scale() const;
  void update();
  double scale_value() const;  // host read of the current scale (syncs)
  bool enabled() const { return options_.enabled; }
  int64_t skipped_steps() const { return skipped_; }
  // For checkpoints: {"scale", "growth_tracker"} (copies, on the scaler's device). load_state
  // copies them in (from any device) and throws dtrain::Error, naming the problem and
  // changing nothing, for an empty state (saved by a disabled scaler), a missing or unknown
  // entry, or a scale that is not positive and finite.
  std::vector<std::pair<std::string, at::Tensor>> state() const;
  void load_state(const std::vector<std::pair<std::string, at::Tensor>>& state);

 private:
  bool check(const std::vector<at::Tensor>& grads, dist::Communicator* comm, bool unscale);

  LossScalerOptions options_;
  at::Tensor scale_;           // float32 [1]
  at::Tensor growth_tracker_;  // int32 [1]
  at::Tensor found_inf_;       // float32 [1], of the last unscale()
  bool unscaled_ = false;
  int64_t skipped_ = 0;
};

}  // namespace dtrain::engine

#include "dtrain/dist/glog_compat.h"  // last: keeps glog's LOG macros whatever the include order
