// DataLoader delivering to a CUDA device: pinned staging, side-stream copies ordered before
// the caller's current stream. Skips without a GPU.
#include <ATen/ATen.h>
#include <c10/core/Stream.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <gtest/gtest.h>

#include <memory>
#include <vector>

#include "dtrain/engine/data/data.h"
#include "test_util.h"

namespace dtrain::engine {
namespace {

// Large enough rows that a copy racing the consumer would be visible.
std::vector<at::Tensor> dataset_fields(int64_t n) {
  at::Tensor ids = at::arange(n, at::kLong);
  at::Tensor rows = ids.to(at::kFloat).view({n, 1}) + at::arange(4096, at::kFloat).view({1, 4096});
  return {rows, ids};
}

TEST(DataGpu, BatchesArriveOnTheDeviceWithTheSameValues) {
  DTRAIN_SKIP_WITHOUT_CUDA();
  const int64_t n = 64;
  auto fields = dataset_fields(n);
  auto ds = std::make_shared<TensorDataset>(fields);
  const c10::Device cuda(c10::kCUDA, 0);
  for (bool pin : {true, false}) {
    for (int workers : {0, 2}) {
      LoaderOptions o;
      o.batch_size = 8;
      o.workers = workers;
      o.prefetch = 3;
      o.pin_memory = pin;
      o.device = cuda;
      o.seed = 5;
      LoaderOptions cpu_opts = o;
      cpu_opts.device = c10::Device(c10::kCPU);
      DataLoader loader(ds, o);
      DataLoader reference(ds, cpu_opts);
      // Consume on a non-default stream: the loader must order its copies before it.
      c10::impl::VirtualGuardImpl impl(c10::kCUDA);
      c10::StreamGuard on_stream(impl.getStreamFromGlobalPool(cuda));
      for (int s = 0; s < 12; ++s) {
        Batch batch = loader.next();
        Batch expected = reference.next();
        ASSERT_EQ(batch.fields.size(), 2u);
        EXPECT_EQ(batch.fields[0].device(), cuda);
        EXPECT_EQ(batch.fields[1].device(), cuda);
        EXPECT_EQ(batch.fields[0].scalar_type(), at::kFloat);
        at::Tensor doubled = batch.fields[0] * 2;  // runs on the current stream
        EXPECT_TRUE(at::equal(doubled.cpu(), expected.fields[0] * 2)) << "pin " << pin;
        EXPECT_TRUE(at::equal(batch.fields[1].cpu(), expected.fields[1]));
      }
    }
  }
}

TEST(DataGpu, DeviceWithoutIndexMeansTheCurrentDevice) {
  DTRAIN_SKIP_WITHOUT_CUDA();
  LoaderOptions o;
  o.batch_size = 4;
  o.device = c10::Device(c10::kCUDA);
  DataLoader loader(std::make_shared<TensorDataset>(dataset_fields(16)), o);
  Batch batch = loader.next();
  EXPECT_TRUE(batch.fields[0].is_cuda());
  EXPECT_EQ(batch.fields[0].device().index(),
            c10::impl::VirtualGuardImpl(c10::kCUDA).getDevice().index());
}

}  // namespace
}  // namespace dtrain::engine
