// The pipeline schedules' orders in closed form: GPipe runs every forward, then every backward;
// 1F1B warms up with P - 1 - s forwards, alternates, then drains; in both every micro-batch's
// forward precedes its backward and each runs once; 1F1B's activations in flight on stage s
// are min(P - s, m), GPipe's m.
#include <gtest/gtest.h>

#include <iostream>

#include <algorithm>
#include <map>
#include <optional>
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
    out += (out.empty() ? "" : " ") + std::string(kind) + std::to_string(a.micro) +
           (a.chunk > 0 ? "." + std::to_string(a.chunk) : std::string());
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

// Zero bubble ordered at the stage's own costs (--pp_zb_costs): valid lists (each action once,
// no deadlock: simulate_pipeline checks), the same memory bound, never slower at those costs
// than the unit-ordered lists, and at a typical stage (B above F, W below: 1, 1.3, 0.7) clearly
// faster than 1F1B, where the unit-ordered lists are not.
TEST(PipelineSchedule, ZeroBubbleOrderedAtTheStagesCostsBeatsTheUnitOrder) {
  const std::vector<PipelineCosts> grid = {{1, 1.3, 0.7}, {1, 2, 0.5}, {1, 1.5, 1.5}, {2, 1, 1}, {1, 1, 1}};
  for (const PipelineCosts& c : grid) {
    for (int P = 2; P <= 6; ++P) {
      for (int m : {P, P + 1, 2 * P, 8, 13}) {
        const std::string what = std::to_string(P) + " stages, " + std::to_string(m) + " micro-batches, costs " +
                                 pipeline_costs_text(c);
        const SimulatedPipeline ordered = simulate_pipeline(PipelineSchedule::kZeroBubble, P, m, c, 1, &c);
        const SimulatedPipeline unit = simulate_pipeline(PipelineSchedule::kZeroBubble, P, m, c);
        const double work = m * (c.forward + c.backward_input + c.backward_weight);
        EXPECT_GE(ordered.step, work - 1e-9) << what;
        EXPECT_LE(ordered.step, unit.step * (1 + 1e-9) + 1e-9) << what;
        for (int s = 0; s < P; ++s) {
          EXPECT_LE(ordered.peak_in_flight[s], std::min(P, m)) << what << ", stage " << s;
          const std::vector<PipelineAction> list = pipeline_actions(PipelineSchedule::kZeroBubble, P, s, m, 1, c);
          EXPECT_EQ(static_cast<int>(list.size()), 3 * m) << what;
        }
      }
    }
  }
  const PipelineCosts typical{1, 1.3, 0.7};
  const SimulatedPipeline ordered = simulate_pipeline(PipelineSchedule::kZeroBubble, 4, 8, typical, 1, &typical);
  const SimulatedPipeline unit = simulate_pipeline(PipelineSchedule::kZeroBubble, 4, 8, typical);
  const SimulatedPipeline ofob = simulate_pipeline(PipelineSchedule::k1F1B, 4, 8, typical);
  std::cout << "[ zb       ] P 4, m 8, costs 1,1.3,0.7: 1f1b " << ofob.step << ", zb unit-ordered " << unit.step
            << ", zb ordered at the costs " << ordered.step << " (work " << 8 * 3.0 << ")\n";
  EXPECT_LT(ordered.step, 0.95 * ofob.step);
  EXPECT_EQ(pipeline_costs_text(parse_pipeline_costs("2,2.6,1.4")), "1,1.3,0.7");
  EXPECT_THROW(parse_pipeline_costs("1,2"), dtrain::Error);
  EXPECT_THROW(parse_pipeline_costs("1,0,1"), dtrain::Error);
  EXPECT_THROW(parse_pipeline_costs("1,x,1"), dtrain::Error);
}

