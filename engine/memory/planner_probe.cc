// probe_activations(): real forward + backward runs measured with the device's allocator
// statistics, with the gradients and RNG states put back afterwards.
#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <ATen/Context.h>
#include <c10/core/GradMode.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <mutex>

#include "dtrain/dist/error.h"
#include "dtrain/engine/memory/memory.h"
#include "dtrain/engine/memory/planner.h"

namespace dtrain::engine {
namespace {


int64_t allocated_bytes(c10::Device device) {
  return std::llround(memory_stats(device).allocated_mb * kBytesPerMiB);
}
int64_t peak_bytes(c10::Device device) {
  return std::llround(memory_stats(device).peak_mb * kBytesPerMiB);
}

void synchronize(c10::Device device) {
  if (device.is_cpu()) return;
  c10::impl::VirtualGuardImpl(device.type()).synchronizeDevice(device.index());
}

// Saves every parameter's gradient to host memory and gives the ones without a gradient a
// zero tensor (so the runs accumulate into defined gradients, as under the reducer); the
// destructor puts every gradient back as it was.
class GradientGuard {
 public:
  explicit GradientGuard(const std::vector<at::Tensor>& params) : params_(params) {
    for (const at::Tensor& p : params_) {
      at::Tensor g = p.grad();
      originals_.push_back(g);
      saved_.push_back(g.defined() ? g.to(at::kCPU, /*non_blocking=*/false, /*copy=*/true)
                                   : at::Tensor());
    }
    for (const at::Tensor& p : params_) {
      if (!p.grad().defined()) const_cast<at::Tensor&>(p).mutable_grad() = at::zeros_like(p);
    }
  }
  ~GradientGuard() {
    try {
      for (size_t i = 0; i < params_.size(); ++i) {
        at::Tensor& grad = const_cast<at::Tensor&>(params_[i]).mutable_grad();
        grad = originals_[i];
        if (grad.defined()) grad.copy_(saved_[i]);
      }
    } catch (const std::exception& e) {
      std::fprintf(stderr, "probe_activations: could not restore the gradients: %s\n", e.what());
    }
  }
  void zero() {
    for (const at::Tensor& p : params_) {
      if (p.grad().defined()) const_cast<at::Tensor&>(p).mutable_grad().zero_();
    }
  }
  GradientGuard(const GradientGuard&) = delete;
  GradientGuard& operator=(const GradientGuard&) = delete;

 private:
  const std::vector<at::Tensor>& params_;
  std::vector<at::Tensor> originals_;
  std::vector<at::Tensor> saved_;
};

// Restores the default generators of the CPU and of `device` on destruction.
class RngGuard {
 public:
  explicit RngGuard(c10::Device device) {
    save(c10::Device(c10::kCPU));
    if (!device.is_cpu()) save(device);
  }
  ~RngGuard() {
    for (auto& [gen, state] : saved_) {
      std::lock_guard<std::mutex> lock(gen.mutex());
      gen.set_state(state);
    }
  }
  RngGuard(const RngGuard&) = delete;
  RngGuard& operator=(const RngGuard&) = delete;

 private:
  void save(c10::Device device) {
    at::Generator gen = at::globalContext().defaultGenerator(device);
    std::lock_guard<std::mutex> lock(gen.mutex());
    saved_.emplace_back(gen, gen.get_state());
  }
  std::vector<std::pair<at::Generator, at::Tensor>> saved_;
};

struct RunResult {
  int64_t peak = 0;
  int64_t held = 0;  // allocated when forward has returned, above the start
  double seconds = 0;
};

RunResult run_once(const ProbeLossFn& loss_fn, GradientGuard& grads, c10::Device device,
                   int64_t rows, const ProbeTechnique& t) {
  grads.zero();
  synchronize(device);
  reset_peak_memory(device);
  const int64_t start = allocated_bytes(device);
  const auto t0 = std::chrono::steady_clock::now();
  int64_t held = 0;
  {
    at::Tensor loss;
    {
      AutocastGuard autocast(device.type(), t.amp);
      loss = loss_fn(rows, t.checkpoint);
    }
    synchronize(device);
    held = allocated_bytes(device) - start;
    DTRAIN_CHECK(loss.defined() && loss.numel() == 1,
                 "probe_activations: the loss function must return a scalar, got ",
                 loss.defined() ? loss.sizes() : at::IntArrayRef{});
    loss.reshape({}).backward();
  }
  synchronize(device);
  RunResult r;
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  r.peak = std::max<int64_t>(0, peak_bytes(device) - start);
  r.held = std::max<int64_t>(0, held);
  return r;
}

// The line through (rows[k], bytes[k]), slope and intercept clamped at 0.
void fit_line(const int64_t rows[2], const int64_t bytes[2], double& per_row, double& intercept) {
  per_row = std::max(0.0, static_cast<double>(bytes[1] - bytes[0]) / static_cast<double>(rows[1] - rows[0]));
  intercept = std::max(0.0, static_cast<double>(bytes[0]) - per_row * static_cast<double>(rows[0]));
}

}  // namespace

ActivationProfile probe_activations(const ProbeLossFn& loss_fn,
                                    const std::vector<at::Tensor>& params, c10::Device device,
                                    const ProbeOptions& options) {
  DTRAIN_CHECK(options.rows_small >= 1 && options.rows_large > options.rows_small,
               "probe_activations: rows_small=", options.rows_small,
               " and rows_large=", options.rows_large,
               " must satisfy 1 <= rows_small < rows_large");
  DTRAIN_CHECK(!options.techniques.empty(), "probe_activations: no techniques to measure");
  DTRAIN_CHECK(!params.empty(),
               "probe_activations: no parameters (the model has nothing to train)");
  DTRAIN_CHECK(device.is_cuda() || device.is_cpu(), "probe_activations: device ", device,
               " is not supported (cpu or cuda)");
  DTRAIN_CHECK(!device.is_cpu() || cpu_memory_tracked(),
               "probe_activations on the CPU needs exact CPU memory figures: call "
               "engine::track_cpu_memory() at the start of the program");
  if (device.is_cuda() && !device.has_index()) {
    device = c10::Device(c10::kCUDA, c10::impl::VirtualGuardImpl(c10::kCUDA).getDevice().index());
  }
  c10::AutoGradMode grad_mode(true);
  RngGuard rng(device);
  GradientGuard grads(params);
  const int64_t before = allocated_bytes(device);
  // Warm-ups: first-use allocations (library workspaces) must not count as activations.
  for (const ProbeTechnique& t : options.techniques)
    run_once(loss_fn, grads, device, options.rows_small, t);
  ActivationProfile profile;
  profile.persistent_bytes = std::max<int64_t>(0, allocated_bytes(device) - before);
  for (const ProbeTechnique& t : options.techniques) {
    ActivationFit fit;
    fit.checkpoint = t.checkpoint;
    fit.amp = t.amp;
    fit.rows[0] = options.rows_small;
    fit.rows[1] = options.rows_large;
    for (int k = 0; k < 2; ++k) {
      RunResult r = run_once(loss_fn, grads, device, fit.rows[k], t);
      fit.peak_bytes[k] = r.peak;
      fit.held_bytes[k] = r.held;
      fit.seconds[k] = r.seconds;
    }
    fit_line(fit.rows, fit.peak_bytes, fit.bytes_per_row, fit.intercept_bytes);
    fit_line(fit.rows, fit.held_bytes, fit.held_bytes_per_row, fit.held_intercept_bytes);
    profile.fits.push_back(fit);
  }
  return profile;
}

}  // namespace dtrain::engine
