// ZeRO-1 (--shard=optimizer) and ZeRO-2 (--shard=gradients) with the model on a CUDA GPU (1 rank,
// and 2 ranks over MPI sharing it): the flat parameter buffer, the shards of the master state,
// the reducer's buckets and the all-gather of the updated shards live on the device. Each stage
// trains to the weights of one process on the global batch with the replicated optimizer on the
// CPU (float64, so the device and the host compute the same function to rounding), and the fp16
// overflow check agrees across ranks on the device as it does on the host.
#include <gtest/gtest.h>

#include "sharded_cases.h"

namespace dtrain::engine::sharded_cases {
namespace {

using testing_util::world_comm;

c10::Device gpu() { return c10::Device(c10::kCUDA, 0); }

TEST(ShardedGpu, StagesOneAndTwoOnTheDeviceTrainAsOneCpuProcess) {
  DTRAIN_SKIP_WITHOUT_CUDA();
  auto& comm = world_comm();
  dist::Mesh mesh(comm, 1);
  auto one = lone();
  dist::Mesh single(*one, 1);
  for (double clip : {0.0, 0.05}) {
    Config c;
    c.width = 256;
    c.clip = clip;
    c.accum = 2;
    c.optimizer = clip > 0 ? "sgd" : "adamw";
    const std::vector<at::Tensor> want = fit_on(single, 4 * comm.size(), c);
    c.device = gpu();
    for (const char* stage : {"none", "optimizer", "gradients"}) {
      c.shard = stage;
      expect_same(fit_on(mesh, 4, c), want, 1e-9,
                  std::string("cuda, --shard=") + stage + ", clip " + std::to_string(clip));
    }
  }
}

TEST(ShardedGpu, Fp16OverflowSkipsTheSameStepsOnTheDevice) {
  DTRAIN_SKIP_WITHOUT_CUDA();
  auto& comm = world_comm();
  dist::Mesh mesh(comm, 1);
  auto run = [&](const std::string& shard, std::vector<double>& scales) { return fit_fp16(mesh, shard, gpu(), scales); };
  std::vector<double> want_scales;
  const std::vector<at::Tensor> want = run("none", want_scales);
  ASSERT_EQ(want_scales.size(), 12u);
  ASSERT_LT(want_scales.front(), 1 << 19) << "the initial scale did not overflow: the test checks nothing";
  for (const char* stage : {"optimizer", "gradients"}) {
    std::vector<double> got_scales;
    expect_same(run(stage, got_scales), want, 1e-5, std::string("cuda, --shard=") + stage);
    EXPECT_EQ(got_scales, want_scales) << stage;
  }
}

}  // namespace
}  // namespace dtrain::engine::sharded_cases
