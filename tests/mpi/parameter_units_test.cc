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
#include "zero3_cases.h"

namespace dtrain::engine::zero3_cases {
namespace {

using testing_util::rel_error;
using testing_util::world_comm;

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
// gradients (exactly: a parameter that straddles its range's ends is not kept whole): at 4
// ranks at most 0.3 of the
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
  // The gradients: exactly this rank's range, also where a parameter straddles its ends.
  if (n > 1) EXPECT_EQ(got.gradient_bytes, got.range * 8) << "rank " << comm.rank();
  // This rank's range (weights, two moments, gradients): 4 x numel / n, plus what the backend
  // may still hold of the last collectives (at most a bucket or a unit's piece here) and a few
  // scalars (the optimizer's step counts, the batch).
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

// The ZeRO-Offload layout of stage 3 (--shard=parameters --offload=optimizer): the same steps
// with each rank's range of the fp32 master weights and AdamW state on the host, updated by the
// CPU optimizer. The device keeps the range of the weights and of the gradients only; the host
// the range's master and two moments. The update runs in fp32 (the CPU optimizer's master), so
// the float64 reference is met to fp32's rounding.
TEST(ParameterUnits, OffloadedOptimizerTrainsAsOneProcessAndKeepsItsStateOnTheHost) {
  auto& comm = world_comm();
  const int n = comm.size();
  const std::vector<at::Tensor> want = reference(n);
  OffloadOptions offload;
  offload.threads = 1;
  const Zero3Run got = zero3(comm, c10::Device(c10::kCPU), &offload);
  ASSERT_EQ(got.weights.size(), want.size());
  for (size_t i = 0; i < want.size(); ++i) {
    EXPECT_LT(rel_error(got.weights[i], want[i]), 1e-5) << "parameter " << i << " on rank " << comm.rank();
  }
  // The host: the range's fp32 master, two moments and gradient staging, and the CPU
  // optimizer's two copy-back tiles (4 Mi fp32 elements each, whatever the range).
  const double range = static_cast<double>(got.numel) / n;
  const double tiles = 2.0 * (int64_t{4} << 20) * 4;
  EXPECT_GE(got.host_bytes, 4 * range * 4 * 0.99 + tiles) << "rank " << comm.rank();
  EXPECT_LE(got.host_bytes, 4 * (range + 64) * 4 + 4 * 256 + tiles) << "rank " << comm.rank();
  // The rest ("allocated" on the CPU counts the host pool too): the range of the weights and
  // the gradients kept (float64), the range's fp32 gradient for the copy, and no moments.
  const double resident = got.resident_bytes - got.start_bytes - got.host_bytes;
  if (n > 1) EXPECT_EQ(got.gradient_bytes, got.range * 8) << "rank " << comm.rank();
  const double bound = 2.0 * got.numel * 8 / n + got.numel * 4.0 / n + 2.0 * kBucketBytes + (16 << 10) +
                       (n == 1 ? got.numel * 8.0 : 0);
  EXPECT_LE(resident, bound) << "rank " << comm.rank();
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

}  // namespace
}  // namespace dtrain::engine::zero3_cases
