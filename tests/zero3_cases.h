// ZeRO-3's engine pieces on a small float64 stack, shared by the MPI tests (CPU) and the GPU
// tests (CUDA): one process trained on the global batch with the replicated AdamW on the CPU
// (the reference), and the same steps with Zero3Optimizer, ParameterUnits and the reducer over
// the optimizer's reduce-scatter on every rank, recording the memory and the bytes of the last
// step.
#pragma once

#include <gtest/gtest.h>

#include <torch/torch.h>

#include <cstdio>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "dtrain/dist/communicator.h"
#include "dtrain/engine/memory/memory.h"
#include "dtrain/engine/optim/optim.h"
#include "dtrain/engine/zero3/parameter_units.h"
#include "dtrain/engine/parallel/reducer.h"

namespace dtrain::engine::zero3_cases {

constexpr int64_t kWidth = 64, kBlocks = 16, kRows = 4;  // rows per rank

// kBlocks blocks tanh(Linear(x)) and a head Linear(width, 1), float64, the same weights on
// every rank (seeded).
struct Stack {
  explicit Stack(c10::Device device = c10::Device(c10::kCPU)) {
    torch::manual_seed(7);
    for (int i = 0; i < kBlocks; ++i) blocks.push_back(torch::nn::Linear(kWidth, kWidth));
    head = torch::nn::Linear(kWidth, 1);
    for (auto& b : blocks) b->to(device, at::kDouble);
    head->to(device, at::kDouble);
  }
  std::vector<at::Tensor> params() const {
    std::vector<at::Tensor> out;
    for (const auto& b : blocks) {
      out.push_back(b->weight);
      out.push_back(b->bias);
    }
    out.push_back(head->weight);
    out.push_back(head->bias);
    return out;
  }
  std::vector<torch::nn::Linear> blocks;
  torch::nn::Linear head{nullptr};
};

// The global batch of step s: kRows rows per rank, rank r's are rows [r kRows, (r + 1) kRows).
inline std::pair<at::Tensor, at::Tensor> batch(int step, int ranks) {
  at::Generator g = at::detail::createCPUGenerator(100 + step);
  at::Tensor x = at::randn({ranks * kRows, kWidth}, g, at::kDouble);
  at::Tensor y = at::randn({ranks * kRows, 1}, g, at::kDouble);
  return {x, y};
}

inline OptimizerOptions adamw() {
  OptimizerOptions o;
  o.name = "adamw";
  o.lr = 1e-2;
  o.weight_decay = 0.1;
  return o;
}

constexpr int kSteps = 3;
constexpr int64_t kBucketBytes = int64_t{32} << 10;

// One process, the whole batch, the replicated optimizer.
inline std::vector<at::Tensor> reference(int ranks) {
  Stack m;
  std::unique_ptr<Optimizer> opt = make_optimizer(m.params(), adamw());
  const at::Tensor one = at::ones({}, at::kDouble);
  for (int s = 0; s < kSteps; ++s) {
    auto [x, y] = batch(s, ranks);
    at::Tensor h = x;
    for (auto& b : m.blocks) h = at::tanh(b->forward(h));
    at::mse_loss(m.head->forward(h), y).backward();
    opt->step(one);
    opt->zero_grad();
  }
  std::vector<at::Tensor> out;
  for (const at::Tensor& p : m.params()) out.push_back(p.detach().clone());
  return out;
}

struct Zero3Run {
  std::vector<at::Tensor> weights;
  double resident_bytes = 0;  // allocated between steps (after the last one)
  double peak_bytes = 0;      // allocated at the last step's peak
  double start_bytes = 0;     // allocated before the model (the baseline of both)
  double bus_bytes_per_step = 0;
  int64_t numel = 0;
  int64_t host_bytes = 0;  // the optimizer's host memory (offloaded)
  int64_t gradient_bytes = 0;  // the reducer's gradient storage and the optimizer's gradient shard after the last step
  int64_t range = 0;           // this rank's real elements of the flat space
  int64_t shard = 0;           // its shard: a piece of every unit, padding included
};

// Trains kSteps steps with the model, the optimizer and the reducer on `device` (the batch drawn
// on the CPU, as for the reference); with `offload`, the optimizer's range on the host (the
// ZeRO-Offload layout of stage 3).
inline Zero3Run zero3(dist::Communicator& comm, c10::Device device = c10::Device(c10::kCPU),
                      const OffloadOptions* offload = nullptr) {
  if (device.is_cpu()) track_cpu_memory();
  const c10::Device cpu = device;
  Zero3Run out;
  if (device.is_cuda()) {
    // cuBLAS's workspaces (tens of MiB from the caching allocator at the first matmul) are not
    // the units' memory: allocated before the baseline. A Linear with a bias takes cuBLASLt's
    // bias epilogue, whose workspace (1 MiB, its own) the first such call allocates: warmed up
    // too (without it the CUDA run measured 3.18 MB resident against the 2.27 MB bound).
    at::Tensor a = at::ones({8, 8}, at::TensorOptions().dtype(at::kDouble).device(device)).requires_grad_(true);
    at::Tensor bias = at::ones({8}, at::TensorOptions().dtype(at::kDouble).device(device)).requires_grad_(true);
    at::mm(a, a).sum().backward();
    at::linear(a, a, bias).sum().backward();
  }
  // The tensors' own bytes (on CUDA without the caching allocator's block rounding).
  out.start_bytes = memory_stats(cpu).requested_mb * 1024 * 1024;
  Stack m(device);
  std::vector<at::Tensor> params = m.params();
  for (const at::Tensor& p : params) out.numel += p.numel();
  // A unit per block (weight, bias) and one for the head.
  std::vector<size_t> starts;
  for (size_t j = 0; j < params.size(); j += 2) starts.push_back(j);
  Zero3Optimizer opt(params, adamw(), comm, starts, offload);
  ReducerOptions ro;
  ro.broadcast_parameters = false;  // the weights are released already; every rank drew the same
  ro.bucket_comm = opt.bucket_comm();  // a bucket per unit, reduce-scattered into the optimizer's shard
  GradReducer reducer(params, comm, ro);
  opt.attach(reducer);
  ParameterUnits units(opt);
  const at::Tensor one = at::ones({}, at::TensorOptions().dtype(at::kDouble).device(device));
  double bus_before = 0;
  for (int s = 0; s < kSteps; ++s) {
    auto [x, y] = batch(s, comm.size());
    x = x.narrow(0, comm.rank() * kRows, kRows).to(device);
    y = y.narrow(0, comm.rank() * kRows, kRows).to(device);
    if (s == kSteps - 1) {
      out.resident_bytes = memory_stats(cpu).requested_mb * 1024 * 1024;
      reset_peak_memory(cpu);
      bus_before = comm.traffic().bus_bytes;
    }
    at::Tensor h = x;
    for (int k = 0; k < kBlocks; ++k) {
      h = units.run(k, [&] { return at::tanh(m.blocks[k]->forward(h)); });
    }
    at::Tensor pred = units.run(kBlocks, [&] { return m.head->forward(h); });
    // The mean over this rank's rows; the reducer averages over the ranks: the global mean.
    at::mse_loss(pred, y).backward();
    opt.step(one);
    reducer.zero_grad();
    if (s == kSteps - 1) {
      out.peak_bytes = memory_stats(cpu).peak_mb * 1024 * 1024;
      out.bus_bytes_per_step = comm.traffic().bus_bytes - bus_before;
    }
  }
  out.host_bytes = opt.host_bytes();
  out.gradient_bytes = reducer.gradient_bytes() + opt.gradient_shard().nbytes();
  out.range = opt.shard_layout()->size();
  out.shard = opt.gradient_shard().numel();
  for (int k = 0; k < units.units(); ++k) EXPECT_FALSE(opt.unit_gathered(k)) << "unit " << k << " left gathered";
  units.gather_all();
  for (const at::Tensor& p : params) out.weights.push_back(p.detach().cpu().clone());
  units.release_all();
  return out;
}

}  // namespace dtrain::engine::zero3_cases