// Interleaved 1F1B (Megatron's order), against the model of the pipeline with a chunk's forward
// 1 unit and its backward 2: every (micro-batch, chunk) once, forward first; the step is
// 3 m v + 3 (P - 1) units, the bubble share (P - 1) / (m v + P - 1) on every stage (1F1B's with
// m v micro-batches: v times smaller than 1F1B's over the same m); the warm-up
// 2 (P - 1 - s) + (v - 1) P forwards.
TEST(PipelineSchedule, InterleavedShrinksTheBubbleByTheChunks) {
  // 2 stages, 2 chunks, 4 micro-batches; stage 0 warms up with 2 (2 - 1) + 2 = 4 forwards: micro-
  // batches 0 and 1 through chunk 0, then through chunk 1 (".1").
  EXPECT_EQ(render(pipeline_actions(PipelineSchedule::kInterleaved, 2, 0, 4, 2)),
            "F0 F1 F0.1 F1.1 F2 B0.1 F3 B1.1 F2.1 B0 F3.1 B1 B2.1 B3.1 B2 B3");
  EXPECT_EQ(render(pipeline_actions(PipelineSchedule::kInterleaved, 2, 1, 4, 2)),
            "F0 F1 F0.1 B0.1 F1.1 B1.1 F2 B0 F3 B1 F2.1 B2.1 F3.1 B3.1 B2 B3");
  for (int P = 2; P <= 8; ++P) {
    for (int v = 2; v <= 4; ++v) {
      for (int m = P; m <= 4 * P; m += P) {
        const std::string what = std::to_string(P) + " stages, " + std::to_string(v) + " chunks, " +
                                 std::to_string(m) + " micro-batches";
        const SimulatedPipeline t = simulate_pipeline(PipelineSchedule::kInterleaved, P, m, {}, v);
        EXPECT_DOUBLE_EQ(t.step, 3.0 * m * v + 3.0 * (P - 1)) << what;
        for (int s = 0; s < P; ++s) {
          EXPECT_NEAR(t.idle_share[s], (P - 1.0) / (m * v + P - 1.0), 1e-12) << what << ", stage " << s;
          const auto list = pipeline_actions(PipelineSchedule::kInterleaved, P, s, m, v);
          int leading = 0;  // the warm-up and the steady phase's first forward
          while (list[leading].kind == PipelineAction::kForward) ++leading;
          const int warmup = m == P ? m * v : std::min(2 * (P - 1 - s) + (v - 1) * P, m * v);
          EXPECT_EQ(leading, std::min(warmup + 1, m * v)) << what << ", stage " << s;
        }
      }
    }
  }
  EXPECT_TRUE(testing_util::throws_error_with([] { pipeline_actions(PipelineSchedule::kInterleaved, 4, 0, 6, 2); },
                                              "the step has 6; use a multiple of 4 micro-batches"));
  EXPECT_TRUE(testing_util::throws_error_with([] { pipeline_actions(PipelineSchedule::kInterleaved, 2, 0, 4, 1); },
                                              "at least 2 stages and 2 model chunks per stage"));
  EXPECT_TRUE(testing_util::throws_error_with([] { pipeline_actions(PipelineSchedule::k1F1B, 2, 0, 4, 2); },
                                              "model chunks per stage are for the interleaved schedule"));
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
  EXPECT_EQ(parse_pipeline_schedule("interleaved"), PipelineSchedule::kInterleaved);
  EXPECT_TRUE(testing_util::throws_error_with([] { parse_pipeline_schedule("looped"); },
                                              "'looped' does not exist; use gpipe"));
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
  int chunk = 0;        // the virtual stage that receives the message
  bool forward = true;  // an activation (else a gradient)
};
using Groups = std::vector<std::vector<P2p>>;

// The groups run_pipeline_step issues on stage s: each action's receive together with the send
// the action before produced (then the last action's send alone); `grouped` false: every
// receive and send alone, in the order a stage needs them (receive, compute, send).
// With chunks, the peers are those of the virtual stages (chunk c of stage s is c P + s), and a
// message is named by the virtual stage that receives it, so a send must meet a receive of the
// same micro-batch, direction and virtual stage. `grouped`: the groups pipeline_exchange_plan
// gives (what run_pipeline_step issues); false: every receive and send alone, in the order a
// stage needs them (receive, compute, send).
Groups stage_exchanges(PipelineSchedule schedule, int stages, int s, int m, bool grouped, int chunks = 1) {
  Groups out;
  std::vector<P2p> pending;  // the sends since the last group
  const int V = stages * chunks;
  const std::vector<PipelineAction> list = pipeline_actions(schedule, stages, s, m, chunks);
  const PipelineExchangePlan plan = pipeline_exchange_plan(schedule, list, stages, s, chunks);
  auto message = [&](const PipelineAction& a, bool send) -> std::optional<P2p> {
    if (a.kind == PipelineAction::kBackwardWeight) return std::nullopt;
    const bool fwd = a.kind == PipelineAction::kForward;
    const int vs = a.chunk * stages + s;
    const int other = fwd == send ? vs + 1 : vs - 1;  // sends go on, receives come from before
    if (other < 0 || other >= V) return std::nullopt;
    return P2p{send, other % stages, a.micro, send ? other : vs, fwd};
  };
  for (size_t k = 0; k < list.size(); ++k) {
    if (!grouped) {
      if (!pending.empty()) out.push_back(pending);
      pending.clear();
      if (auto r = message(list[k], false)) out.push_back({*r});
    } else if (plan.issue[k]) {
      std::vector<P2p> group = pending;
      pending.clear();
      for (int j : plan.receives[k]) group.push_back(*message(list[j], false));
      if (!group.empty()) out.push_back(group);
    }
    if (auto snd = message(list[k], true)) pending.push_back(*snd);
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
      if (a.micro != b.micro || a.chunk != b.chunk || a.forward != b.forward) {
        *why = "send #" + std::to_string(k) + " from " + std::to_string(pair.first) + " carries micro-batch " +
               std::to_string(a.micro) + " (virtual stage " + std::to_string(a.chunk) + ", " +
               (a.forward ? "activation" : "gradient") + ") to a receive of " + std::to_string(b.micro) +
               " (virtual stage " + std::to_string(b.chunk) + ", " + (b.forward ? "activation" : "gradient") + ")";
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

// Interleaved: the ring wraps (the last rank sends chunk c's activation to the first rank's
// chunk c + 1), and messages between two ranks in both directions carry different virtual
// stages; each must meet its own receive, in order.
TEST(PipelineExchanges, InterleavedGroupsNeverDeadlockAndEachMessageMeetsItsReceive) {
  for (int stages = 2; stages <= 8; ++stages) {
    for (int v = 2; v <= 4; ++v) {
      for (int m = stages; m <= 3 * stages; m += stages) {
        std::vector<Groups> ranks;
        for (int s = 0; s < stages; ++s) {
          ranks.push_back(stage_exchanges(PipelineSchedule::kInterleaved, stages, s, m, true, v));
        }
        std::string why;
        EXPECT_TRUE(runs_to_completion(ranks, &why))
            << stages << " stages, " << v << " chunks, " << m << " micro-batches: " << why;
      }
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
