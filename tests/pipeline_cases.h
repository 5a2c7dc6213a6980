// A two-stage pipeline Trainer's run on any device: the MPI tests run it on the CPU, the GPU
// tests on CUDA (the activations then travel between the stages as device tensors).
#pragma once

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include <torch/torch.h>

#include "dtrain/dist/mesh.h"
#include "dtrain/engine/train/trainer.h"
#include "test_util.h"

namespace dtrain::engine::pipeline_cases {

// A two-stage Trainer (data-parallel over the rest of the world) on `device`, float64, whose
// forward runs out of memory on `fail_rank` (-1: none) for micro-batches above 4 rows (what the
// CUDA caching allocator throws, simulated), with `schedule`. Returns the stage's parameters (on the CPU) after
// 3 steps of 16 rows per data-parallel rank.
inline std::vector<at::Tensor> two_stage_run(c10::Device device, int accum, int fail_rank, std::vector<int>* accum_seen,
                                             PipelineSchedule schedule = PipelineSchedule::k1F1B) {
  auto& comm = testing_util::world_comm();
  dist::Mesh mesh(comm, 1, 2);
  torch::manual_seed(0);
  torch::nn::Linear first(6, 16), second(16, 1);
  first->to(device, torch::kFloat64);
  second->to(device, torch::kFloat64);
  torch::nn::Sequential stage;
  if (mesh.pp_rank() == 0) {
    stage->push_back(first);
  } else {
    stage->push_back(second);
  }
  TrainerOptions o;
  o.steps = 3;
  o.accum_steps = accum;
  o.pipeline.schedule = schedule;
  o.optimizer.name = "adam";
  o.optimizer.lr = 0.01;
  o.progress = false;
  o.pipeline.forward = [&](const at::Tensor& x, const Batch& b) {
    if (comm.rank() == fail_rank && b.size() > 4) {
      TORCH_CHECK_WITH(OutOfMemoryError, false, "CUDA out of memory (simulated for a test)");
    }
    if (mesh.pp_rank() == 0) return torch::tanh(first->forward(b.fields[0]));
    return torch::mse_loss(second->forward(x), b.fields[1]);
  };
  o.pipeline.activation_shape = [](int64_t rows) { return std::vector<int64_t>{rows, 16}; };
  o.pipeline.activation_dtype = at::kDouble;
  Trainer trainer(*stage, nullptr, mesh, device, o);
  for (int64_t s = 0; s < o.steps; ++s) {
    auto g = at::make_generator<at::CPUGeneratorImpl>(s * 100 + mesh.dp_rank());
    Batch b;
    b.fields = {at::randn({16, 6}, g, at::kDouble).to(device), at::randn({16, 1}, g, at::kDouble).to(device)};
    const StepResult r = trainer.step(b);
    if (s == 0 && fail_rank >= 0) EXPECT_EQ(r.oom_retries, 2);
    if (accum_seen) accum_seen->push_back(trainer.accum_steps());
  }
  std::vector<at::Tensor> params;
  for (auto& p : stage->parameters()) params.push_back(p.detach().cpu().clone());
  return params;
}

}  // namespace dtrain::engine::pipeline_cases
