// ZeRO-3's engine pieces on 1, 2 and 4 ranks: Zero3Optimizer (each rank keeps its piece of every
// unit of the weights, the state and, through the reducer's reduce-scatter, the gradients) and
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
#include "dtrain/engine/parallel/grad_norm.h"
#include "dtrain/engine/zero3/parameter_units.h"
#include "dtrain/offload/cpu_optimizer.h"
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

// Between steps a rank holds its shard (a piece of every unit, padded to 64 x ranks elements per
// unit) of the weights, of the two AdamW moments and of the gradients: at 4 ranks at most 0.3 of
// the 4 x numel values an unsharded rank holds (weights, gradients, two moments). At the step's
// peak, at most two units' weights (the one computing, the one prefetched), the activations
// and two units' gradient buckets come on top (all the weights at once would be 16 units').
TEST(ParameterUnits, HoldsItsShareBetweenStepsAndAboutTwoUnitsMoreAtThePeak) {
  auto& comm = world_comm();
  const int n = comm.size();
  const Zero3Run got = zero3(comm);
  const double unsharded = 4.0 * got.numel * 8;
  const double resident = got.resident_bytes - got.start_bytes;
  // A block's unit, padded as the layout pads it (its gathered buffer and its gradient bucket).
  const double unit_bytes = offload::padded_numel(kWidth * kWidth + kWidth, n) * 8.0;
  // The shard: each unit's n_k elements padded to a multiple of 64 x n, 1/n of it here; the
  // gradients are exactly the shard (the reducer keeps none between steps).
  const int64_t block_chunk = offload::padded_numel(kWidth * kWidth + kWidth, n) / n;
  EXPECT_EQ(got.shard, kBlocks * block_chunk + offload::padded_numel(kWidth + 1, n) / n) << "rank " << comm.rank();
  EXPECT_EQ(got.gradient_bytes, got.shard * 8) << "rank " << comm.rank();
  // The shard (weights, two moments, gradients), plus what the backend may still hold of the
  // last collectives (at most a unit's bucket or piece here) and a few scalars (the
  // optimizer's step counts, the batch).
  const double bound = 4.0 * got.shard * 8 + 2.0 * unit_bytes + (16 << 10);
  EXPECT_LE(resident, bound) << "rank " << comm.rank();
  if (n == 4) EXPECT_LE(resident, 0.3 * unsharded) << "rank " << comm.rank() << ": " << resident / unsharded;
  // Activations: inputs and each block's saved tensors, kRows x kWidth float64 each.
  const double activations = 4.0 * kBlocks * kRows * kWidth * 8;
  // During backward a unit's gradient bucket is filling while the one before it is
  // reduce-scattered: the reducer releases each bucket as soon as that completes.
  const double peak = got.peak_bytes - got.start_bytes;
  if (comm.rank() == 0) {
    std::printf("ZeRO-3 on %d rank(s): between steps %.3f of the unsharded rank's weights, gradients and AdamW "
                "state (%.0f KiB); the peak %.0f KiB above that (a unit's weights and its gradient bucket are "
                "%.0f KiB each, activations %.0f KiB)\n",
                n, resident / unsharded, resident / 1024, (peak - resident) / 1024, unit_bytes / 1024,
                activations / 1024);
  }
  EXPECT_LE(peak, resident + 4 * unit_bytes + activations) << "rank " << comm.rank();
}

