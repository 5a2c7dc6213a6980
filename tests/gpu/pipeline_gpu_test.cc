// Pipeline stages on a CUDA GPU (2 ranks over MPI sharing it; gpu.mpi.np2): the activations
// and their gradients travel between the stages as device tensors, and the stages train to the
// weights of the same pipeline on the CPU (float64), also when one stage runs out of memory and
// every rank backs off.
#include <gtest/gtest.h>

#include <chrono>

#include "device_work.h"
#include "dtrain/engine/parallel/pipeline.h"
#include "pipeline_cases.h"

namespace dtrain::engine::pipeline_cases {
namespace {

TEST(PipelineGpu, StagesOnTheDeviceTrainAsOnTheCpu) {
  DTRAIN_SKIP_WITHOUT_CUDA();
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

// Regression (on a GPU the timeline showed the host's launches, not the device's work): a
// stage's forward whose kernels run long after the host returned from it spans, on the timeline
// (on_span), the device's time for them; the spans of one step follow each other, and busy_s
// adds them up. Forward-only (evaluation) and a training step with its backward.
TEST(PipelineGpu, SpansOnTheDeviceLastAsLongAsTheDeviceWork) {
  DTRAIN_SKIP_WITHOUT_CUDA();
  using Clock = PipelineStep::Clock;
  const c10::Device gpu(c10::kCUDA, 0);
  constexpr int kMatmuls = 40;
  const double device_s = testing_util::matmuls_device_seconds(gpu, kMatmuls);
  testing_util::synchronize_device(gpu);
  const Clock::time_point queued = Clock::now();
  testing_util::queue_matmuls(gpu, kMatmuls);
  const double host_s = std::chrono::duration<double>(Clock::now() - queued).count();
  testing_util::synchronize_device(gpu);
  if (host_s > 0.3 * device_s) {
    GTEST_SKIP() << "the host took " << host_s << " s to queue work the device ran in " << device_s
                 << " s: it does not run ahead of the device here";
  }
  auto pp = dist::create_communicator("local", dist::World{}, gpu);
  const auto options = at::TensorOptions().dtype(at::kFloat).device(gpu);
  at::Tensor w = at::full({8}, 0.5f, options).requires_grad_(true);
  struct Span {
    std::string what;
    int micro;
    double start_s, end_s;  // from the step's start
  };
  for (bool train : {false, true}) {
    SCOPED_TRACE(train ? "training step" : "forward only");
    std::vector<Span> spans;
    PipelineStep step;
    step.micro_batches = 2;
    step.activation_options = options;
    step.input = [&](int) { return at::ones({8}, options); };
    step.forward = [&](const at::Tensor& x, int) {
      testing_util::queue_matmuls(gpu, kMatmuls);  // the device is busy long after this returns
      return (x * w).sum();
    };
    const Clock::time_point begin = Clock::now();
    step.on_span = [&](const std::string& what, int micro, int, Clock::time_point a, Clock::time_point b) {
      spans.push_back({what, micro, std::chrono::duration<double>(a - begin).count(),
                       std::chrono::duration<double>(b - begin).count()});
    };
    const PipelineStepResult r = train ? run_pipeline_step(*pp, step) : run_pipeline_forward(*pp, step);
    const double wall_s = std::chrono::duration<double>(Clock::now() - begin).count();
    std::vector<Span> forwards;
    for (const Span& s : spans) {
      if (s.what == "forward") forwards.push_back(s);
    }
    ASSERT_EQ(forwards.size(), 2u);
    for (const Span& f : forwards) {
      SCOPED_TRACE("micro-batch " + std::to_string(f.micro));
      EXPECT_GE(f.end_s - f.start_s, 0.7 * device_s) << "the forward's span is the host's " << host_s
                                                       << " s to queue it, not the device's " << device_s << " s";
      EXPECT_GE(f.start_s, -0.01);
      EXPECT_LE(f.end_s, wall_s + 0.01);
    }
    EXPECT_GE(forwards[1].start_s, forwards[0].end_s - 1e-3) << "the device ran the forwards one after the other";
    double busy = 0;
    for (const Span& s : spans) {
      EXPECT_LE(s.start_s, s.end_s + 1e-6) << s.what;
      if (s.what == "forward" || s.what == "backward") busy += s.end_s - s.start_s;
    }
    EXPECT_NEAR(r.busy_s, busy, 1e-3);
    if (train) {
      int backwards = 0;
      for (const Span& s : spans) backwards += s.what == "backward";
      EXPECT_EQ(backwards, 2);
      EXPECT_TRUE(w.grad().defined());
    }
  }
}

}  // namespace
}  // namespace dtrain::engine::pipeline_cases
