// Exact-size page-locked host memory on a GPU: large blocks come from the CUDA runtime, not
// PyTorch's power-of-two cache, are page-locked (asynchronous copies at full speed) and carry
// data both ways; layer offload's homes of large weights and the pool's large blocks use them.
#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <ATen/core/CachingHostAllocator.h>
#include <torch/torch.h>

#include "dtrain/offload/layer_offload.h"
#include "dtrain/offload/page_locked.h"
#include "dtrain/offload/pinned_pool.h"
#include "test_util.h"

namespace dtrain {
namespace {

int64_t cached_host_bytes() {
  return at::getHostAllocator(at::kCUDA)->get_stats().allocated_bytes.current;
}

TEST(PageLockedGpu, LargeBlocksAreExactPinnedAndCarryDataBothWays) {
  DTRAIN_SKIP_WITHOUT_CUDA();
  const c10::Device dev(c10::kCUDA, 0);
  ASSERT_NE(offload::cuda_page_locker(), nullptr);
  const int64_t n = offload::kExactPinMinBytes / 4 + 1027;  // past the threshold, not a power of two
  const int64_t cached_before = cached_host_bytes();
  at::Tensor host = offload::page_locked_empty({n}, at::kFloat);
  at::Tensor back = offload::page_locked_empty({n}, at::kFloat);
  EXPECT_TRUE(host.is_pinned());
  EXPECT_TRUE(back.is_pinned());
  EXPECT_EQ(cached_host_bytes(), cached_before) << "not from PyTorch's power-of-two cache";
  host.copy_(at::arange(n, at::kFloat));
  at::Tensor d = at::empty({n}, at::TensorOptions().device(dev));
  d.copy_(host, /*non_blocking=*/true);
  d.mul_(2);
  back.copy_(d, /*non_blocking=*/true);
  torch::cuda::synchronize();
  EXPECT_TRUE(at::equal(back, at::arange(n, at::kFloat) * 2));
  // A small request still comes from the cache (cheap reuse).
  at::Tensor small = offload::page_locked_empty({1000}, at::kFloat);
  EXPECT_TRUE(small.is_pinned());
  EXPECT_GT(cached_host_bytes(), cached_before);
  // Freeing while a copy may be in flight waits for the device first (no fault, no error).
  at::Tensor late = offload::page_locked_empty({n}, at::kFloat);
  late.copy_(d, /*non_blocking=*/true);
  late = at::Tensor();
  torch::cuda::synchronize();
}

TEST(PageLockedGpu, ThePoolChargesALargePinnedBlockItsPages) {
  DTRAIN_SKIP_WITHOUT_CUDA();
  offload::PinnedPool pool;
  ASSERT_TRUE(pool.pinned());
  const int64_t bytes = (int64_t{20} << 20) + 1;  // 20 MiB + 1: PyTorch's cache would take 32 MiB
  at::Tensor t = pool.allocate(bytes);
  EXPECT_TRUE(t.is_pinned());
  EXPECT_EQ(pool.used_bytes(), (int64_t{20} << 20) + 4096);
  t = at::Tensor();
  EXPECT_EQ(pool.used_bytes(), 0);
}

// Layer offload: a 2048 x 2048 float weight (16 MiB) gets an exact page-locked home, and the
// streamed blocks still match the resident ones.
TEST(PageLockedGpu, LayerOffloadHomesOfLargeWeightsAreExact) {
  DTRAIN_SKIP_WITHOUT_CUDA();
  const c10::Device dev(c10::kCUDA, 0);
  const int64_t d = 2048;
  torch::manual_seed(5);
  torch::nn::Linear resident(d, d), streamed(d, d);
  streamed->weight.data().copy_(resident->weight.data());
  streamed->bias.data().copy_(resident->bias.data());
  resident->to(dev);
  streamed->to(dev);
  const int64_t cached_before = cached_host_bytes();
  offload::LayerStreamer streamer({streamed.ptr()}, dev);
  EXPECT_TRUE(streamed->weight.is_cpu());
  EXPECT_TRUE(streamed->weight.is_pinned());
  // Only the 8 KiB bias may come from the cache; the 16 MiB weight does not.
  EXPECT_LT(cached_host_bytes() - cached_before, int64_t{1} << 20);
  at::Tensor x = at::randn({4, d}, at::TensorOptions().device(dev));
  streamer.acquire(0, 1);
  at::Tensor y = streamed->forward(x);
  streamer.release(0);
  EXPECT_LT(testing_util::rel_error(y, resident->forward(x)), 1e-6);
}

}  // namespace
}  // namespace dtrain
