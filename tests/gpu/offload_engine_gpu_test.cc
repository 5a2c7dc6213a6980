// Optimizer offload with the reducer on a CUDA GPU (1 rank, and 2 ranks over MPI sharing
// it): the cases of offload_engine_cases.h with device parameters, so the streamed copies
// run on a copy stream into pinned memory, the delayed update lands through its own stream
// and device buffer, and every ordering between them and the compute stream is exercised.
#include <gtest/gtest.h>

#include "offload_engine_cases.h"

namespace dtrain::engine::offload_engine_cases {
namespace {

using testing_util::world_comm;

c10::Device gpu() { return c10::Device(c10::kCUDA, 0); }

TEST(OffloadEngineGpu, StreamedGradientsUpdateAsGradientsReadAfterBackward) {
  DTRAIN_SKIP_WITHOUT_CUDA();
  OptimizerOptions oo = streaming_adamw();
  expect_streaming_matches_reading_grad(world_comm(), gpu(), oo, small_buckets(), 1.0);
  oo.name = "sgd";
  oo.momentum = 0.9;
  expect_streaming_matches_reading_grad(world_comm(), gpu(), oo, small_buckets(), 0.37);
}

TEST(OffloadEngineGpu, GradientsReducedToTheirOwnersUpdateAsAllReduced) {
  DTRAIN_SKIP_WITHOUT_CUDA();
  expect_owner_reduce_matches_all_reduce(world_comm(), gpu(), "auto");
}

TEST(OffloadEngineGpu, DelayedUpdateWithStreamedGradientsMatchesTheReference) {
  DTRAIN_SKIP_WITHOUT_CUDA();
  expect_delayed_update_matches_reference(world_comm(), gpu(), "auto");
  expect_delayed_update_matches_reference(world_comm(), gpu(), "off");
}

}  // namespace
}  // namespace dtrain::engine::offload_engine_cases
