// Pipeline schedules: each stage's order of forwards and backwards (pipeline.h), and a model of
// the pipeline that runs every stage's order against the others (simulate_pipeline).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
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
  if (name == "interleaved") return PipelineSchedule::kInterleaved;
  throw Error("pipeline schedule '" + name + "' does not exist; use gpipe (all forwards, then all backwards), " +
              "1f1b (one forward, one backward after a warm-up), zb (zero bubble: the weight-gradient half of " +
              "each backward deferred into the bubble) or interleaved (--pp_chunks model chunks per stage)");
}

const char* to_string(PipelineSchedule schedule) {
  switch (schedule) {
    case PipelineSchedule::kGPipe: return "gpipe";
    case PipelineSchedule::k1F1B: return "1f1b";
    case PipelineSchedule::kZeroBubble: return "zb";
    case PipelineSchedule::kInterleaved: return "interleaved";
  }
  return "?";
}

PipelineCosts parse_pipeline_costs(const std::string& text) {
  std::vector<double> v;
  std::stringstream ss(text);
  std::string item;
  while (std::getline(ss, item, ',')) {
    char* end = nullptr;
    const double x = std::strtod(item.c_str(), &end);
    DTRAIN_CHECK(!item.empty() && *end == '\0' && std::isfinite(x) && x > 0, "--pp_zb_costs=", text, ": \"", item,
                 "\" is not a positive number; give F,B,W, e.g. 1,1.3,0.7");
    v.push_back(x);
  }
  DTRAIN_CHECK(v.size() == 3, "--pp_zb_costs=", text, " needs three costs F,B,W (forward, input gradient, weight "
               "gradient), e.g. 1,1.3,0.7");
  return PipelineCosts{v[0], v[1], v[2]};
}

std::string pipeline_costs_text(const PipelineCosts& c) {
  char buf[96];
  std::snprintf(buf, sizeof buf, "1,%.3g,%.3g", c.backward_input / c.forward, c.backward_weight / c.forward);
  return buf;
}

