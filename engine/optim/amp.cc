#include "dtrain/engine/optim/amp.h"

#include <algorithm>
#include <cmath>
#include <utility>

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <ATen/autocast_mode.h>

#include "dtrain/dist/communicator.h"
#include "dtrain/dist/error.h"

namespace dtrain::engine {

AmpMode parse_amp(const std::string& text) {
  if (text == "off") return AmpMode::kOff;
  if (text == "bf16") return AmpMode::kBf16;
  if (text == "fp16") return AmpMode::kFp16;
  DTRAIN_CHECK(false, "unknown AMP mode '", text, "': use one of off, bf16, fp16");
  return AmpMode::kOff;  // unreachable
}

const char* to_string(AmpMode mode) {
  switch (mode) {
    case AmpMode::kOff:
      return "off";
    case AmpMode::kBf16:
      return "bf16";
    case AmpMode::kFp16:
      return "fp16";
  }
  return "?";
}

at::ScalarType parse_param_dtype(const std::string& text) {
  if (text == "float32" || text == "fp32") return at::kFloat;
  if (text == "bfloat16" || text == "bf16") return at::kBFloat16;
  throw Error("--param_dtype=" + text + " is not one of: float32 (fp32), bfloat16 (bf16)" +
              (text == "float16" || text == "fp16" ? "; float16 weights need loss scaling of float16 gradients: "
                                                     "train float32 weights with --amp=fp16"
                                                   : ""));
}

// ---------------------------------------------------------------------------------------
// AutocastGuard

AutocastGuard::AutocastGuard(c10::DeviceType device, AmpMode mode)
    : device_(device), prev_dtype_(c10::ScalarType::Undefined) {
  if (mode == AmpMode::kOff) return;
  DTRAIN_CHECK(at::autocast::is_autocast_available(device), "autocast is not available on ",
               c10::DeviceTypeName(device),
               " devices: use --amp=off there (AMP supports cpu and cuda)");
  prev_enabled_ = at::autocast::is_autocast_enabled(device);
  prev_dtype_ = at::autocast::get_autocast_dtype(device);
  at::autocast::set_autocast_enabled(device, true);
  at::autocast::set_autocast_dtype(device, mode == AmpMode::kBf16 ? at::kBFloat16 : at::kHalf);
  at::autocast::increment_nesting();
  active_ = true;
}

AutocastGuard::~AutocastGuard() {
  if (!active_) return;
  // The cast cache holds lower-precision copies of leaf weights; drop it when leaving the
  // outermost autocast region so an optimizer's in-place update is seen next time.
  if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
  at::autocast::set_autocast_enabled(device_, prev_enabled_);
  at::autocast::set_autocast_dtype(device_, prev_dtype_);
}

// ---------------------------------------------------------------------------------------
// LossScaler

LossScaler::LossScaler(LossScalerOptions options, c10::Device device) : options_(options) {
  if (options_.enabled) {
    DTRAIN_CHECK(options_.init_scale > 0.0, "LossScalerOptions::init_scale must be positive, got ",
                 options_.init_scale);
    DTRAIN_CHECK(options_.growth_factor > 1.0, "LossScalerOptions::growth_factor must be > 1, got ",
                 options_.growth_factor);
    DTRAIN_CHECK(options_.backoff_factor > 0.0 && options_.backoff_factor < 1.0,
                 "LossScalerOptions::backoff_factor must be in (0, 1), got ",
                 options_.backoff_factor);
    DTRAIN_CHECK(options_.growth_interval > 0,
                 "LossScalerOptions::growth_interval must be a positive step count, got ",
                 options_.growth_interval);
  }
  auto opts = at::TensorOptions().device(device);
  scale_ = at::full({1}, options_.enabled ? options_.init_scale : 1.0, opts.dtype(at::kFloat));
  growth_tracker_ = at::zeros({1}, opts.dtype(at::kInt));
  found_inf_ = at::zeros({1}, opts.dtype(at::kFloat));
}

at::Tensor LossScaler::scale(const at::Tensor& loss) const {
  if (!options_.enabled) return loss;
  DTRAIN_CHECK(loss.defined(), "LossScaler::scale: the loss tensor is undefined");
  return loss * scale_.to(loss.device(), /*non_blocking=*/true);
}

at::Tensor any_nonfinite(const std::vector<at::Tensor>& tensors) {
  // The largest magnitude of a tensor is inf or NaN exactly when an element is (max propagates
  // NaN): one multi-tensor reduction instead of an isfinite pass per tensor.
  std::vector<at::Tensor> nonempty;
  for (const at::Tensor& t : tensors) {
    if (t.defined() && t.numel() > 0) nonempty.push_back(t.detach());
  }
  if (nonempty.empty()) return at::zeros({}, at::kFloat);
  std::vector<at::Tensor> largest = at::_foreach_norm(nonempty, INFINITY);
  for (at::Tensor& l : largest) l = l.to(at::kFloat);
  return at::isfinite(at::stack(largest)).logical_not().any().to(at::kFloat);
}

namespace {

// Grads grouped as _amp_foreach_non_finite_check_and_unscale_ wants them: one list per
// (device, dtype), in order of first appearance. Sparse grads contribute their values.
struct GradGroup {
  c10::Device device;
  at::ScalarType dtype;
  std::vector<at::Tensor> grads;
};

std::vector<GradGroup> group_grads(const std::vector<at::Tensor>& grads) {
  std::vector<GradGroup> groups;
  for (size_t i = 0; i < grads.size(); ++i) {
    const at::Tensor& g = grads[i];
    if (!g.defined()) continue;
    DTRAIN_CHECK(at::isFloatingType(g.scalar_type()), "LossScaler::unscale: gradient #", i,
                 " has dtype ", c10::toString(g.scalar_type()),
                 "; only floating-point gradients can be unscaled");
    at::Tensor values = g.is_sparse() ? g._values() : g;
    auto it = std::find_if(groups.begin(), groups.end(), [&](const GradGroup& group) {
      return group.device == values.device() && group.dtype == values.scalar_type();
    });
    if (it == groups.end()) {
      groups.push_back({values.device(), values.scalar_type(), {}});
      it = groups.end() - 1;
    }
    it->grads.push_back(values);
  }
  return groups;
}

}  // namespace

at::Tensor LossScaler::inverse_scale() const {
  // As GradScaler: the reciprocal in double, rounded once to float.
  return scale_.to(at::kDouble).reciprocal().to(at::kFloat).reshape({});
}

bool LossScaler::unscale(const std::vector<at::Tensor>& grads, dist::Communicator* comm) {
  return check(grads, comm, /*unscale=*/true);
}

bool LossScaler::check_finite(const std::vector<at::Tensor>& grads, dist::Communicator* comm) {
  return check(grads, comm, /*unscale=*/false);
}

bool LossScaler::check(const std::vector<at::Tensor>& grads, dist::Communicator* comm, bool unscale) {
  if (!options_.enabled) return true;
  DTRAIN_CHECK(!unscaled_,
               "LossScaler: unscale() or check_finite() called twice in one step: call update() after each "
               "step (skipped or not) before checking the next step's gradients");
  at::NoGradGuard no_grad;
  at::Tensor inv_scale = inverse_scale().reshape({1});
  found_inf_.zero_();
  for (GradGroup& group : group_grads(grads)) {
    at::Tensor found = group.device == found_inf_.device()
                           ? found_inf_
                           : at::zeros({1}, found_inf_.options().device(group.device));
    // ATen's fused check-and-unscale has no bfloat16 kernel on CUDA (CPU has one): bfloat16
    // gradients are checked, then multiplied by the float inverse scale (a [1]-shaped tensor,
    // so the product is computed in float and rounded once, as the fused kernel does).
    if (unscale && group.dtype != at::kBFloat16) {
      at::_amp_foreach_non_finite_check_and_unscale_(group.grads, found, inv_scale.to(group.device));
    } else {
      found.add_(any_nonfinite(group.grads));
      if (unscale) {
        at::Tensor inv = inv_scale.to(group.device);
        for (at::Tensor& g : group.grads) g.mul_(inv);
      }
    }
    if (!found.is_same(found_inf_)) found_inf_.add_(found.to(found_inf_.device()));
  }
  if (comm != nullptr && comm->size() > 1) {
    if (comm->supports(found_inf_.device().type())) {
      comm->all_reduce(found_inf_, dist::ReduceOp::kMax)->wait();
    } else {
      at::Tensor host = found_inf_.cpu();
      comm->all_reduce(host, dist::ReduceOp::kMax)->wait();
      found_inf_.copy_(host);
    }
  }
  unscaled_ = true;
  const bool finite = found_inf_.item<float>() == 0.0f;
  if (!finite) ++skipped_;
  return finite;
}

void LossScaler::update() {
  if (!options_.enabled) return;
  DTRAIN_CHECK(unscaled_,
               "LossScaler::update called without unscale() or check_finite() in this step: call "
               "one of them after backward (it decides whether to skip the step), "
               "then update()");
  at::NoGradGuard no_grad;
  at::_amp_update_scale_(scale_, growth_tracker_, found_inf_, options_.growth_factor,
                         options_.backoff_factor, options_.growth_interval);
  unscaled_ = false;
}

double LossScaler::scale_value() const {
  if (!options_.enabled) return 1.0;
  return scale_.item<float>();
}

std::vector<std::pair<std::string, at::Tensor>> LossScaler::state() const {
  if (!options_.enabled) return {};
  return {{"scale", scale_.clone()}, {"growth_tracker", growth_tracker_.clone()}};
}

void LossScaler::load_state(const std::vector<std::pair<std::string, at::Tensor>>& state) {
  if (!options_.enabled) return;
  DTRAIN_CHECK(!state.empty(),
               "LossScaler::load_state: the state is empty (saved by a run without fp16 loss "
               "scaling?); resume with the same --amp mode or start the scaler afresh");
  at::Tensor scale, tracker;
  for (const auto& [name, t] : state) {
    DTRAIN_CHECK(name == "scale" || name == "growth_tracker",
                 "LossScaler::load_state: unknown entry '", name,
                 "'; expected scale and growth_tracker");
    DTRAIN_CHECK(t.defined() && t.numel() == 1, "LossScaler::load_state: '", name,
                 "' must be a one-element tensor");
    (name == "scale" ? scale : tracker) = t;
  }
  DTRAIN_CHECK(scale.defined() && tracker.defined(),
               "LossScaler::load_state: the state needs both scale and growth_tracker");
  const double value = scale.item<double>();
  DTRAIN_CHECK(value > 0.0 && std::isfinite(value),
               "LossScaler::load_state: scale must be positive and finite, got ", value);
  // Validated in full before anything is changed.
  scale_.copy_(scale.reshape({1}));
  growth_tracker_.copy_(tracker.reshape({1}));
  unscaled_ = false;
}

}  // namespace dtrain::engine
