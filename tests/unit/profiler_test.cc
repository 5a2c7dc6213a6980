// The step profiler: which steps it covers (the step ranges and operators in the written trace,
// parsed back), the autograd thread's operators included, the --profile_steps syntax and a bad
// output path.
#include "dtrain/engine/observe/profiler.h"

#include <gtest/gtest.h>

#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <string>

#include <torch/torch.h>

#include "dtrain/dist/communicator.h"
#include "dtrain/dist/error.h"
#include "dtrain/dist/mesh.h"
#include "dtrain/engine/data/data.h"
#include "dtrain/engine/train/trainer.h"
#include "test_util.h"

namespace dtrain::engine::profiler_cases {
namespace {

using nlohmann::json;

TEST(StepProfiler, ParsesOneStepOrARange) {
  EXPECT_FALSE(parse_profile_steps("").enabled());
  ProfileSteps one = parse_profile_steps("7");
  EXPECT_EQ(one.first, 7);
  EXPECT_EQ(one.last, 7);
  ProfileSteps range = parse_profile_steps("3-5");
  EXPECT_EQ(range.first, 3);
  EXPECT_EQ(range.last, 5);
  for (const char* bad : {"0", "5-2", "x", "3-", "-1", "2-4x", "1-0"}) {
    SCOPED_TRACE(bad);
    EXPECT_NE(testing_util::error_of([&] { parse_profile_steps(bad); }).find("is not a step or a range of steps"),
              std::string::npos);
  }
}

// Steps 2-3 of a 4-step fit(): the trace has their ranges, the forward's and the backward's
// operators, and nothing of steps 1 and 4.
TEST(StepProfiler, TraceHoldsTheChosenStepsWithForwardAndBackwardOperators) {
  testing_util::ScratchDir dir("profiler", /*create=*/true);
  auto comm = dist::create_communicator("local", dist::World{}, c10::Device(c10::kCPU));
  dist::Mesh mesh(*comm, 1);
  torch::manual_seed(3);
  torch::nn::Linear model(16, 4);
  TrainerOptions o;
  o.steps = 4;
  o.log_every = 1;
  o.progress = false;
  o.handle_preemption = false;
  o.profile_steps = "2-3";
  o.profile_path = dir / "sub/profile.json";  // the directory is created
  Trainer trainer(*model, [&](const Batch& b) { return torch::mse_loss(model->forward(b.fields[0]), b.fields[1]); },
                  mesh, c10::Device(c10::kCPU), o);
  auto data = std::make_shared<TensorDataset>(std::vector<at::Tensor>{at::randn({64, 16}), at::randn({64, 4})});
  LoaderOptions lo;
  lo.batch_size = 8;
  lo.workers = 0;
  DataLoader loader(data, lo);
  trainer.fit(loader);

  std::ifstream in(dir / "sub/profile.json");
  ASSERT_TRUE(in.good()) << "no trace written";
  const json trace = json::parse(in);
  std::set<std::string> names;
  for (const json& e : trace.at("traceEvents")) {
    if (!e.contains("name") || !e["name"].is_string()) continue;
    const std::string name = e["name"];
    names.insert(name);
  }
  EXPECT_TRUE(names.count("dtrain step 2")) << "no range of step 2";
  EXPECT_TRUE(names.count("dtrain step 3")) << "no range of step 3";
  EXPECT_FALSE(names.count("dtrain step 1")) << "step 1 was profiled";
  EXPECT_FALSE(names.count("dtrain step 4")) << "step 4 was profiled";
  EXPECT_TRUE(names.count("aten::addmm")) << "no forward operator (Linear's addmm)";
  bool backward = false;
  for (const std::string& n : names) backward = backward || n.find("Backward") != std::string::npos;
  EXPECT_TRUE(backward) << "no autograd backward node in the trace";
}

TEST(StepProfiler, AnOutputPathUnderAFileIsAnErrorAtStartUp) {
  testing_util::ScratchDir dir("profiler-bad", /*create=*/true);
  { std::ofstream(dir / "file") << "x"; }
  const std::string message = testing_util::error_of(
      [&] { StepProfiler p(parse_profile_steps("1"), dir / "file/profile.json", c10::Device(c10::kCPU)); });
  EXPECT_NE(message.find("cannot create the directory"), std::string::npos) << message;
}

}  // namespace
}  // namespace dtrain::engine::profiler_cases
