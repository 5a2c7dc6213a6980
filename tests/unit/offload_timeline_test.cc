// summarize_offload(): the host work after backward and the CPU updates' overlap with compute,
// on hand-made events whose answers are known, and on the timeline of a real offloaded run.
#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "dtrain/dist/mesh.h"
#include "dtrain/engine/observe/timeline.h"
#include "dtrain/engine/train/trainer.h"
#include "test_util.h"

namespace dtrain::engine {
namespace {

TraceEvent span(const std::string& name, int rank, double start_ms, double ms) {
  TraceEvent e;
  e.name = name;
  e.rank = rank;
  e.ts_us = start_ms * 1000;
  e.dur_us = ms * 1000;
  return e;
}

// Two steps of 100 ms: forward 30, backward 50 (ends at 80), then 20 ms of host work. The first
// step's CPU update (10 ms) runs after backward; the second's delayed one (15 ms) starts inside the
// next step's forward... here inside step 2's own forward and backward, 10 of its 15 ms.
TEST(OffloadTimeline, HostWorkAfterBackwardAndCpuUpdatesBesideCompute) {
  std::vector<TraceEvent> ev = {
      span("step", 0, 0, 100),   span("forward", 0, 0, 30),   span("backward", 0, 30, 50),
      span("cpu update", 0, 82, 10),
      span("step", 0, 100, 100), span("forward", 0, 100, 30), span("backward", 0, 130, 50),
      span("cpu update (delayed)", 0, 170, 15),
      span("step", 1, 0, 200),   span("backward", 1, 0, 150),  span("cpu update", 1, 150, 40)};
  const OffloadSummary s = summarize_offload(ev);
  ASSERT_EQ(s.ranks, 2);
  // Rank 0: after backward 20 + 20 over 2 steps; CPU 25 ms over 2 steps, 10 of them beside compute.
  // Rank 1: after backward 50 of a 200 ms step; CPU 40, none beside.
  EXPECT_DOUBLE_EQ(s.steps, 1.5);
  EXPECT_DOUBLE_EQ(s.step_ms, (100.0 + 200.0) / 2);
  EXPECT_DOUBLE_EQ(s.after_backward_ms, (20.0 + 50.0) / 2);
  EXPECT_DOUBLE_EQ(s.cpu_update_ms, (12.5 + 40.0) / 2);
  EXPECT_DOUBLE_EQ(s.cpu_update_beside_ms, (5.0 + 0.0) / 2);
  EXPECT_NE(s.to_string().find("host work after backward 35.0 ms/step"), std::string::npos) << s.to_string();
  EXPECT_EQ(summarize_offload({span("step", 0, 0, 10), span("backward", 0, 0, 5)}).to_string(), "");
}

// A real offloaded run's timeline: without the delayed update every CPU update lies after its
// step's backward, none beside compute; with it, the 6 updates after the 2 warm-up steps are
// "cpu update (delayed)" spans (how much of them lies beside the next forward depends on the
// machine's load: the benchmark's figure, not a test's).
TEST(OffloadTimeline, OrdinaryAndDelayedUpdatesInARealRun) {
  testing_util::ScratchDir dir("dtrain_offload_timeline", true);
  auto events_of = [&](int64_t delay_after, const std::string& name) {
    std::unique_ptr<dist::Communicator> comm = testing_util::local_comm();
    dist::Mesh mesh(*comm, 1);
    torch::manual_seed(0);
    torch::nn::Sequential model(torch::nn::Linear(64, 256), torch::nn::Tanh(), torch::nn::Linear(256, 1));
    auto g = at::make_generator<at::CPUGeneratorImpl>(1);
    LoaderOptions lo;
    lo.batch_size = 64;
    lo.workers = 0;
    DataLoader loader(std::make_shared<TensorDataset>(std::vector<at::Tensor>{at::randn({2048, 64}, g),
                                                                             at::randn({2048, 1}, g)}),
                      lo);
    TrainerOptions o;
    o.steps = 8;
    o.offload_optimizer = true;
    o.offload.delayed_update_after = delay_after;
    o.progress = false;
    o.handle_preemption = false;
    o.timeline_path = dir / name;
    Trainer trainer(*model, [&](const Batch& b) { return torch::mse_loss(model->forward(b.fields[0]), b.fields[1]); },
                    mesh, c10::Device(c10::kCPU), o);
    trainer.fit(loader);
    return read_timeline(dir / name);
  };
  const std::vector<TraceEvent> ordinary = events_of(-1, "ordinary.json"), delayed = events_of(2, "delayed.json");
  const OffloadSummary o = summarize_offload(ordinary);
  ASSERT_EQ(o.ranks, 1) << "no CPU update spans in the timeline";
  EXPECT_EQ(o.steps, 8);
  EXPECT_EQ(o.cpu_update_beside_ms, 0) << o.to_string();
  EXPECT_GT(o.after_backward_ms, 0) << o.to_string();
  std::vector<TraceEvent> steps, late;
  for (const TraceEvent& e : delayed) {
    if (e.name == "step") steps.push_back(e);
    if (e.name == "cpu update (delayed)") late.push_back(e);
  }
  ASSERT_EQ(steps.size(), 8u);
  // At most one per step after the 2 warm-up steps. The trainer records the newest finished
  // update's span once per step, so one that finishes before the step that started it records
  // can replace its predecessor's: 5 or 6 of the 6 show on this model.
  ASSERT_GE(late.size(), 1u) << "no delayed update on the timeline";
  ASSERT_LE(late.size(), 6u);
  EXPECT_GT(summarize_offload(delayed).cpu_update_ms, 0);
}

}  // namespace
}  // namespace dtrain::engine