// Per step: each unit is gathered twice (forward, backward) by one all_gather, and its
// gradients reduce-scattered once, each moving (n - 1) / n of the unit's padded bytes per rank
// (the bus bytes of dist::CommTraffic): 3 x the weights' bytes as the ZeRO paper counts stage
// 3, exactly, with the units' padding.
TEST(ParameterUnits, MovesThreeTimesTheWeightsPerStep) {
  auto& comm = world_comm();
  const int n = comm.size();
  if (n == 1) GTEST_SKIP() << "nothing moves on one rank";
  const Zero3Run got = zero3(comm);
  const double padded = (kBlocks * offload::padded_numel(kWidth * kWidth + kWidth, n) +
                         offload::padded_numel(kWidth + 1, n)) * 8.0;
  EXPECT_NEAR(got.bus_bytes_per_step, 3 * padded * (n - 1) / n, 1.0) << got.bus_bytes_per_step / padded;
  EXPECT_LT(padded, 1.05 * got.numel * 8.0);  // the padding costs under 5% here
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
  // The host: the shard's fp32 master, two moments and gradient staging, and the CPU
  // optimizer's two copy-back tiles (4 Mi fp32 elements each, whatever the shard).
  const double shard = static_cast<double>(got.shard);
  const double tiles = 2.0 * (int64_t{4} << 20) * 4;
  EXPECT_GE(got.host_bytes, 4 * shard * 4 + tiles) << "rank " << comm.rank();
  EXPECT_LE(got.host_bytes, 4 * (shard + 64) * 4 + 4 * 256 + tiles) << "rank " << comm.rank();
  // The rest ("allocated" on the CPU counts the host pool too): the shard of the weights and
  // of the gradients (float64), and no moments.
  const double resident = got.resident_bytes - got.start_bytes - got.host_bytes;
  EXPECT_EQ(got.gradient_bytes, got.shard * 8) << "rank " << comm.rank();
  const double unit_bytes = offload::padded_numel(kWidth * kWidth + kWidth, n) * 8.0;
  const double bound = 2.0 * shard * 8 + 2.0 * unit_bytes + (16 << 10);
  EXPECT_LE(resident, bound) << "rank " << comm.rank();
}

// The gradient norm under ZeRO-3: each rank counts its piece of every unit from the gradient
// shard (the reduce-scatter's output, padding between the pieces) and the squares are summed
// over the ranks: the norm of the whole gradients, computed in float64 here. The units are
// smaller than the padding, so on 2 and 4 ranks the last rank holds no element at all and
// still takes part in the sum.
TEST(ParameterUnits, GradNormOfTheShardsIsTheNormOfTheWholeGradients) {
  auto& comm = world_comm();
  const int n = comm.size();
  torch::manual_seed(3);  // the same weights and gradients on every rank
  std::vector<at::Tensor> params, grads;
  for (const std::vector<int64_t>& shape : {std::vector<int64_t>{30}, {10}, {5, 4}}) {
    params.push_back(at::randn(shape, at::kDouble).requires_grad_(true));
    grads.push_back(at::randn(shape, at::kDouble));
  }
  std::vector<at::Tensor> flat;
  for (const at::Tensor& g : grads) flat.push_back(g.reshape({-1}));
  const at::Tensor whole = at::cat(flat);
  const double want = whole.norm().item<double>();
  Zero3Optimizer z3(params, adamw(), comm, {0, 1, 2});
  const ShardLayout layout = *z3.shard_layout();
  const std::vector<int64_t> at = z3.shard_positions();
  for (size_t q = 0; q < at.size(); ++q) {
    z3.gradient_shard().narrow(0, at[q], layout.ranges[q].size()).copy_(
        whole.narrow(0, layout.ranges[q].begin, layout.ranges[q].size()));
  }
  if (n > 1 && comm.rank() == n - 1) EXPECT_TRUE(layout.ranges.empty()) << "the last rank holds only padding";
  GradNormLayout norm_layout;
  norm_layout.partitioned = true;
  norm_layout.owned = layout.ranges;
  norm_layout.owned_values = z3.gradient_shard();
  norm_layout.owned_at = at;
  norm_layout.dp = &comm;
  EXPECT_NEAR(global_grad_norm(z3.params(), norm_layout).item<double>(), want, 1e-6 * want) << "rank " << comm.rank();
}

