// Pipeline stages on a CUDA GPU (2 ranks over MPI sharing it; gpu.mpi.np2): the activations
// and their gradients travel between the stages as device tensors, and the stages train to the
// weights of the same pipeline on the CPU (float64), also when one stage runs out of memory and
// every rank backs off.
#include <gtest/gtest.h>

#include "pipeline_cases.h"

namespace dtrain::engine::pipeline_cases {
namespace {

TEST(PipelineGpu, StagesOnTheDeviceTrainAsOnTheCpu) {
  if (!testing_util::has_cuda()) GTEST_SKIP() << "no CUDA GPU";
  auto& comm = testing_util::world_comm();
  if (comm.size() < 2) GTEST_SKIP() << "a pipeline needs 2 ranks (gpu.mpi.np2 runs this)";
  const c10::Device gpu(c10::kCUDA, 0), cpu(c10::kCPU);
  const std::vector<at::Tensor> want = two_stage_run(cpu, 4, -1, nullptr);
  for (int fail_rank : {-1, comm.size() - 1}) {
    SCOPED_TRACE("out of memory on rank " + std::to_string(fail_rank));
    std::vector<int> seen;
    const std::vector<at::Tensor> got = two_stage_run(gpu, fail_rank < 0 ? 4 : 1, fail_rank, &seen);
    EXPECT_EQ(seen, (std::vector<int>{4, 4, 4}));
    ASSERT_EQ(got.size(), want.size());
    for (size_t i = 0; i < want.size(); ++i) EXPECT_LT(testing_util::rel_error(got[i], want[i]), 1e-10) << i;
  }
}

}  // namespace
}  // namespace dtrain::engine::pipeline_cases
