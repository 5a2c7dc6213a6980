// The planner on a GPU: the caching allocator's peak during real training against the
// estimate (within 10%, fp32 / bf16 / checkpointing / accumulation), and apply_memory_limit()
// capping what the caching allocator may take.
#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include "../unit/planner_accuracy.h"
#include "dtrain/engine/memory/memory.h"
#include "dtrain/engine/memory/planner.h"
#include "test_util.h"

namespace dtrain::engine {
namespace {

const c10::Device kCuda(c10::kCUDA, 0);

TEST(PlannerGpu, EstimateWithinTenPercentOfTheMeasuredPeak) {
  DTRAIN_SKIP_WITHOUT_CUDA();
  planner_testing::check_estimates_against_training(kCuda, AmpMode::kBf16);
}

TEST(PlannerGpu, MemoryLimitCapsTheCachingAllocator) {
  DTRAIN_SKIP_WITHOUT_CUDA();
  release_cached_memory(kCuda);
  const int64_t in_use = std::llround(memory_stats(kCuda).reserved_mb * 1024 * 1024);
  const int64_t limit = in_use + (int64_t{256} << 20);
  ASSERT_TRUE(apply_memory_limit(kCuda, limit));
  bool refused = false;
  try {
    at::Tensor big =
        at::empty({int64_t{512} << 20}, at::TensorOptions().dtype(at::kByte).device(kCuda));
  } catch (const c10::OutOfMemoryError&) {
    refused = true;
  }
  EXPECT_TRUE(refused) << "512 MiB allocated under a cap of 256 MiB above what was reserved";
  {
    at::Tensor small =
        at::empty({int64_t{64} << 20}, at::TensorOptions().dtype(at::kByte).device(kCuda));
    EXPECT_EQ(small.numel(), int64_t{64} << 20);
  }
  ASSERT_TRUE(apply_memory_limit(kCuda, 0));  // no cap again
  at::Tensor big =
      at::empty({int64_t{512} << 20}, at::TensorOptions().dtype(at::kByte).device(kCuda));
  EXPECT_EQ(big.numel(), int64_t{512} << 20);
}

}  // namespace
}  // namespace dtrain::engine
