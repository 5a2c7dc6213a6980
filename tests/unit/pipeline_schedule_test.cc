// The pipeline schedules' orders in closed form: GPipe runs every forward, then every backward;
// 1F1B warms up with P - 1 - s forwards, alternates, then drains; in both every micro-batch's
// forward precedes its backward and each runs once; 1F1B's activations in flight on stage s
// are min(P - s, m), GPipe's m.
#include <gtest/gtest.h>

#include <algorithm>
#include <set>
#include <string>

#include "dtrain/dist/error.h"
#include "dtrain/engine/parallel/pipeline.h"

namespace dtrain::engine {
namespace {

std::string render(const std::vector<PipelineAction>& actions) {
  std::string out;
  for (const PipelineAction& a : actions) {
    out += (out.empty() ? "" : " ") + std::string(a.kind == PipelineAction::kForward ? "F" : "B") +
           std::to_string(a.micro);
  }
  return out;
}

int peak_in_flight(const std::vector<PipelineAction>& actions) {
  int held = 0, peak = 0;
  for (const PipelineAction& a : actions) {
    held += a.kind == PipelineAction::kForward ? 1 : -1;
    peak = std::max(peak, held);
  }
  return peak;
}

TEST(PipelineSchedule, OrdersInClosedForm) {
  EXPECT_EQ(render(pipeline_actions(PipelineSchedule::kGPipe, 4, 1, 3)), "F0 F1 F2 B0 B1 B2");
  // 4 stages, 6 micro-batches: stage 0 warms up with 3 forwards, the last with none.
  EXPECT_EQ(render(pipeline_actions(PipelineSchedule::k1F1B, 4, 0, 6)), "F0 F1 F2 F3 B0 F4 B1 F5 B2 B3 B4 B5");
  EXPECT_EQ(render(pipeline_actions(PipelineSchedule::k1F1B, 4, 2, 6)), "F0 F1 B0 F2 B1 F3 B2 F4 B3 F5 B4 B5");
  EXPECT_EQ(render(pipeline_actions(PipelineSchedule::k1F1B, 4, 3, 6)), "F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5");
  // Fewer micro-batches than stages: the warm-up is cut to m.
  EXPECT_EQ(render(pipeline_actions(PipelineSchedule::k1F1B, 4, 0, 2)), "F0 F1 B0 B1");
  EXPECT_EQ(render(pipeline_actions(PipelineSchedule::k1F1B, 1, 0, 3)), "F0 B0 F1 B1 F2 B2");
}

TEST(PipelineSchedule, EveryMicroBatchOnceForwardFirstAndTheActivationBound) {
  for (int stages : {1, 2, 3, 4, 8}) {
    for (int m : {1, 2, 3, 4, 7, 16}) {
      for (int s = 0; s < stages; ++s) {
        for (PipelineSchedule schedule : {PipelineSchedule::kGPipe, PipelineSchedule::k1F1B}) {
          const auto actions = pipeline_actions(schedule, stages, s, m);
          const std::string where = std::string(to_string(schedule)) + " stage " + std::to_string(s) + "/" +
                                    std::to_string(stages) + ", m " + std::to_string(m) + ": " + render(actions);
          ASSERT_EQ(actions.size(), 2u * m) << where;
          std::set<int> forwarded, backwarded;
          for (const PipelineAction& a : actions) {
            if (a.kind == PipelineAction::kForward) {
              EXPECT_TRUE(forwarded.insert(a.micro).second) << where;
            } else {
              EXPECT_TRUE(forwarded.count(a.micro)) << where;
              EXPECT_TRUE(backwarded.insert(a.micro).second) << where;
            }
          }
          const int bound = schedule == PipelineSchedule::kGPipe ? m : std::min(stages - s, m);
          EXPECT_EQ(peak_in_flight(actions), bound) << where;
        }
      }
    }
  }
}

TEST(PipelineSchedule, NamesAndBadInput) {
  EXPECT_EQ(parse_pipeline_schedule("gpipe"), PipelineSchedule::kGPipe);
  EXPECT_EQ(parse_pipeline_schedule("1f1b"), PipelineSchedule::k1F1B);
  try {
    parse_pipeline_schedule("interleaved");
    FAIL() << "accepted a schedule that does not exist";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("'interleaved' does not exist; use gpipe"), std::string::npos) << e.what();
  }
  EXPECT_THROW(pipeline_actions(PipelineSchedule::k1F1B, 2, 2, 4), Error);
  EXPECT_THROW(pipeline_actions(PipelineSchedule::k1F1B, 2, 0, 0), Error);
}

}  // namespace
}  // namespace dtrain::engine
