// The background checkpoint's staging on CUDA: copies that wait for the work issued before them,
// overlap what follows, and land before the update that the fence orders after them.
#include <gtest/gtest.h>

#include <future>

#include <ATen/ATen.h>
#include <ATen/detail/CUDAHooksInterface.h>
#include <torch/torch.h>

#include "device_work.h"
#include "dtrain/dist/mesh.h"
#include "dtrain/engine/data/data.h"
#include "dtrain/engine/state/checkpoint.h"
#include "dtrain/engine/state/host_staging.h"
#include "dtrain/engine/train/trainer.h"
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

// Regression (a background save copied SGD's step counters before they were written: the
// optimizer's state() makes them on the current stream after the save's first side copy was
// ordered): a source made behind a long queue of work after an earlier stage() call, in a block
// that held other values, is copied after its write.
TEST(HostStagingGpu, ASourceWrittenAfterAnEarlierStageIsCopiedAfterItsWrite) {
  DTRAIN_SKIP_WITHOUT_CUDA();
  HostStaging staging;
  const int64_t n = int64_t{1} << 20;
  at::Tensor weight = at::full({n}, 1.0f, at::device(kCuda));
  for (int save = 0; save < 3; ++save) {
    SCOPED_TRACE("save " + std::to_string(save));
    at::Tensor host_weight = staging.stage("model.weight", weight, HostStaging::kUntilNextUpdate);
    at::full({n}, -7.0f, at::device(kCuda));  // a block of the step's size, holding other values, freed
    testing_util::queue_matmuls(kCuda, 30);   // the device is busy long after the host goes on
    at::Tensor step = at::full({n}, 42.0f + save, at::device(kCuda));  // written behind that work
    at::Tensor host_step = staging.stage("optimizer.0.step", step, HostStaging::kUntilNextUpdate);
    staging.seal();
    staging.wait();
    EXPECT_TRUE(at::equal(host_step, at::full({n}, 42.0f + save))) << "the copy ran before the write";
    EXPECT_TRUE(at::equal(host_weight, at::full({n}, 1.0f)));
    staging.fence();
  }
}

// An async save of SGD with momentum on the GPU right at its first step holds that step's
// counters (1) and momentum (end to end: the trainer's order of staging; whether the device lags
// enough to show the old race depends on the machine, the test above shows it for sure).
TEST(HostStagingGpu, AnAsyncSaveOfSgdAtItsFirstStepHoldsItsStepCounters) {
  DTRAIN_SKIP_WITHOUT_CUDA();
  auto comm = dist::create_communicator("local", dist::World{}, kCuda);
  dist::Mesh mesh(*comm, 1);
  testing_util::ScratchDir dir("sgd_async_save", /*create=*/true);
  torch::manual_seed(1);
  torch::nn::Linear model(64, 32);
  model->to(kCuda);
  TrainerOptions o;
  o.steps = 1;
  o.save_every = 1;
  o.save_dir = dir.str();
  o.async_save = true;
  o.progress = false;
  o.handle_preemption = false;
  o.optimizer.name = "sgd";
  o.optimizer.momentum = 0.9;
  o.optimizer.lr = 0.1;
  Trainer trainer(*model, [&](const Batch& b) { return torch::mse_loss(model->forward(b.fields[0]), b.fields[1]); },
                  mesh, kCuda, o);
  auto g = at::make_generator<at::CPUGeneratorImpl>(3);
  auto data = std::make_shared<TensorDataset>(
      std::vector<at::Tensor>{at::randn({32, 64}, g), at::randn({32, 32}, g)});
  LoaderOptions lo;
  lo.batch_size = 32;
  lo.workers = 0;
  lo.device = kCuda;
  DataLoader loader(data, lo);
  trainer.fit(loader);
  CheckpointStore store(dir.str());
  ASSERT_TRUE(store.latest_good().has_value());
  const CheckpointData saved = store.load(store.path_for(1));
  int steps = 0;
  for (const auto& [name, t] : saved.optimizer) {
    if (name.size() < 5 || name.substr(name.size() - 5) != ".step") continue;
    ++steps;
    EXPECT_EQ(t.item<double>(), 1.0) << name;
  }
  EXPECT_EQ(steps, 2) << "a step counter per parameter";
}

// The background writer's thread (async_on_device) on a GPU other than 0 makes no CUDA context
// on a GPU that had none: it waits for the staged copies on its own device. Needs two GPUs, and
// a GPU without a context in this process yet (run alone: --gtest_filter=*WriterThread*); a
// one-GPU machine cannot show it (the unit test DeviceThreads.* checks the device on the CPU).
TEST(HostStagingGpu, TheWriterThreadMakesNoContextOnAnotherGpu) {
  DTRAIN_SKIP_WITHOUT_CUDA();
  const int gpus = static_cast<int>(c10::impl::getDeviceGuardImpl(c10::kCUDA)->deviceCount());
  if (gpus < 2) GTEST_SKIP() << "needs two GPUs (" << gpus << " here)";
  const c10::Device target(c10::kCUDA, static_cast<c10::DeviceIndex>(gpus - 1));
  std::vector<int> without;  // GPUs without a context so far
  for (int i = 0; i + 1 < gpus; ++i) {
    if (!at::detail::getCUDAHooks().hasPrimaryContext(static_cast<c10::DeviceIndex>(i))) without.push_back(i);
  }
  if (without.empty()) GTEST_SKIP() << "every other GPU has a CUDA context in this process already";
  HostStaging staging;
  at::Tensor weight = at::full({1 << 20}, 3.0f, at::device(target));
  at::Tensor host = staging.stage("w", weight, HostStaging::kUntilNextUpdate);
  staging.seal();
  // From a thread that never set a device, as std::async's.
  const int seen = async_on_device(target, [&] {
                     staging.wait();
                     return static_cast<int>(c10::impl::getDeviceGuardImpl(c10::kCUDA)->getDevice().index());
                   }).get();
  EXPECT_EQ(seen, target.index());
  EXPECT_TRUE(at::equal(host, at::full({1 << 20}, 3.0f)));
  for (int i : without) {
    EXPECT_FALSE(at::detail::getCUDAHooks().hasPrimaryContext(static_cast<c10::DeviceIndex>(i)))
        << "the writer made a CUDA context on GPU " << i;
  }
  staging.fence();
}

}  // namespace
}  // namespace dtrain::engine::staging_cases
