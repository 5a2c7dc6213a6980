// Optimizer offload with the reducer on the CPU over MPI (2 and 4 ranks): the cases of
// offload_engine_cases.h.
#include <gtest/gtest.h>

#include "dtrain/dist/error.h"
#include "offload_engine_cases.h"

namespace dtrain::engine::offload_engine_cases {
namespace {

using testing_util::world_comm;

TEST(OffloadEngineMpi, StreamedGradientsUpdateAsGradientsReadAfterBackward) {
  expect_streaming_matches_reading_grad(world_comm(), kCpu, streaming_adamw(), small_buckets(), 1.0);
}

TEST(OffloadEngineMpi, StreamedGradientsTakeTheFactorAppliedInPlaceAfterTheCopies) {
  OptimizerOptions oo;
  oo.name = "sgd";
  oo.lr = 0.05;
  oo.momentum = 0.9;
  expect_streaming_matches_reading_grad(world_comm(), kCpu, oo, small_buckets(), 0.37);
}

TEST(OffloadEngineMpi, StreamedCompressedBucketsUpdateAsTheirDecompressedGradients) {
  OptimizerOptions oo;
  oo.name = "adam";
  oo.lr = 0.01;
  ReducerOptions ro = small_buckets();
  ro.compress = at::kBFloat16;
  expect_streaming_matches_reading_grad(world_comm(), kCpu, oo, ro, 1.0);
}

TEST(OffloadEngineMpi, GradientsReducedToTheirOwnersUpdateAsAllReduced) {
  expect_owner_reduce_matches_all_reduce(world_comm(), kCpu, "off");
  expect_owner_reduce_matches_all_reduce(world_comm(), kCpu, "on");
}

TEST(OffloadEngineMpi, DelayedUpdateTrainsOnTheWeightsOfOneUpdateBefore) {
  expect_delayed_update_matches_reference(world_comm(), kCpu, "off");
}

TEST(OffloadEngineMpi, DelayedUpdateWithStreamedGradients) {
  expect_delayed_update_matches_reference(world_comm(), kCpu, "on");
}

TEST(OffloadEngineMpi, AllOffloadBf16StreamedBlocksKeepAFloat32MasterOnEveryRank) {
  expect_bf16_host_part_keeps_a_master(world_comm());
}

// Layer offload's delayed update is one rank's: on more it is refused, naming the way out.
TEST(OffloadEngineMpi, LayerOffloadDelayedUpdateNeedsOneRank) {
  auto net = offload_net(0, kCpu);
  OffloadOptions off;
  off.delayed_update_after = 1;
  std::vector<at::Tensor> params = net->parameters();
  EXPECT_TRUE(testing_util::throws_error_with(
      [&] { make_layer_offload_optimizer(params, {params[2], params[3]}, OptimizerOptions{}, world_comm(), off, kCpu); },
      "one data-parallel rank"));
}

TEST(OffloadEngineMpi, BadStreamingModeIsNamed) {
  auto net = offload_net(0, kCpu);
  OffloadOptions off;
  off.stream_gradients = "sometimes";
  try {
    OffloadedOptimizer opt(net->parameters(), OptimizerOptions{}, world_comm(), off);
    FAIL() << "accepted stream_gradients = sometimes";
  } catch (const dtrain::Error& e) {
    EXPECT_NE(std::string(e.what()).find("--offload_stream_gradients=sometimes is not one of: auto, on, off"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace dtrain::engine::offload_engine_cases
