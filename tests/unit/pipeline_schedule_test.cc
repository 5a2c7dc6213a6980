// The pipeline schedules' orders in closed form: GPipe runs every forward, then every backward;
// 1F1B warms up with P - 1 - s forwards, alternates, then drains; in both every micro-batch's
// forward precedes its backward and each runs once; 1F1B's activations in flight on stage s
// are min(P - s, m), GPipe's m.
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <sstream>
#include <tuple>
#include <set>
#include <string>

#include "dtrain/dist/error.h"
#include "dtrain/engine/parallel/pipeline.h"
#include "test_util.h"

namespace dtrain::engine {
namespace {

std::string render(const std::vector<PipelineAction>& actions) {
  std::string out;
  for (const PipelineAction& a : actions) {
    const char* kind = a.kind == PipelineAction::kForward ? "F" : a.kind == PipelineAction::kBackwardWeight ? "W" : "B";
    out += (out.empty() ? "" : " ") + std::string(kind) + std::to_string(a.micro);
  }
  return out;
}

int peak_in_flight(const std::vector<PipelineAction>& actions) {
  int held = 0, peak = 0;
  for (const PipelineAction& a : actions) {
    // Held from the forward until the whole backward, or (zb) until its weight half.
    held += a.kind == PipelineAction::kForward ? 1 : a.kind == PipelineAction::kBackwardInput ? 0 : -1;
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

// Zero bubble (ZB-H1's memory bound), against the model of the pipeline at unit costs: every
// list valid, no stage holds more than min(P, m) micro-batches (1F1B's first stage's bound),
// and the step is the ideal 3m + (P - 1) units plus at most max(P - m, 4) (with fewer
// micro-batches than stages the bound of m in flight leaves P - m), where 1F1B's is 3m + 3 (P - 1)
// (its bubble share (P - 1) / (m + P - 1) on every stage: the closed form the model must meet).
TEST(PipelineSchedule, ZeroBubbleHoldsOneFOneBsPeakAndAlmostNoBubble) {
  // By hand at unit costs: stage 1 runs F0 at t = 1 and B0 at 2, so stage 0, holding its bound
  // of two after F0 F1, waits at t = 2 and runs B0 at 3; with nothing ready at 4 it runs W0 ...
  EXPECT_EQ(render(pipeline_actions(PipelineSchedule::kZeroBubble, 2, 0, 3)), "F0 F1 B0 W0 B1 F2 W1 B2 W2");
  EXPECT_EQ(render(pipeline_actions(PipelineSchedule::kZeroBubble, 2, 1, 3)), "F0 B0 F1 B1 W0 W1 F2 B2 W2");
  for (int P = 1; P <= 8; ++P) {
    for (int m = 1; m <= 32; ++m) {
      const std::string what = std::to_string(P) + " stages, " + std::to_string(m) + " micro-batches";
      const SimulatedPipeline zb = simulate_pipeline(PipelineSchedule::kZeroBubble, P, m);
      const SimulatedPipeline ofob = simulate_pipeline(PipelineSchedule::k1F1B, P, m);
      EXPECT_DOUBLE_EQ(ofob.step, 3.0 * m + 3.0 * (P - 1)) << what;
      for (int s = 0; s < P; ++s) {
        EXPECT_NEAR(ofob.idle_share[s], (P - 1.0) / (m + P - 1.0), 1e-12) << what << ", stage " << s;
        EXPECT_LE(zb.peak_in_flight[s], std::min(P, m)) << what << ", stage " << s;
        EXPECT_EQ(zb.peak_in_flight[s], peak_in_flight(pipeline_actions(PipelineSchedule::kZeroBubble, P, s, m)));
        EXPECT_DOUBLE_EQ(zb.busy[s], 3.0 * m) << what << ", stage " << s;
      }
      EXPECT_GE(zb.step, 3.0 * m + (P - 1)) << what;  // no schedule beats the ideal
      EXPECT_LE(zb.step, 3.0 * m + (P - 1) + std::max(P - m, 4)) << what;
      if (P > 1) EXPECT_LT(zb.step, ofob.step) << what;
    }
  }
}

// The model refuses lists that deadlock (stage 1 waits for a forward that stage 0 runs only
// after a backward that waits for stage 1), and lists that miss or misorder a half.
TEST(PipelineSchedule, TheModelRefusesDeadlocksAndBadLists) {
  using A = PipelineAction;
  const std::vector<std::vector<A>> deadlock = {
      {{A::kForward, 0}, {A::kBackward, 0}, {A::kForward, 1}, {A::kBackward, 1}},
      {{A::kForward, 0}, {A::kForward, 1}, {A::kBackward, 0}, {A::kBackward, 1}}};
  EXPECT_TRUE(testing_util::throws_error_with([&] { simulate_pipeline(deadlock, 2); },
                                              "deadlock (stage 0 at its backward of micro-batch 0; stage 1 at its "
                                              "forward of micro-batch 1)"));
  EXPECT_TRUE(testing_util::throws_error_with(
      [] { simulate_pipeline({{{A::kForward, 0}, {A::kBackwardInput, 0}}}, 1); },
      "does not run the whole forward and backward of micro-batch 0"));
  EXPECT_TRUE(testing_util::throws_error_with(
      [] { simulate_pipeline({{{A::kForward, 0}, {A::kBackwardWeight, 0}, {A::kBackwardInput, 0}}}, 1); },
      "backward weight of micro-batch 0 comes before its backward input"));
  // At costs other than units the model still times the lists: 1F1B with a backward twice a
  // forward on 2 stages and 2 micro-batches is F F . B B on the first stage.
  const SimulatedPipeline t = simulate_pipeline(PipelineSchedule::k1F1B, 2, 2, {1, 1, 1});
  EXPECT_DOUBLE_EQ(t.step, 3 * 2 + 3 * 1);
}

TEST(PipelineSchedule, NamesAndBadInput) {
  EXPECT_EQ(parse_pipeline_schedule("gpipe"), PipelineSchedule::kGPipe);
  EXPECT_EQ(parse_pipeline_schedule("1f1b"), PipelineSchedule::k1F1B);
  EXPECT_EQ(parse_pipeline_schedule("zb"), PipelineSchedule::kZeroBubble);
  EXPECT_TRUE(testing_util::throws_error_with([] { parse_pipeline_schedule("interleaved"); },
                                              "'interleaved' does not exist; use gpipe"));
  EXPECT_THROW(pipeline_actions(PipelineSchedule::k1F1B, 2, 2, 4), Error);
  EXPECT_THROW(pipeline_actions(PipelineSchedule::k1F1B, 2, 0, 0), Error);
}

// ---- a stream-ordered, rendezvous transport (NCCL's p2p semantics) ---------------------------
// Each rank issues groups of sends and receives in order; a rank's groups run one at a time, a
// group's operations together (ncclGroupStart/End), and a send completes only with its
// matching receive running on the peer (a message above NCCL's buffer size). The k-th send from
// a to b meets the k-th receive of b from a.
struct P2p {
  bool send;
  int peer;
  int micro;
};
using Groups = std::vector<std::vector<P2p>>;

// The groups run_pipeline_step issues on stage s: each action's receive together with the send
// the action before produced (then the last action's send alone); `grouped` false: every
// receive and send alone, in the order a stage needs them (receive, compute, send).
Groups stage_exchanges(PipelineSchedule schedule, int stages, int s, int m, bool grouped) {
  Groups out;
  std::vector<P2p> pending;  // the previous action's send
  for (const PipelineAction& a : pipeline_actions(schedule, stages, s, m)) {
    if (a.kind == PipelineAction::kBackwardWeight) {  // no message: the pending send goes out alone
      if (!pending.empty()) out.push_back(pending);
      pending.clear();
      continue;
    }
    const bool fwd = a.kind == PipelineAction::kForward;
    const int from = fwd ? s - 1 : s + 1, to = fwd ? s + 1 : s - 1;
    std::vector<P2p> group = grouped ? pending : std::vector<P2p>{};
    if (!grouped && !pending.empty()) out.push_back(pending);
    pending.clear();
    if (from >= 0 && from < stages) group.push_back({false, from, a.micro});
    if (!group.empty()) out.push_back(group);
    if (to >= 0 && to < stages) pending.push_back({true, to, a.micro});
  }
  if (!pending.empty()) out.push_back(pending);
  return out;
}

// Runs every stage's groups under the transport above; false on a deadlock (no operation can
// complete) or when matched messages carry different micro-batches (`why` says which).
bool runs_to_completion(const std::vector<Groups>& ranks, std::string* why) {
  const int n = static_cast<int>(ranks.size());
  struct Id {
    int rank, group, pos;
  };
  // Pair each send with its receive: the k-th send from a to b with the k-th receive of b from a.
  std::map<std::pair<int, int>, std::vector<Id>> sends, recvs;  // by (from, to)
  for (int r = 0; r < n; ++r) {
    for (int g = 0; g < static_cast<int>(ranks[r].size()); ++g) {
      for (int i = 0; i < static_cast<int>(ranks[r][g].size()); ++i) {
        const P2p& op = ranks[r][g][i];
        (op.send ? sends[{r, op.peer}] : recvs[{op.peer, r}]).push_back({r, g, i});
      }
    }
  }
  std::map<std::tuple<int, int, int>, Id> partner;
  for (const auto& [pair, list] : sends) {
    const std::vector<Id>& other = recvs[pair];
    if (other.size() != list.size()) {
      *why = std::to_string(list.size()) + " sends from " + std::to_string(pair.first) + " to " +
             std::to_string(pair.second) + " but " + std::to_string(other.size()) + " receives";
      return false;
    }
    for (size_t k = 0; k < list.size(); ++k) {
      const P2p& a = ranks[list[k].rank][list[k].group][list[k].pos];
      const P2p& b = ranks[other[k].rank][other[k].group][other[k].pos];
      if (a.micro != b.micro) {
        *why = "send #" + std::to_string(k) + " from " + std::to_string(pair.first) + " carries micro-batch " +
               std::to_string(a.micro) + " to a receive of " + std::to_string(b.micro);
        return false;
      }
      partner[{list[k].rank, list[k].group, list[k].pos}] = other[k];
      partner[{other[k].rank, other[k].group, other[k].pos}] = list[k];
    }
  }
  std::vector<int> head(n, 0);
  std::set<std::tuple<int, int, int>> done;
  for (;;) {
    bool finished = true, progress = false;
    for (int r = 0; r < n; ++r) {
      if (head[r] == static_cast<int>(ranks[r].size())) continue;
      finished = false;
      for (int i = 0; i < static_cast<int>(ranks[r][head[r]].size()); ++i) {
        const std::tuple<int, int, int> me{r, head[r], i};
        if (done.count(me)) continue;
        const Id p = partner.at(me);
        if (head[p.rank] == p.group) {  // both sides are running: the message moves
          done.insert(me);
          done.insert({p.rank, p.group, p.pos});
          progress = true;
        }
      }
    }
    for (int r = 0; r < n; ++r) {  // groups whose operations all completed retire
      while (head[r] < static_cast<int>(ranks[r].size())) {
        bool all = true;
        for (int i = 0; i < static_cast<int>(ranks[r][head[r]].size()); ++i) all = all && done.count({r, head[r], i});
        if (!all) break;
        ++head[r];
        progress = true;
      }
    }
    if (finished) return true;
    if (!progress) {
      std::ostringstream os;
      os << "deadlock:";
      for (int r = 0; r < n; ++r) os << " rank " << r << " at group " << head[r] << "/" << ranks[r].size() << ";";
      *why = os.str();
      return false;
    }
  }
}

TEST(PipelineExchanges, GroupedSendsAndReceivesNeverDeadlockOnAStreamOrderedTransport) {
  for (PipelineSchedule schedule : {PipelineSchedule::kGPipe, PipelineSchedule::k1F1B, PipelineSchedule::kZeroBubble}) {
    for (int stages = 2; stages <= 8; ++stages) {
      for (int m = 1; m <= 12; ++m) {
        std::vector<Groups> ranks;
        for (int s = 0; s < stages; ++s) ranks.push_back(stage_exchanges(schedule, stages, s, m, true));
        std::string why;
        EXPECT_TRUE(runs_to_completion(ranks, &why))
            << to_string(schedule) << ", " << stages << " stages, " << m << " micro-batches: " << why;
      }
    }
  }
}

// The check can fail: one send or receive at a time deadlocks 1F1B on such a transport (stage
// 0's second activation waits for stage 1's receive, queued behind stage 1's send of the first
// gradient, which waits for stage 0's receive, queued behind that activation).
TEST(PipelineExchanges, OneOperationAtATimeDeadlocks1F1B) {
  std::vector<Groups> ranks;
  for (int s = 0; s < 2; ++s) ranks.push_back(stage_exchanges(PipelineSchedule::k1F1B, 2, s, 4, false));
  std::string why;
  EXPECT_FALSE(runs_to_completion(ranks, &why));
  EXPECT_NE(why.find("deadlock"), std::string::npos) << why;
}

// The even rule against a brute-force statement of it: sizes differ by at most one, the first
// stage never has more than the others, and the extra blocks sit on stages 1, 2, ... in order.
TEST(PipelineStageBounds, EvenRuleGivesTheRemainderToTheStagesAfterTheFirst) {
  for (int stages = 1; stages <= 8; ++stages) {
    for (int blocks = stages; blocks <= 3 * stages + 2; ++blocks) {
      const std::vector<int> b = pipeline_stage_bounds(blocks, stages);
      const std::string where = std::to_string(blocks) + " blocks, " + std::to_string(stages) + " stages";
      ASSERT_EQ(static_cast<int>(b.size()), stages + 1) << where;
      EXPECT_EQ(b.front(), 0) << where;
      EXPECT_EQ(b.back(), blocks) << where;
      const int base = blocks / stages, extra = blocks % stages;
      for (int s = 0; s < stages; ++s) {
        const int size = b[s + 1] - b[s];
        EXPECT_EQ(size, base + (s >= 1 && s <= extra ? 1 : 0)) << where << ", stage " << s;
      }
    }
  }
  EXPECT_EQ(pipeline_stage_bounds(4, 3), (std::vector<int>{0, 1, 3, 4}));
  EXPECT_EQ(pipeline_stage_bounds(7, 4), (std::vector<int>{0, 1, 3, 5, 7}));
}

TEST(PipelineStageBounds, ExplicitCountsAndBadInput) {
  EXPECT_EQ(pipeline_stage_bounds(12, 4, "2,4,4,2"), (std::vector<int>{0, 2, 6, 10, 12}));
  EXPECT_EQ(pipeline_stage_bounds(3, 1, "3"), (std::vector<int>{0, 3}));
  auto message = [](int blocks, int stages, const std::string& counts) {
    try {
      pipeline_stage_bounds(blocks, stages, counts);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("(accepted)");
  };
  EXPECT_NE(message(2, 4, "").find("--pp=4 stages but the model has only 2 block(s)"), std::string::npos)
      << message(2, 4, "");
  EXPECT_NE(message(12, 4, "2,4,4").find("gives 3 stages 10 blocks, but there are 4 stages"), std::string::npos)
      << message(12, 4, "2,4,4");
  EXPECT_NE(message(12, 4, "2,4,4,3").find("gives 4 stages 13 blocks"), std::string::npos);
  EXPECT_NE(message(12, 4, "2,x,4,2").find("'x' is not a number of blocks >= 1"), std::string::npos);
  EXPECT_NE(message(12, 4, "6,0,4,2").find("'0' is not a number of blocks >= 1"), std::string::npos);
  EXPECT_NE(message(12, 4, "6,,4,2").find("'' is not a number"), std::string::npos);
  EXPECT_NE(message(12, 4, "4,4,2.5,1.5").find("'2.5' is not a number"), std::string::npos);
}

}  // namespace
}  // namespace dtrain::engine
