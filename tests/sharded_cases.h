// The ZeRO-1/2 training cases' common part, on any device: the MPI tests run it on the CPU, the
// GPU tests on CUDA (the shards, the reducer's buckets and the gathers then live on the device).
#pragma once

#include <gtest/gtest.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "dtrain/dist/mesh.h"
#include "dtrain/engine/train/trainer.h"
#include "test_util.h"

namespace dtrain::engine::sharded_cases {

using testing_util::rel_error;

inline torch::nn::Sequential make_model(int64_t width) {
  torch::manual_seed(0);
  torch::nn::Sequential m(torch::nn::Linear(6, width), torch::nn::Tanh(), torch::nn::Linear(width, 1));
  m->to(torch::kFloat64);
  return m;
}

struct Config {
  std::string shard = "none";
  std::string optimizer = "adamw";
  bool offload = false;
  int64_t width = 16;
  int64_t steps = 6;
  int accum = 1;
  double clip = 0;
  bool fp16 = false;  // a float32 model under --amp=fp16 with an initial loss scale that overflows
  std::string save_dir;
  ResumeMode resume = ResumeMode::kNo;
  std::function<void(const StepMetrics&)> on_log;
  std::function<void(Trainer&)> after;  // called after fit()
  c10::Device device = c10::Device(c10::kCPU);  // where the model and its optimizer state live
};

// fit() of `c.steps` steps with `batch_size` rows per data-parallel rank (the loader is sharded
// by fit, so one process with N x the rows sees the same global batches); the final weights.
inline std::vector<at::Tensor> fit_on(dist::Mesh& mesh, int64_t batch_size, const Config& c) {
  auto g = at::make_generator<at::CPUGeneratorImpl>(11);
  const at::ScalarType dtype = c.fp16 ? at::kFloat : at::kDouble;
  auto data = std::make_shared<TensorDataset>(std::vector<at::Tensor>{
      at::randn({192, 6}, g, at::kDouble).to(dtype), at::randn({192, 1}, g, at::kDouble).to(dtype)});
  LoaderOptions lo;
  lo.batch_size = batch_size;
  lo.seed = 5;
  lo.workers = 0;
  lo.device = c.device;
  DataLoader loader(data, lo);
  auto model = make_model(c.width);
  if (c.fp16) model->to(torch::kFloat32);
  model->to(c.device);
  TrainerOptions o;
  if (c.fp16) {
    o.amp = AmpMode::kFp16;
    o.loss_scaler.init_scale = 1 << 19;  // the first steps' scaled float16 gradients overflow
  }
  o.steps = c.steps;
  o.accum_steps = c.accum;
  o.optimizer.name = c.optimizer;
  o.optimizer.lr = 0.01;
  o.optimizer.weight_decay = 0.1;
  o.clip_grad_norm = c.clip;
  o.shard = c.shard;
  o.offload_optimizer = c.offload;
  o.save_dir = c.save_dir;
  o.resume = c.resume;
  o.async_save = false;
  o.progress = false;
  o.handle_preemption = false;
  o.log_every = 1;
  o.on_log = c.on_log;
  Trainer trainer(*model, [&](const Batch& b) { return torch::mse_loss(model->forward(b.fields[0]), b.fields[1]); },
                  mesh, c.device, o);
  trainer.fit(loader);
  if (c.after) c.after(trainer);
  std::vector<at::Tensor> params;
  for (auto& p : model->parameters()) params.push_back(p.detach().to(at::kCPU).clone());
  return params;
}

inline void expect_same(const std::vector<at::Tensor>& got, const std::vector<at::Tensor>& want, double tolerance,
                 const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t i = 0; i < got.size(); ++i) EXPECT_LT(rel_error(got[i], want[i]), tolerance) << what << ", parameter " << i;
}

inline std::unique_ptr<dist::Communicator> lone() {
  return dist::create_communicator("local", dist::World{}, c10::Device(c10::kCPU));
}

// 12 steps under --amp=fp16 with an initial loss scale that overflows (width 256, 4 rows per
// rank): the final weights, and each step's logged loss scale appended to `scales`. A skipped
// step halves the scale; a step taken keeps it (growth comes after 2000).
inline std::vector<at::Tensor> fit_fp16(dist::Mesh& mesh, const std::string& shard, c10::Device device,
                                        std::vector<double>& scales) {
  Config c;
  c.width = 256;
  c.steps = 12;
  c.fp16 = true;
  c.shard = shard;
  c.device = device;
  c.on_log = [&](const StepMetrics& m) { scales.push_back(m.loss_scale.value_or(-1)); };
  return fit_on(mesh, 4, c);
}

}  // namespace dtrain::engine::sharded_cases
