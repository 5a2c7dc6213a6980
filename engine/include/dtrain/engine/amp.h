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

// While alive, ops on `device` run under autocast to the mode's dtype (no-op for kOff).
// Restores the previous autocast state of that device type on destruction and, when the
// outermost guard ends, clears the autocast cast cache (as torch.autocast does).
// Not copyable; use on one thread.
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
// unscale() agrees on found-inf across the ranks of comm (max) so every rank skips the same
// steps; pass nullptr for a single process. unscale() syncs with the host once (to return).
class LossScaler {
 public:
  LossScaler(LossScalerOptions options, c10::Device device);
  at::Tensor scale(const at::Tensor& loss) const;
  bool unscale(const std::vector<at::Tensor>& grads, dist::Communicator* comm);
  void update();
  double scale_value() const;        // host read of the current scale (syncs)
  bool enabled() const { return options_.enabled; }
  int64_t skipped_steps() const { return skipped_; }
  // For checkpoints: {"scale", "growth_tracker"}.
  std::vector<std::pair<std::string, at::Tensor>> state() const;
  void load_state(const std::vector<std::pair<std::string, at::Tensor>>& state);

 private:
  LossScalerOptions options_;
  at::Tensor scale_;           // float32 [1]
  at::Tensor growth_tracker_;  // int32 [1]
  at::Tensor found_inf_;       // float32 [1], of the last unscale()
  bool unscaled_ = false;
  int64_t skipped_ = 0;
};

}  // namespace dtrain::engine
