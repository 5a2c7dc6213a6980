// Learning-rate schedules and gradient-norm clipping.
#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include <cmath>
#include <map>

#include "dtrain/dist/error.h"
#include "dtrain/engine/optim/optim.h"

namespace dtrain::engine {
namespace {

constexpr const char* kScheduleNames = "constant, cosine, linear";
constexpr double kPi = 3.14159265358979323846;

}  // namespace

void validate(const ScheduleOptions& options) {
  const std::string& name = options.name;
  DTRAIN_CHECK(name == "constant" || name == "cosine" || name == "linear", "unknown lr schedule '",
               name, "'; known schedules: ", kScheduleNames);
  DTRAIN_CHECK(options.warmup_steps >= 0, "lr schedule ", name,
               ": warmup_steps = ", options.warmup_steps, " must be >= 0");
  DTRAIN_CHECK(options.min_lr_ratio >= 0.0 && options.min_lr_ratio <= 1.0, "lr schedule ", name,
               ": min_lr_ratio = ", options.min_lr_ratio, " must be in [0, 1]");
  if (name != "constant") {
    DTRAIN_CHECK(options.total_steps > 0, "lr schedule ", name,
                 ": total_steps = ", options.total_steps,
                 " must be > 0 (the step where the decay ends)");
    DTRAIN_CHECK(options.warmup_steps <= options.total_steps, "lr schedule ", name,
                 ": warmup_steps = ", options.warmup_steps,
                 " exceeds total_steps = ", options.total_steps);
  }
}

double schedule_factor(const ScheduleOptions& options, int64_t step) {
  validate(options);
  DTRAIN_CHECK(step >= 0, "lr schedule ", options.name, ": step = ", step, " must be >= 0");
  const int64_t warmup = options.warmup_steps;
  if (step < warmup) return static_cast<double>(step + 1) / static_cast<double>(warmup);
  if (options.name == "constant") return 1.0;
  const double floor = options.min_lr_ratio;
  if (step >= options.total_steps) return floor;
  // Here warmup <= step < total_steps, so the decay length is positive.
  double t = static_cast<double>(step - warmup) / static_cast<double>(options.total_steps - warmup);
  double shape = options.name == "cosine" ? 0.5 * (1.0 + std::cos(kPi * t)) : 1.0 - t;
  return floor + (1.0 - floor) * shape;
}

at::Tensor clip_coefficient(const at::Tensor& norm, double max_norm) {
  DTRAIN_CHECK(std::isfinite(max_norm) && max_norm >= 0.0, "clip_grads: max_norm = ", max_norm,
               " must be a finite number >= 0");
  DTRAIN_CHECK(norm.defined() && norm.numel() == 1,
               "clip_grads: norm must be a single-element tensor (from grad_norm), got ",
               norm.defined() ? norm.toString() : std::string("an undefined tensor"));
  at::NoGradGuard no_grad;
  at::Tensor limit = at::full(c10::IntArrayRef{}, max_norm, norm.options());
  return at::clamp_max(limit / (norm.reshape({}) + 1e-6), 1.0);
}

at::Tensor clip_grads(const std::vector<at::Tensor>& grads, const at::Tensor& norm, double max_norm) {
  at::Tensor coef = clip_coefficient(norm, max_norm);
  at::NoGradGuard no_grad;
  std::map<std::string, std::vector<at::Tensor>> by_device;
  for (const at::Tensor& g : grads) {
    if (g.defined()) by_device[g.device().str()].push_back(g);
  }
  for (auto& [device, list] : by_device) {
    c10::Device target = list.front().device();
    at::Tensor local = coef.to(target, /*non_blocking=*/!target.is_cpu());
    at::_foreach_mul_(list, local);
  }
  return coef;
}

}  // namespace dtrain::engine
