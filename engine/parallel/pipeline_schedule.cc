// Pipeline schedules: each stage's order of forwards and backwards (pipeline.h), and a model of
// the pipeline that runs every stage's order against the others (simulate_pipeline).
#include <algorithm>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

#include "dtrain/dist/error.h"
#include "dtrain/engine/parallel/pipeline.h"

namespace dtrain::engine {

PipelineSchedule parse_pipeline_schedule(const std::string& name) {
  if (name == "gpipe") return PipelineSchedule::kGPipe;
  if (name == "1f1b") return PipelineSchedule::k1F1B;
  if (name == "zb") return PipelineSchedule::kZeroBubble;
  throw Error("pipeline schedule '" + name + "' does not exist; use gpipe (all forwards, then all backwards), " +
              "1f1b (one forward, one backward after a warm-up) or zb (zero bubble: the weight-gradient half of " +
              "each backward deferred into the bubble)");
}

const char* to_string(PipelineSchedule schedule) {
  switch (schedule) {
    case PipelineSchedule::kGPipe: return "gpipe";
    case PipelineSchedule::k1F1B: return "1f1b";
    case PipelineSchedule::kZeroBubble: return "zb";
  }
  return "?";
}

namespace {

using Kind = PipelineAction::Kind;

// The zero-bubble lists of every stage: a list schedule of the whole pipeline at unit costs
// (pipeline.h). Every stage takes its forwards, B's and W's in micro-batch order.
std::vector<std::vector<PipelineAction>> zero_bubble_lists(int P, int m) {
  const int cap = std::min(P, m);
  constexpr long kNever = std::numeric_limits<long>::max();
  std::vector<std::vector<long>> f(P, std::vector<long>(m, kNever)), b = f;  // end times
  std::vector<int> nf(P, 0), nb(P, 0), nw(P, 0);
  std::vector<std::vector<PipelineAction>> lists(P);
  int left = P;  // stages with W's still to run
  for (long t = 0; left > 0; ++t) {
    DTRAIN_CHECK(t <= 4L * (m + P) * (P + 1), "zero-bubble schedule: no progress (", P, " stages, ", m,
                 " micro-batches); a bug in dtrain");
    for (int s = 0; s < P; ++s) {  // each stage free at t (every action takes one unit)
      if (nw[s] == m) continue;
      const bool b_ready = nb[s] < nf[s] && (s == P - 1 ? f[s][nb[s]] <= t : b[s + 1][nb[s]] <= t);
      const bool f_ready = nf[s] < m && nf[s] - nw[s] < cap && (s == 0 || f[s - 1][nf[s]] <= t);
      if (b_ready) {
        b[s][nb[s]] = t + 1;
        lists[s].push_back({Kind::kBackwardInput, nb[s]++});
      } else if (f_ready) {
        f[s][nf[s]] = t + 1;
        lists[s].push_back({Kind::kForward, nf[s]++});
      } else if (nw[s] < nb[s]) {
        lists[s].push_back({Kind::kBackwardWeight, nw[s]++});
        if (nw[s] == m) --left;
      }
    }
  }
  return lists;
}

}  // namespace

std::vector<PipelineAction> pipeline_actions(PipelineSchedule schedule, int stages, int stage, int micro_batches) {
  DTRAIN_CHECK(stages >= 1 && stage >= 0 && stage < stages && micro_batches >= 1, "pipeline_actions: stage ", stage,
               " of ", stages, " with ", micro_batches, " micro-batches is not a pipeline step");
  std::vector<PipelineAction> actions;
  const int m = micro_batches;
  if (schedule == PipelineSchedule::kZeroBubble) return zero_bubble_lists(stages, m)[stage];
  if (schedule == PipelineSchedule::kGPipe) {
    for (int i = 0; i < m; ++i) actions.push_back({Kind::kForward, i});
    for (int i = 0; i < m; ++i) actions.push_back({Kind::kBackward, i});
    return actions;
  }
  const int warmup = std::min(stages - 1 - stage, m);
  int next_forward = 0, next_backward = 0;
  for (; next_forward < warmup; ++next_forward) actions.push_back({Kind::kForward, next_forward});
  while (next_forward < m) {  // steady state: one forward, one backward
    actions.push_back({Kind::kForward, next_forward++});
    actions.push_back({Kind::kBackward, next_backward++});
  }
  while (next_backward < m) actions.push_back({Kind::kBackward, next_backward++});
  return actions;
}

namespace {

const char* kind_name(Kind k) {
  switch (k) {
    case Kind::kForward: return "forward";
    case Kind::kBackward: return "backward";
    case Kind::kBackwardInput: return "backward input";
    case Kind::kBackwardWeight: return "backward weight";
  }
  return "?";
}

// Each micro-batch's forward once, then either one whole backward or B then W, on one stage.
void check_list(const std::vector<PipelineAction>& list, int stage, int m) {
  std::vector<int> seen_f(m, 0), seen_b(m, 0), seen_whole(m, 0), seen_w(m, 0);
  for (const PipelineAction& a : list) {
    DTRAIN_CHECK(a.micro >= 0 && a.micro < m, "pipeline schedule: stage ", stage, " has a ", kind_name(a.kind),
                 " of micro-batch ", a.micro, " of ", m);
    const int i = a.micro;
    switch (a.kind) {
      case Kind::kForward:
        DTRAIN_CHECK(!seen_f[i]++, "pipeline schedule: stage ", stage, " runs the forward of micro-batch ", i, " twice");
        break;
      case Kind::kBackward:
      case Kind::kBackwardInput:
        DTRAIN_CHECK(seen_f[i] && !seen_b[i] && !seen_whole[i], "pipeline schedule: stage ", stage, "'s ",
                     kind_name(a.kind), " of micro-batch ", i, " comes before its forward or after another backward");
        ++(a.kind == Kind::kBackward ? seen_whole[i] : seen_b[i]);
        break;
      case Kind::kBackwardWeight:
        DTRAIN_CHECK(seen_b[i] && !seen_w[i]++, "pipeline schedule: stage ", stage, "'s backward weight of "
                     "micro-batch ", i, " comes before its backward input or twice");
        break;
    }
  }
  for (int i = 0; i < m; ++i) {
    DTRAIN_CHECK(seen_f[i] && (seen_whole[i] || (seen_b[i] && seen_w[i])), "pipeline schedule: stage ", stage,
                 " does not run the whole forward and backward of micro-batch ", i);
  }
}

}  // namespace

SimulatedPipeline simulate_pipeline(const std::vector<std::vector<PipelineAction>>& stages, int micro_batches,
                                    const PipelineCosts& costs) {
  const int P = static_cast<int>(stages.size());
  const int m = micro_batches;
  DTRAIN_CHECK(P >= 1 && m >= 1, "simulate_pipeline: ", P, " stages and ", m, " micro-batches");
  for (int s = 0; s < P; ++s) check_list(stages[s], s, m);
  constexpr double kNever = -1;
  std::vector<std::vector<double>> f(P, std::vector<double>(m, kNever)), b = f;
  std::vector<size_t> next(P, 0);
  std::vector<double> free_at(P, 0);
  std::vector<int> in_flight(P, 0);
  SimulatedPipeline out;
  out.busy.assign(P, 0);
  out.peak_in_flight.assign(P, 0);
  for (bool progress = true; progress;) {
    progress = false;
    for (int s = 0; s < P; ++s) {
      for (; next[s] < stages[s].size(); ++next[s]) {
        const PipelineAction& a = stages[s][next[s]];
        const int i = a.micro;
        double ready = 0, cost = costs.forward;
        switch (a.kind) {
          case Kind::kForward: ready = s == 0 ? 0 : f[s - 1][i]; break;
          case Kind::kBackward:
          case Kind::kBackwardInput:
            ready = s == P - 1 ? f[s][i] : b[s + 1][i];
            cost = a.kind == Kind::kBackward ? costs.backward_input + costs.backward_weight : costs.backward_input;
            break;
          case Kind::kBackwardWeight: ready = b[s][i]; cost = costs.backward_weight; break;
        }
        if (ready == kNever) break;  // waits for another stage
        const double end = std::max(free_at[s], ready) + cost;
        free_at[s] = end;
        out.busy[s] += cost;
        if (a.kind == Kind::kForward) {
          f[s][i] = end;
          out.peak_in_flight[s] = std::max(out.peak_in_flight[s], ++in_flight[s]);
        } else if (a.kind == Kind::kBackwardWeight) {
          --in_flight[s];
        } else {
          b[s][i] = end;
          if (a.kind == Kind::kBackward) --in_flight[s];
        }
        progress = true;
      }
    }
  }
  std::ostringstream stuck;
  for (int s = 0; s < P; ++s) {
    if (next[s] < stages[s].size()) {
      const PipelineAction& a = stages[s][next[s]];
      stuck << (stuck.tellp() > 0 ? "; " : "") << "stage " << s << " at its " << kind_name(a.kind)
            << " of micro-batch " << a.micro;
    }
  }
  DTRAIN_CHECK(stuck.tellp() == 0, "pipeline schedule: the stages' lists deadlock (", stuck.str(), ")");
  out.step = *std::max_element(free_at.begin(), free_at.end());
  for (int s = 0; s < P; ++s) out.idle_share.push_back(out.step > 0 ? 1 - out.busy[s] / out.step : 0);
  return out;
}

SimulatedPipeline simulate_pipeline(PipelineSchedule schedule, int stages, int micro_batches,
                                    const PipelineCosts& costs) {
  std::vector<std::vector<PipelineAction>> lists;
  for (int s = 0; s < stages; ++s) lists.push_back(pipeline_actions(schedule, stages, s, micro_batches));
  return simulate_pipeline(lists, micro_batches, costs);
}

}  // namespace dtrain::engine
