// measure_model(): a ModelSpec timed piece by piece for the step-time simulator.
#include "dtrain/engine/train/measure_model.h"

#include <ATen/ATen.h>
#include <torch/cuda.h>

#include <algorithm>
#include <chrono>
#include <set>
#include <vector>

#include "dtrain/dist/error.h"
#include "dtrain/engine/memory/memory.h"

namespace dtrain::engine {

void synchronize_device(c10::Device device) {
  if (device.is_cuda()) torch::cuda::synchronize(device.index());
}

double median_of(std::vector<double> samples) {
  DTRAIN_CHECK(!samples.empty(), "median_of: no samples");
  std::sort(samples.begin(), samples.end());
  return samples[samples.size() / 2];
}

namespace {

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

int64_t parameters_of(const std::vector<at::Tensor>& params) {
  std::set<const void*> seen;
  int64_t n = 0;
  for (const at::Tensor& p : params)
    if (p.requires_grad() && seen.insert(p.data_ptr()).second) n += p.numel();
  return n;
}

std::vector<at::Tensor> child_parameters(torch::nn::Module& module, const std::vector<std::string>& names) {
  std::vector<at::Tensor> out;
  for (const auto& item : module.named_children()) {
    if (std::find(names.begin(), names.end(), item.key()) == names.end()) continue;
    for (const at::Tensor& p : item.value()->parameters()) out.push_back(p);
  }
  return out;
}

// One size's figures: seconds of each piece and bytes kept.
struct Sample {
  double pre_f = 0, pre_b = 0, block_f = 0, block_b = 0, post_f = 0, post_b = 0;
  double activation_bytes = 0, block_held = 0, post_held = 0;
};

Sample measure_at(ModelSpec spec, c10::Device device, const Batch& batch, const MeasureOptions& o) {
  std::vector<double> pre_f, pre_b, block_f, block_b, post_f, post_b;
  Sample s;
  const double mib = kBytesPerMiB;
  for (int r = 0; r <= o.repeats; ++r) {  // r == 0: the warm-up
    at::Tensor x, y, loss;
    {
      AutocastGuard autocast(device.type(), o.amp);
      synchronize_device(device);
      double t0 = now_s();
      x = spec.pre(batch);
      synchronize_device(device);
      if (r) pre_f.push_back(now_s() - t0);
    }
    s.activation_bytes = static_cast<double>(x.nbytes());
    at::Tensor xin = x.detach().requires_grad_(x.is_floating_point());
    {
      AutocastGuard autocast(device.type(), o.amp);
      const double before = memory_stats(device).requested_mb;
      synchronize_device(device);
      double t0 = now_s();
      y = spec.blocks->run_block(0, xin);
      synchronize_device(device);
      if (r) block_f.push_back(now_s() - t0);
      s.block_held = std::max(0.0, (memory_stats(device).requested_mb - before) * mib);
    }
    at::Tensor yin = y.detach().requires_grad_(y.is_floating_point());
    {
      AutocastGuard autocast(device.type(), o.amp);
      const double before = memory_stats(device).requested_mb;
      synchronize_device(device);
      double t0 = now_s();
      loss = spec.post(yin, batch);
      synchronize_device(device);
      if (r) post_f.push_back(now_s() - t0);
      s.post_held = std::max(0.0, (memory_stats(device).requested_mb - before) * mib);
    }
    DTRAIN_CHECK(loss.numel() == 1, "measure_model: the spec's post returned ", loss.sizes(),
                 "; it must return the (scalar) loss");
    synchronize_device(device);
    double t0 = now_s();
    loss.backward();
    synchronize_device(device);
    if (r) post_b.push_back(now_s() - t0);
    t0 = now_s();
    y.backward(yin.grad().defined() ? yin.grad() : at::ones_like(y));
    synchronize_device(device);
    if (r) block_b.push_back(now_s() - t0);
    t0 = now_s();
    if (x.requires_grad()) x.backward(xin.grad().defined() ? xin.grad() : at::ones_like(x));
    synchronize_device(device);
    if (r) pre_b.push_back(now_s() - t0);
  }
  s.pre_f = median_of(pre_f), s.pre_b = median_of(pre_b), s.block_f = median_of(block_f), s.block_b = median_of(block_b);
  s.post_f = median_of(post_f), s.post_b = median_of(post_b);
  // The whole forward and backward in one pass: timed piece by piece, each piece pays its own
  // synchronization and autograd start; the pieces keep their shares of the whole's time.
  std::vector<double> whole;
  for (int r = 0; r <= o.repeats; ++r) {
    synchronize_device(device);
    const double t0 = now_s();
    at::Tensor loss;
    {
      AutocastGuard autocast(device.type(), o.amp);
      loss = spec.post(spec.blocks->forward(spec.pre(batch)), batch);
    }
    loss.backward();
    synchronize_device(device);
    if (r) whole.push_back(now_s() - t0);
  }
  const double blocks = static_cast<double>(spec.blocks->size());
  const double pieces = s.pre_f + s.pre_b + blocks * (s.block_f + s.block_b) + s.post_f + s.post_b;
  const double k = pieces > 0 ? median_of(whole) / pieces : 1.0;
  for (double* v : {&s.pre_f, &s.pre_b, &s.block_f, &s.block_b, &s.post_f, &s.post_b}) *v *= k;
  return s;
}

}  // namespace

sim::MeasuredModel measure_model(const ModelSpec& spec, c10::Device device,
                                 const std::function<Batch(int64_t rows)>& batch_of, const MeasureOptions& o) {
  validate(spec);
  DTRAIN_CHECK(o.rows_small >= 1 && o.rows_large > o.rows_small, "measure_model: rows_small (", o.rows_small,
               ") must be >= 1 and rows_large (", o.rows_large, ") larger");
  DTRAIN_CHECK(o.repeats >= 1, "measure_model: repeats (", o.repeats, ") must be >= 1");
  DTRAIN_CHECK(spec.blocks->size() >= 1, "measure_model: the spec's stack has no blocks");
  sim::MeasuredModel m;
  m.blocks = static_cast<int64_t>(spec.blocks->size());
  m.block_parameters = parameters_of(spec.blocks->block(0)->parameters());
  m.pre_parameters = parameters_of(child_parameters(*spec.module, spec.pre_modules));
  m.post_parameters = parameters_of(child_parameters(*spec.module, spec.post_modules));
  m.tokens_per_row = o.tokens_per_row;
  m.flops_per_row = o.flops_per_row;
  const double r0 = static_cast<double>(o.rows_small), r1 = static_cast<double>(o.rows_large);
  const Sample a = measure_at(spec, device, batch_of(o.rows_small), o);
  const Sample b = measure_at(spec, device, batch_of(o.rows_large), o);
  for (const at::Tensor& p : spec.module->parameters()) p.mutable_grad() = at::Tensor();
  m.block_forward = sim::Line::through(r0, a.block_f, r1, b.block_f);
  m.block_backward = sim::Line::through(r0, a.block_b, r1, b.block_b);
  m.pre_forward = sim::Line::through(r0, a.pre_f, r1, b.pre_f);
  m.pre_backward = sim::Line::through(r0, a.pre_b, r1, b.pre_b);
  m.post_forward = sim::Line::through(r0, a.post_f, r1, b.post_f);
  m.post_backward = sim::Line::through(r0, a.post_b, r1, b.post_b);
  m.activation_bytes_per_row = b.activation_bytes / r1;
  m.block_held_bytes_per_row = std::max(a.block_held / r0, b.block_held / r1);
  m.post_held_bytes_per_row = std::max(a.post_held / r0, b.post_held / r1);
  return m;
}

double median_seconds(c10::Device device, int reps, const std::function<void()>& fn) {
  DTRAIN_CHECK(reps >= 1, "median_seconds: reps must be >= 1, got ", reps);
  fn();
  synchronize_device(device);
  std::vector<double> samples;
  for (int i = 0; i < reps; ++i) {
    const double t0 = now_s();
    fn();
    synchronize_device(device);
    samples.push_back(now_s() - t0);
  }
  return median_of(std::move(samples));
}

}  // namespace dtrain::engine
