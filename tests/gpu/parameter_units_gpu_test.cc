// ZeRO-3's engine pieces with the model on a CUDA GPU (1 rank, and 2 ranks over MPI sharing it):
// the units' buffers are materialized and released by the CUDA caching allocator, gathered by
// broadcasts of device tensors, and the weights after three steps equal one CPU process on the
// global batch (float64: the device and the host compute the same function to rounding); between
// steps a rank holds its range, and all the units are released; also with the optimizer offloaded.
// OOM back-off through the trainer with the units on the device (zero3_oom_cases.h).
#include <gtest/gtest.h>

#include "test_util.h"
#include "zero3_cases.h"
#include "zero3_oom_cases.h"

namespace dtrain::engine::zero3_cases {
namespace {

using testing_util::rel_error;
using testing_util::world_comm;

TEST(ParameterUnitsGpu, TrainsAsOneCpuProcessOnTheGlobalBatch) {
  DTRAIN_SKIP_WITHOUT_CUDA();
  auto& comm = world_comm();
  const std::vector<at::Tensor> want = reference(comm.size());
  const Zero3Run got = zero3(comm, c10::Device(c10::kCUDA, 0));
  ASSERT_EQ(got.weights.size(), want.size());
  for (size_t i = 0; i < want.size(); ++i) {
    EXPECT_LT(rel_error(got.weights[i], want[i]), 1e-10) << "parameter " << i << " on rank " << comm.rank();
  }
  // Weights, two moments and gradients of this rank's shard, plus what the collectives may
  // still hold and the caching allocator's rounding (512-byte blocks).
  const double resident = got.resident_bytes - got.start_bytes;
  EXPECT_LE(resident, 4.0 * got.shard * 8 + 2.0 * kBucketBytes + (64 << 10)) << "rank " << comm.rank();
}

// The ZeRO-Offload layout of stage 3 on the device: the gradient shard copied to pinned host
// memory, the CPU optimizer's update, the new weights copied back on its copy stream (ordered
// before the next forward by end_step). The update runs in fp32 on the host: fp32's rounding.
// The device holds the weights' and gradients' shards, no moments.
TEST(ParameterUnitsGpu, OffloadedOptimizerTrainsAsOneCpuProcess) {
  DTRAIN_SKIP_WITHOUT_CUDA();
  auto& comm = world_comm();
  const std::vector<at::Tensor> want = reference(comm.size());
  OffloadOptions offload;
  const Zero3Run got = zero3(comm, c10::Device(c10::kCUDA, 0), &offload);
  ASSERT_EQ(got.weights.size(), want.size());
  for (size_t i = 0; i < want.size(); ++i) {
    EXPECT_LT(rel_error(got.weights[i], want[i]), 1e-5) << "parameter " << i << " on rank " << comm.rank();
  }
  EXPECT_GT(got.host_bytes, 0) << "rank " << comm.rank();
  const double resident = got.resident_bytes - got.start_bytes;
  EXPECT_LE(resident, 2.0 * got.shard * 8 + 2.0 * kBucketBytes + (64 << 10)) << "rank " << comm.rank();
}

// The failing rank's replay with CUDA tensors: the units materialized by the caching allocator,
// the skipped broadcasts' buffers left as allocated, the other ranks' staged through the host.
TEST(ParameterUnitsGpu, OutOfMemoryBackOffReplaysTheStepAndMatchesTheSmallerMicroBatches) {
  DTRAIN_SKIP_WITHOUT_CUDA();
  zero3_oom_cases::expect_back_off_matches_the_smaller_micro_batches(c10::Device(c10::kCUDA, 0));
}

// Regression (ZeRO-3's unit buffers were allocated on the calling thread's current device, GPU 0
// for a thread that set none): units of a model on a second GPU, gathered while the thread's
// current device is GPU 0, hold their bytes on their own GPU and the right values, and the
// thread's device is left as it was. Needs two GPUs; the unit test
// DeviceThreads.UnitStorageIsMaterializedOnTheTensorsDevice checks the same on the CPU.
TEST(ParameterUnitsGpu, UnitsOnAnotherGpuAreGatheredThereWhateverTheCurrentDevice) {
  DTRAIN_SKIP_WITHOUT_CUDA();
  const auto* cuda = c10::impl::getDeviceGuardImpl(c10::kCUDA);
  if (cuda->deviceCount() < 2) GTEST_SKIP() << "needs two GPUs (" << cuda->deviceCount() << " here)";
  const c10::Device second(c10::kCUDA, 1);
  auto comm = dist::create_communicator("local", dist::World{}, second);
  std::vector<at::Tensor> params, want;
  for (int64_t rows : {64, 32, 16}) {
    params.push_back(at::randn({rows, 8}, at::device(second)).requires_grad_(true));
    want.push_back(params.back().detach().cpu());
  }
  OptimizerOptions oo;
  oo.name = "adam";
  Zero3Optimizer optimizer(params, oo, *comm, {0, 1, 2});
  ParameterUnits units(optimizer);
  cuda->setDevice(c10::Device(c10::kCUDA, 0));
  units.gather_all();
  for (size_t j = 0; j < params.size(); ++j) {
    EXPECT_EQ(optimizer.params()[j].storage().data_ptr().device(), second) << "parameter " << j;
    EXPECT_TRUE(at::equal(optimizer.params()[j].detach().cpu(), want[j])) << "parameter " << j;
  }
  EXPECT_EQ(cuda->getDevice().index(), 0);
  units.release_all();
}

}  // namespace
}  // namespace dtrain::engine::zero3_cases