namespace {

using Kind = PipelineAction::Kind;

// The zero-bubble lists of every stage: a list schedule of the whole pipeline at the given costs
// of F, B and W (pipeline.h). Every stage takes its forwards, B's and W's in micro-batch order.
// An event simulation: the stages free at the earliest time decide in stage order, each on what
// has finished by then; a stage with nothing ready waits for the next action to finish. At unit
// costs every event falls on an integer and the lists are those of a unit-step simulation.
std::vector<std::vector<PipelineAction>> list_schedule(int P, int m, const PipelineCosts& costs) {
  DTRAIN_CHECK(std::isfinite(costs.forward) && std::isfinite(costs.backward_input) &&
                   std::isfinite(costs.backward_weight) && costs.forward > 0 && costs.backward_input > 0 &&
                   costs.backward_weight > 0,
               "zero-bubble schedule: the costs of F, B and W (", costs.forward, ", ", costs.backward_input, ", ",
               costs.backward_weight, ") must be positive");
  const int cap = std::min(P, m);
  constexpr double kNever = std::numeric_limits<double>::infinity();
  std::vector<std::vector<double>> f(P, std::vector<double>(m, kNever)), b = f;  // end times
  std::vector<int> nf(P, 0), nb(P, 0), nw(P, 0);
  std::vector<double> free_at(P, 0.0);
  std::vector<double> ends;  // end times of the F's and B's (what a waiting stage waits for)
  std::vector<std::vector<PipelineAction>> lists(P);
  // Exact sums of the costs can differ in the last bit: compare with a tolerance.
  const double eps = 1e-9 * (costs.forward + costs.backward_input + costs.backward_weight);
  int left = P;  // stages with W's still to run
  for (long guard = 0; left > 0; ++guard) {
    DTRAIN_CHECK(guard <= 8L * (m + P) * (P + 1) * 3, "zero-bubble schedule: no progress (", P, " stages, ", m,
                 " micro-batches); a bug in dtrain");
    double t = kNever;
    for (int s = 0; s < P; ++s)
      if (nw[s] < m) t = std::min(t, free_at[s]);
    std::vector<int> waiting;
    for (int s = 0; s < P; ++s) {
      if (nw[s] == m || free_at[s] > t + eps) continue;
      const bool b_ready = nb[s] < nf[s] && (s == P - 1 ? f[s][nb[s]] <= t + eps : b[s + 1][nb[s]] <= t + eps);
      const bool f_ready = nf[s] < m && nf[s] - nw[s] < cap && (s == 0 || f[s - 1][nf[s]] <= t + eps);
      if (b_ready) {
        b[s][nb[s]] = free_at[s] = t + costs.backward_input;
        ends.push_back(free_at[s]);
        lists[s].push_back({Kind::kBackwardInput, nb[s]++});
      } else if (f_ready) {
        f[s][nf[s]] = free_at[s] = t + costs.forward;
        ends.push_back(free_at[s]);
        lists[s].push_back({Kind::kForward, nf[s]++});
      } else if (nw[s] < nb[s]) {
        free_at[s] = t + costs.backward_weight;
        lists[s].push_back({Kind::kBackwardWeight, nw[s]++});
        if (nw[s] == m) --left;
      } else {
        waiting.push_back(s);
      }
    }
    // A stage with nothing ready wakes when the next F or B anywhere finishes (or, when no
    // action is running, a stage's next free time: the loop then advances to it).
    for (int s : waiting) {
      double next = kNever;
      for (double e : ends)
        if (e > t + eps) next = std::min(next, e);
      for (int o = 0; o < P; ++o)
        if (nw[o] < m && free_at[o] > t + eps) next = std::min(next, free_at[o]);
      DTRAIN_CHECK(next < kNever, "zero-bubble schedule: stage ", s, " waits for nothing (", P, " stages, ", m,
                   " micro-batches); a bug in dtrain");
      free_at[s] = next;
    }
  }
  return lists;
}

// The zero-bubble lists for a step whose actions cost `costs`: the list schedule (above) is a
// greedy heuristic, so it is run at the costs, at unit costs and half way between, and the lists
// whose simulated step at the costs is shortest win (ties: the earlier; unit costs: the unit
// lists). Deterministic: every stage computes the same lists.
std::vector<std::vector<PipelineAction>> zero_bubble_lists(int P, int m, const PipelineCosts& costs) {
  const PipelineCosts unit;
  std::vector<std::vector<PipelineAction>> best = list_schedule(P, m, unit);
  if (costs.forward == costs.backward_input && costs.forward == costs.backward_weight) return best;
  double best_step = simulate_pipeline(best, m, costs).step;
  const PipelineCosts half{1, (1 + costs.backward_input / costs.forward) / 2,
                           (1 + costs.backward_weight / costs.forward) / 2};
  for (const PipelineCosts& order : {costs, half}) {
    std::vector<std::vector<PipelineAction>> lists = list_schedule(P, m, order);
    const double step = simulate_pipeline(lists, m, costs).step;
    if (step < best_step * (1 - 1e-12)) best = std::move(lists), best_step = step;
  }
  return best;
}

// Interleaved 1F1B (Megatron-LM's order): the k-th forward runs chunk (k mod P v) / P on
// micro-batch (k / (P v)) P + k mod P, the k-th backward the chunks in reverse; a warm-up of
// 2 (P - 1 - s) + (v - 1) P forwards (all of them when m = P), then one forward and one
// backward in turn, then the remaining backwards.
std::vector<PipelineAction> interleaved_list(int P, int s, int m, int v) {
  DTRAIN_CHECK(P >= 2 && v >= 2, "the interleaved schedule needs at least 2 stages and 2 model chunks per stage, "
               "got ", P, " and ", v, "; with one chunk use the 1f1b schedule");
  DTRAIN_CHECK(m % P == 0, "the interleaved schedule runs the micro-batches ", P, " at a time (one per stage), but "
               "the step has ", m, "; use a multiple of ", P, " micro-batches (--accum_steps)");
  const int total = m * v;
  const int warmup = m == P ? total : std::min(2 * (P - 1 - s) + (v - 1) * P, total);
  auto action = [&](Kind kind, int k) {
    const int chunk = k % (P * v) / P;
    return PipelineAction{kind, k / (P * v) * P + k % P, kind == Kind::kForward ? chunk : v - 1 - chunk};
  };
  std::vector<PipelineAction> list;
  for (int k = 0; k < warmup; ++k) list.push_back(action(Kind::kForward, k));
  for (int k = warmup; k < total; ++k) {
    list.push_back(action(Kind::kForward, k));
    list.push_back(action(Kind::kBackward, k - warmup));
  }
  for (int k = total - warmup; k < total; ++k) list.push_back(action(Kind::kBackward, k));
  return list;
}

}  // namespace

