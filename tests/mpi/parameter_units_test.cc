// ZeRO-3's engine pieces on 1, 2 and 4 ranks: ShardedOptimizer with units (each rank keeps its
// range of the weights, the state and, with the reducer's release_unowned, the gradients) and
// ParameterUnits (each unit gathered just before its forward and again before its backward,
// released after each) against one process trained on the global batch with the replicated
// AdamW in float64; the memory a rank holds between steps and at its peak, counted exactly;
// and the bytes each step moves against the ZeRO paper's 3 x the weights.
#include <gtest/gtest.h>

#include <torch/torch.h>

#include <cstdio>
#include <string>
#include <vector>

#include "dtrain/dist/error.h"
#include "dtrain/engine/memory/memory.h"
#include "dtrain/engine/optim/optim.h"
#include "dtrain/engine/optim/sharded.h"
#include "dtrain/engine/parallel/reducer.h"
#include "test_util.h"

namespace dtrain::engine::zero3_test {

using testing_util::rel_error;
using testing_util::world_comm;

constexpr int64_t kWidth = 64, kBlocks = 16, kRows = 4;  // rows per rank

// kBlocks blocks tanh(Linear(x)) and a head Linear(width, 1), float64, the same weights on
// every rank (seeded).
struct Stack {
  Stack() {
    torch::manual_seed(7);
    for (int i = 0; i < kBlocks; ++i) blocks.push_back(torch::nn::Linear(kWidth, kWidth));
    head = torch::nn::Linear(kWidth, 1);
    for (auto& b : blocks) b->to(at::kDouble);
    head->to(at::kDouble);
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
std::pair<at::Tensor, at::Tensor> batch(int step, int ranks) {
  at::Generator g = at::detail::createCPUGenerator(100 + step);
  at::Tensor x = at::randn({ranks * kRows, kWidth}, g, at::kDouble);
  at::Tensor y = at::randn({ranks * kRows, 1}, g, at::kDouble);
  return {x, y};
}

OptimizerOptions adamw() {
  OptimizerOptions o;
  o.name = "adamw";
  o.lr = 1e-2;
  o.weight_decay = 0.1;
  return o;
}

constexpr int kSteps = 3;
constexpr int64_t kBucketBytes = int64_t{32} << 10;

// One process, the whole batch, the replicated optimizer.
std::vector<at::Tensor> reference(int ranks) {
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
};

Zero3Run zero3(dist::Communicator& comm) {
  track_cpu_memory();
  const c10::Device cpu(c10::kCPU);
  Zero3Run out;
  out.start_bytes = memory_stats(cpu).allocated_mb * 1024 * 1024;
  Stack m;
  std::vector<at::Tensor> params = m.params();
  for (const at::Tensor& p : params) out.numel += p.numel();
  // A unit per block (weight, bias) and one for the head.
  std::vector<size_t> starts;
  for (size_t j = 0; j < params.size(); j += 2) starts.push_back(j);
  ShardedOptimizer opt(params, adamw(), comm, starts);
  ReducerOptions ro;
  ro.broadcast_parameters = false;  // the weights are released already; every rank drew the same
  ro.release_unowned = comm.size() > 1;
  ro.bucket_bytes = kBucketBytes;  // several buckets, launched during backward
  ro.first_bucket_bytes = kBucketBytes / 4;
  for (const FlatRange& r : opt.gradient_owners()) ro.owned.emplace_back(r.begin, r.end);
  GradReducer reducer(params, comm, ro);
  opt.attach(reducer);
  ParameterUnits units(opt);
  const at::Tensor one = at::ones({}, at::kDouble);
  double bus_before = 0;
  for (int s = 0; s < kSteps; ++s) {
    auto [x, y] = batch(s, comm.size());
    x = x.narrow(0, comm.rank() * kRows, kRows).clone();
    y = y.narrow(0, comm.rank() * kRows, kRows).clone();
    if (s == kSteps - 1) {
      out.resident_bytes = memory_stats(cpu).allocated_mb * 1024 * 1024;
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
  for (int k = 0; k < units.units(); ++k) EXPECT_FALSE(opt.unit_gathered(k)) << "unit " << k << " left gathered";
  units.gather_all();
  for (const at::Tensor& p : params) out.weights.push_back(p.detach().clone());
  units.release_all();
  return out;
}

TEST(ParameterUnits, TrainsAsOneProcessOnTheGlobalBatch) {
  auto& comm = world_comm();
  const std::vector<at::Tensor> want = reference(comm.size());
  const Zero3Run got = zero3(comm);
  ASSERT_EQ(got.weights.size(), want.size());
  for (size_t i = 0; i < want.size(); ++i) {
    EXPECT_LT(rel_error(got.weights[i], want[i]), 1e-12) << "parameter " << i << " on rank " << comm.rank();
  }
}

// Between steps a rank holds its range of the weights, of the two AdamW moments and of the
// gradients (plus the parameters that straddle its range's ends): at 4 ranks at most 0.3 of the
// 4 x numel values an unsharded rank holds (weights, gradients, two moments). At the step's
// peak, at most two units' weights (the one computing, the one prefetched), the activations
// and two gradient buckets come on top (all the weights at once would be 16 units').
TEST(ParameterUnits, HoldsItsShareBetweenStepsAndAboutTwoUnitsMoreAtThePeak) {
  auto& comm = world_comm();
  const int n = comm.size();
  const Zero3Run got = zero3(comm);
  const double unsharded = 4.0 * got.numel * 8;
  const double resident = got.resident_bytes - got.start_bytes;
  const double block_bytes = (kWidth * kWidth + kWidth) * 8.0;
  // This rank's range (weights, two moments) and its kept gradients: 4 x numel / n, plus the
  // buckets around its range's two ends (one bucket each at most) and a few scalars (the
  // optimizer's step counts, the batch).
  // On one rank the gradient shard is the optimizer's own copy, not a view of the reducer's.
  const double bound = 4.0 * got.numel * 8 / n + 2.0 * kBucketBytes + (16 << 10) + (n == 1 ? got.numel * 8.0 : 0);
  EXPECT_LE(resident, bound) << "rank " << comm.rank();
  if (n == 4) EXPECT_LE(resident, 0.3 * unsharded) << "rank " << comm.rank() << ": " << resident / unsharded;
  // Activations: inputs and each block's saved tensors, kRows x kWidth float64 each.
  const double activations = 4.0 * kBlocks * kRows * kWidth * 8;
  // During backward a gradient bucket is filling while the one before it is reduced: the
  // reducer releases each bucket none of which is this rank's as soon as it is reduced.
  const double peak = got.peak_bytes - got.start_bytes;
  if (comm.rank() == 0) {
    std::printf("ZeRO-3 on %d rank(s): between steps %.3f of the unsharded rank's weights, gradients and AdamW "
                "state (%.0f KiB); the peak %.0f KiB above that (a unit's weights are %.0f KiB, activations %.0f KiB, "
                "a bucket %lld KiB)\n",
                n, resident / unsharded, resident / 1024, (peak - resident) / 1024, block_bytes / 1024,
                activations / 1024, static_cast<long long>(kBucketBytes >> 10));
  }
  EXPECT_LE(peak, resident + 2 * block_bytes + activations + 2.0 * kBucketBytes) << "rank " << comm.rank();
}

// Per step: each unit is gathered twice (forward, backward), a broadcast of each owner's piece
// (S bytes each), and the gradients reduced to their owners (S): 3 x the weights' bytes, the
// ZeRO paper's figure for stage 3.
TEST(ParameterUnits, MovesThreeTimesTheWeightsPerStep) {
  auto& comm = world_comm();
  if (comm.size() == 1) GTEST_SKIP() << "nothing moves on one rank";
  const Zero3Run got = zero3(comm);
  const double weights = got.numel * 8.0;
  EXPECT_NEAR(got.bus_bytes_per_step, 3 * weights, 0.05 * weights) << got.bus_bytes_per_step / weights;
}

TEST(ParameterUnits, BadUnitsAreRefused) {
  auto& comm = world_comm();
  Stack m;
  const std::vector<at::Tensor> params = m.params();
  auto message = [&](std::vector<size_t> starts) {
    try {
      ShardedOptimizer opt(params, adamw(), comm, starts);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  EXPECT_NE(message({1, 4}).find("the units must start at parameter 0"), std::string::npos);
  EXPECT_NE(message({0, 4, 4}).find("unit 2 starts at 4"), std::string::npos);
  EXPECT_NE(message({0, 99}).find("ascend below " + std::to_string(params.size())), std::string::npos);
}

}  // namespace dtrain::engine::zero3_test
