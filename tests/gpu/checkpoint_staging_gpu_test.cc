// The background checkpoint's staging on CUDA: copies that wait for the work issued before them,
// overlap what follows, and land before the update that the fence orders after them.
#include <gtest/gtest.h>

#include <future>

#include <ATen/ATen.h>

#include "dtrain/engine/state/host_staging.h"
#include "test_util.h"

namespace dtrain::engine::staging_cases {
namespace {

const c10::Device kCuda(c10::kCUDA, 0);

TEST(HostStagingGpu, CopiesSeeTheStateAtStageTimeWhateverComesAfter) {
  DTRAIN_SKIP_WITHOUT_CUDA();
  HostStaging staging;
  const int64_t n = int64_t{16} << 20;  // 64 MiB of float: each pass below takes tens of microseconds
  at::Tensor weight = at::empty({n}, at::device(kCuda));
  at::Tensor buffer = at::empty({n}, at::device(kCuda));
  const void* first_pinned = nullptr;
  for (int save = 0; save < 3; ++save) {
    SCOPED_TRACE("save " + std::to_string(save));
    weight.fill_(0);
    buffer.fill_(0);
    // A queue of work ahead of the copies: they must start after it.
    for (int i = 0; i < 20; ++i) {
      weight.add_(1);
      buffer.add_(2);
    }
    at::Tensor host_weight = staging.stage("weight", weight, HostStaging::kUntilNextUpdate);
    at::Tensor host_buffer = staging.stage("buffer", buffer, HostStaging::kNow);
    staging.seal();
    ASSERT_TRUE(host_weight.is_pinned());
    ASSERT_TRUE(host_buffer.is_pinned());
    buffer.fill_(-1);  // the next forward writes running statistics: after their copy
    staging.fence();
    weight.fill_(-1);  // the update writes the weights: after the fence
    // The writer thread waits for the copies.
    std::async(std::launch::async, [&] { staging.wait(); }).get();
    EXPECT_TRUE(at::equal(host_weight, at::full({n}, 20.0f)));
    EXPECT_TRUE(at::equal(host_buffer, at::full({n}, 40.0f)));
    // Later saves reuse the pinned buffers.
    if (save == 0) first_pinned = host_weight.data_ptr();
    EXPECT_EQ(host_weight.data_ptr(), first_pinned);
    EXPECT_EQ(staging.pinned_bytes(), 2 * n * 4);
  }
}

TEST(HostStagingGpu, ANewShapeGetsANewBuffer) {
  DTRAIN_SKIP_WITHOUT_CUDA();
  HostStaging staging;
  at::Tensor a = at::arange(6, at::device(kCuda).dtype(at::kFloat));
  at::Tensor first = staging.stage("t", a, HostStaging::kNow);
  staging.seal();
  staging.wait();
  staging.fence();
  at::Tensor b = at::arange(8, at::device(kCuda).dtype(at::kDouble)).reshape({2, 4});
  at::Tensor second = staging.stage("t", b, HostStaging::kUntilNextUpdate);
  staging.seal();
  staging.wait();
  EXPECT_TRUE(at::equal(first, at::arange(6, at::kFloat)));
  EXPECT_TRUE(at::equal(second, b.cpu()));
  EXPECT_EQ(staging.pinned_bytes(), 8 * 8);
}

}  // namespace
}  // namespace dtrain::engine::staging_cases