// The out-of-memory replay: the last rank issued a step's first gathers and reduce-scatter, then
// "failed" and runs the step again. Its replay completes those three at once without moving a
// byte (a gathered unit holds zeros, the gradient shard keeps the average the first attempt
// got: (1 + ... + N) / N, not the replay's 100), and the next collective, issued by every rank,
// has the same sequence number everywhere and gathers the right weights.
TEST(ParameterUnits, AReplayCompletesTheCollectivesItTookPartInAtOnce) {
  auto& comm = world_comm();
  const int n = comm.size();
  if (n == 1) GTEST_SKIP() << "nothing is issued on one rank";
  torch::manual_seed(5);  // the same weights on every rank
  std::vector<at::Tensor> params;
  for (int64_t len : {12, 7, 9}) params.push_back(at::randn({len}, at::kDouble).requires_grad_(true));
  std::vector<at::Tensor> want;
  for (const at::Tensor& p : params) want.push_back(p.detach().clone());
  Zero3Optimizer z3(params, adamw(), comm, {0, 1, 2});
  const std::shared_ptr<BucketComm> buckets = z3.bucket_comm();
  const int64_t chunk = buckets->storage_numel(12) / n;  // unit 0's piece per rank
  auto first_attempt = [&](double value) {
    std::vector<dist::WorkPtr> works = z3.gather_unit(0);
    for (dist::WorkPtr& w : z3.gather_unit(1)) works.push_back(w);
    const at::Tensor wire = at::full({chunk * n}, value, at::kDouble);
    for (dist::WorkPtr& w : buckets->launch(wire, 0, comm).works) works.push_back(w);
    for (dist::WorkPtr& w : works) w->wait();
    z3.release_unit(0);
    z3.release_unit(1);
  };
  z3.begin_step();
  first_attempt(1.0 + comm.rank());
  EXPECT_EQ(z3.issued_in_step(), 3);
  const double average = (n + 1) / 2.0;
  const at::Tensor mine = z3.gradient_shard().narrow(0, 0, chunk);
  EXPECT_TRUE(at::allclose(mine, at::full({chunk}, average, at::kDouble)));
  if (comm.rank() == n - 1) {
    const uint64_t issued = comm.issued();
    const double bytes = comm.traffic().bus_bytes;
    z3.replay_step();
    EXPECT_EQ(z3.replaying(), 3);
    EXPECT_TRUE(z3.gather_unit(0).empty()) << "a skipped gather is not issued";
    EXPECT_TRUE(at::equal(params[0].detach(), at::zeros({12}, at::kDouble))) << "a skipped gather leaves zeros";
    EXPECT_EQ(z3.replaying(), 2);
    EXPECT_TRUE(z3.gather_unit(1).empty());
    const dist::WorkPtr skipped = buckets->launch(at::full({chunk * n}, 100.0, at::kDouble), 0, comm).mine;
    EXPECT_TRUE(skipped->is_completed());
    z3.release_unit(0);
    z3.release_unit(1);
    EXPECT_EQ(z3.replaying(), 0);
    EXPECT_EQ(comm.issued(), issued);
    EXPECT_EQ(comm.traffic().bus_bytes, bytes);
    EXPECT_TRUE(at::allclose(mine, at::full({chunk}, average, at::kDouble))) << "a skipped reduce-scatter writes nothing";
  }
  EXPECT_NO_THROW(z3.begin_step()) << "the replay is complete";  // the next step
  std::vector<dist::WorkPtr> works = z3.gather_unit(2);
  ASSERT_EQ(works.size(), 1u);
  works.front()->wait();
  EXPECT_TRUE(at::equal(params[2].detach(), want[2]));
  at::Tensor seq = at::full({2}, static_cast<double>(works.front()->sequence()), at::kDouble);
  seq[1].neg_();
  comm.all_reduce(seq, dist::ReduceOp::kMax)->wait();
  EXPECT_EQ(seq[0].item<double>(), -seq[1].item<double>()) << "every rank's next collective has the same number";
  z3.release_unit(2);
  z3.replay_step();  // one gather (unit 2's) still to skip: a new step would be out of step
  EXPECT_EQ(z3.replaying(), 1);
  EXPECT_THROW(z3.begin_step(), Error);
}

TEST(ParameterUnits, BadUnitsAreRefused) {
  auto& comm = world_comm();
  Stack m;
  const std::vector<at::Tensor> params = m.params();
  auto message = [&](std::vector<size_t> starts) {
    try {
      Zero3Optimizer opt(params, adamw(), comm, starts);
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