std::vector<PipelineAction> pipeline_actions(PipelineSchedule schedule, int stages, int stage, int micro_batches,
                                             int chunks, const PipelineCosts& costs) {
  DTRAIN_CHECK(stages >= 1 && stage >= 0 && stage < stages && micro_batches >= 1 && chunks >= 1, "pipeline_actions: "
               "stage ", stage, " of ", stages, " with ", micro_batches, " micro-batches and ", chunks,
               " chunk(s) is not a pipeline step");
  DTRAIN_CHECK(chunks == 1 || schedule == PipelineSchedule::kInterleaved, chunks, " model chunks per stage are "
               "for the interleaved schedule, not ", to_string(schedule));
  std::vector<PipelineAction> actions;
  const int m = micro_batches;
  if (schedule == PipelineSchedule::kInterleaved) return interleaved_list(stages, stage, m, chunks);
  if (schedule == PipelineSchedule::kZeroBubble) return zero_bubble_lists(stages, m, costs)[stage];
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

PipelineExchangePlan pipeline_exchange_plan(PipelineSchedule schedule, const std::vector<PipelineAction>& list,
                                            int stages, int stage, int chunks) {
  const int V = stages * chunks;
  const int n = static_cast<int>(list.size());
  auto receives = [&](const PipelineAction& a) {
    const int vs = a.chunk * stages + stage;
    if (a.kind == Kind::kForward) return vs > 0;
    return a.kind != Kind::kBackwardWeight && vs < V - 1;
  };
  PipelineExchangePlan plan;
  plan.issue.assign(n, true);
  plan.receives.assign(n, {});
  // Every forward before every backward (interleaved with m = P: no steady phase) is paired
  // nowhere, as in Megatron-LM: the first backward's gradient comes only after the last forward.
  const int forwards = static_cast<int>(
      std::count_if(list.begin(), list.end(), [](const PipelineAction& a) { return a.kind == Kind::kForward; }));
  int leading = 0;
  while (leading < n && list[leading].kind == Kind::kForward) ++leading;
  const bool paired = schedule == PipelineSchedule::kInterleaved && leading < forwards;
  for (int k = 0; k < n; ++k) {
    const bool backward = list[k].kind == Kind::kBackward || list[k].kind == Kind::kBackwardInput;
    if (paired && backward && k > 0 && list[k - 1].kind == Kind::kForward) {
      plan.issue[k] = false;  // received with the forward before it
      continue;
    }
    if (receives(list[k])) plan.receives[k].push_back(k);
    if (paired && list[k].kind == Kind::kForward && k + 1 < n && list[k + 1].kind != Kind::kForward &&
        receives(list[k + 1])) {
      plan.receives[k].push_back(k + 1);
    }
  }
  return plan;
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

// Each micro-batch's forward once, then either one whole backward or B then W, on one stage,
// for each of its v chunks.
void check_list(const std::vector<PipelineAction>& list, int stage, int m, int v) {
  std::vector<int> seen_f(m * v, 0), seen_b(m * v, 0), seen_whole(m * v, 0), seen_w(m * v, 0);
  for (const PipelineAction& a : list) {
    DTRAIN_CHECK(a.micro >= 0 && a.micro < m && a.chunk >= 0 && a.chunk < v, "pipeline schedule: stage ", stage,
                 " has a ", kind_name(a.kind), " of micro-batch ", a.micro, " of ", m, ", chunk ", a.chunk, " of ", v);
    const int i = a.chunk * m + a.micro;
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
  for (int i = 0; i < m * v; ++i) {
    DTRAIN_CHECK(seen_f[i] && (seen_whole[i] || (seen_b[i] && seen_w[i])), "pipeline schedule: stage ", stage,
                 " does not run the whole forward and backward of micro-batch ", i % m, " (chunk ", i / m, ")");
  }
}

}  // namespace

SimulatedPipeline simulate_pipeline(const std::vector<std::vector<PipelineAction>>& stages, int micro_batches,
                                    const PipelineCosts& costs) {
  const int P = static_cast<int>(stages.size());
  const int m = micro_batches;
  DTRAIN_CHECK(P >= 1 && m >= 1, "simulate_pipeline: ", P, " stages and ", m, " micro-batches");
  int v = 1;  // chunks per stage
  for (const auto& list : stages) {
    for (const PipelineAction& a : list) v = std::max(v, a.chunk + 1);
  }
  for (int s = 0; s < P; ++s) check_list(stages[s], s, m, v);
  const int V = v * P;  // virtual stages: chunk c of stage s is c P + s
  constexpr double kNever = -1;
  std::vector<std::vector<double>> f(V, std::vector<double>(m, kNever)), b = f;
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
        const int i = a.micro, vs = a.chunk * P + s;
        double ready = 0, cost = costs.forward;
        switch (a.kind) {
          case Kind::kForward: ready = vs == 0 ? 0 : f[vs - 1][i]; break;
          case Kind::kBackward:
          case Kind::kBackwardInput:
            ready = vs == V - 1 ? f[vs][i] : b[vs + 1][i];
            cost = a.kind == Kind::kBackward ? costs.backward_input + costs.backward_weight : costs.backward_input;
            break;
          case Kind::kBackwardWeight: ready = b[vs][i]; cost = costs.backward_weight; break;
        }
        if (ready == kNever) break;  // waits for another stage
        const double end = std::max(free_at[s], ready) + cost;
        free_at[s] = end;
        out.busy[s] += cost;
        if (a.kind == Kind::kForward) {
          f[vs][i] = end;
          out.peak_in_flight[s] = std::max(out.peak_in_flight[s], ++in_flight[s]);
        } else if (a.kind == Kind::kBackwardWeight) {
          --in_flight[s];
        } else {
          b[vs][i] = end;
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
            << " of micro-batch " << a.micro << (v > 1 ? ", chunk " + std::to_string(a.chunk) : std::string());
    }
  }
  DTRAIN_CHECK(stuck.tellp() == 0, "pipeline schedule: the stages' lists deadlock (", stuck.str(), ")");
  out.step = *std::max_element(free_at.begin(), free_at.end());
  for (int s = 0; s < P; ++s) out.idle_share.push_back(out.step > 0 ? 1 - out.busy[s] / out.step : 0);
  return out;
}

SimulatedPipeline simulate_pipeline(PipelineSchedule schedule, int stages, int micro_batches,
                                    const PipelineCosts& costs, int chunks, const PipelineCosts* order_costs) {
  if (schedule == PipelineSchedule::kZeroBubble) {
    return simulate_pipeline(zero_bubble_lists(stages, micro_batches, order_costs ? *order_costs : PipelineCosts{}),
                             micro_batches, costs);
  }
  std::vector<std::vector<PipelineAction>> lists;
  for (int s = 0; s < stages; ++s) lists.push_back(pipeline_actions(schedule, stages, s, micro_batches, chunks));
  return simulate_pipeline(lists, micro_batches, costs);
}

}  // namespace dtrain::engine
