#include "dtrain/engine/observe/timeline.h"

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iomanip>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <utility>

#include "dtrain/dist/error.h"
#include "obs_files.h"

namespace dtrain::engine {
namespace {

using nlohmann::json;

constexpr const char* kKnownLanes[] = {lane::kMain,   lane::kBackward, lane::kComm,
                                       lane::kLoader, lane::kCopy,     lane::kOptimizer};

// Thread ids: the known lanes first (1..6, in viewer order), then others as they appear.
std::map<std::string, int> assign_lane_ids(const std::vector<TraceEvent>& events) {
  std::map<std::string, int> ids;
  int next = 1;
  for (const char* name : kKnownLanes) ids.emplace(name, next++);
  for (const auto& e : events) {
    if (ids.emplace(e.lane, next).second) ++next;
  }
  return ids;
}

json metadata(const char* what, int pid, int tid, json args) {
  return json{{"name", what}, {"ph", "M"}, {"pid", pid}, {"tid", tid}, {"args", std::move(args)}};
}

json event_json(const TraceEvent& e, int tid) {
  json j{{"name", e.name}, {"cat", e.cat}, {"ph", std::string(1, e.phase)},
         {"pid", e.rank},  {"tid", tid},   {"ts", e.ts_us}};
  if (e.phase == 'X') j["dur"] = e.dur_us;
  if (e.phase == 'i') j["s"] = "t";  // thread-scoped instant
  if (!e.args.empty()) j["args"] = e.args;
  return j;
}

json trace_json(const std::vector<TraceEvent>& events, int rank, size_t dropped) {
  json list = json::array();
  list.push_back(metadata("process_name", rank, 0, {{"name", "rank " + std::to_string(rank)}}));
  list.push_back(metadata("process_sort_index", rank, 0, {{"sort_index", rank}}));
  const auto ids = assign_lane_ids(events);
  std::set<std::string> used;
  for (const auto& e : events) used.insert(e.lane);
  for (const auto& [name, tid] : ids) {
    if (!used.count(name)) continue;
    list.push_back(metadata("thread_name", rank, tid, {{"name", name}}));
    list.push_back(metadata("thread_sort_index", rank, tid, {{"sort_index", tid}}));
  }
  for (const auto& e : events) list.push_back(event_json(e, ids.at(e.lane)));
  return json{{"traceEvents", std::move(list)},
              {"displayTimeUnit", "ms"},
              {"otherData", {{"producer", "dtrain"}, {"rank", rank}, {"dropped_events", dropped}}}};
}

// Writes text to path through a temporary file renamed into place.
void write_file_atomically(const std::string& path, const std::string& text) {
  const std::string tmp = path + ".tmp." + std::to_string(getpid());
  std::FILE* f = std::fopen(tmp.c_str(), "wb");
  DTRAIN_CHECK(f != nullptr, "cannot write the timeline file '", path, "': ", std::strerror(errno),
               " (pass a writable --timeline=FILE.json)");
  const bool written = std::fwrite(text.data(), 1, text.size(), f) == text.size();
  int error = errno;
  const bool closed = std::fclose(f) == 0;
  if (written) error = errno;  // the failure, if any, is fclose's
  if (!written || !closed) {
    std::remove(tmp.c_str());
    throw Error("writing the timeline file '" + path + "' failed: " + std::strerror(error));
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    const int e = errno;
    std::remove(tmp.c_str());
    throw Error("cannot replace the timeline file '" + path + "': " + std::strerror(e));
  }
}

json read_json(const std::string& path) {
  std::ifstream in(path);
  DTRAIN_CHECK(in.good(), "cannot read the timeline file '", path, "': ", std::strerror(errno));
  try {
    return json::parse(in);
  } catch (const json::exception& e) {
    throw Error("the timeline file '" + path + "' is not valid JSON: " + e.what());
  }
}

// The event list of a trace: {"traceEvents": [...]} or a bare array.
const json& trace_events(const json& trace, const std::string& path) {
  if (trace.is_array()) return trace;
  DTRAIN_CHECK(
      trace.is_object() && trace.contains("traceEvents") && trace["traceEvents"].is_array(),
      "the timeline file '", path, "' has no traceEvents array");
  return trace["traceEvents"];
}

using Interval = std::pair<double, double>;

// Sorted, disjoint cover of the given intervals.
std::vector<Interval> interval_union(std::vector<Interval> v) {
  std::sort(v.begin(), v.end());
  std::vector<Interval> out;
  for (const auto& iv : v) {
    if (iv.second <= iv.first) continue;
    if (!out.empty() && iv.first <= out.back().second) {
      out.back().second = std::max(out.back().second, iv.second);
    } else {
      out.push_back(iv);
    }
  }
  return out;
}

double total_length(const std::vector<Interval>& v) {
  double sum = 0;
  for (const auto& iv : v) sum += iv.second - iv.first;
  return sum;
}

// Length of the intersection of two sorted, disjoint interval lists.
double intersection_length(const std::vector<Interval>& a, const std::vector<Interval>& b) {
  double sum = 0;
  size_t i = 0, j = 0;
  while (i < a.size() && j < b.size()) {
    const double lo = std::max(a[i].first, b[j].first);
    const double hi = std::min(a[i].second, b[j].second);
    if (hi > lo) sum += hi - lo;
    if (a[i].second < b[j].second) {
      ++i;
    } else {
      ++j;
    }
  }
  return sum;
}

}  // namespace

// ---- Timeline -------------------------------------------------------------------------------

Timeline::Timeline(TimelineOptions options)
    : options_(std::move(options)), steady_origin_(Clock::now()) {
  using namespace std::chrono;
  wall_origin_us_ = duration<double, std::micro>(system_clock::now().time_since_epoch()).count();
  if (!options_.enabled || options_.path.empty()) return;
  const std::string why = obs_detail::make_directories(obs_detail::parent_dir(options_.path));
  DTRAIN_CHECK(why.empty(), "cannot create the directory of the timeline file '", options_.path,
               "': ", why, " (pass a writable --timeline=FILE.json)");
  write(options_.path);  // an empty, valid trace: proves the path is writable now
}

Timeline::Timeline(bool enabled, int rank)
    : Timeline([&] {
        TimelineOptions o;
        o.enabled = enabled;
        o.rank = rank;
        return o;
      }()) {}

double Timeline::to_us(Clock::time_point t) const {
  return wall_origin_us_ + std::chrono::duration<double, std::micro>(t - steady_origin_).count();
}

void Timeline::add(TraceEvent event) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (events_.size() >= options_.max_events) {
    ++dropped_;
    return;
  }
  events_.push_back(std::move(event));
}

void Timeline::add_complete(std::string_view name, std::string_view cat, std::string_view lane,
                            Clock::time_point start, Clock::time_point end, const TraceArgs& args) {
  if (!options_.enabled) return;
  TraceEvent e{std::string(name), std::string(cat), 'X', options_.rank,
               std::string(lane), to_us(start),     0,   args};
  e.dur_us = std::max(0.0, to_us(end) - e.ts_us);
  add(std::move(e));
}

void Timeline::add_instant(std::string_view name, std::string_view cat, std::string_view lane,
                           Clock::time_point at, const TraceArgs& args) {
  if (!options_.enabled) return;
  add(TraceEvent{std::string(name), std::string(cat), 'i', options_.rank, std::string(lane),
                 to_us(at), 0, args});
}

std::vector<TraceEvent> Timeline::events() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return events_;
}

size_t Timeline::dropped_events() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return dropped_;
}

void Timeline::clear() {
  std::lock_guard<std::mutex> lock(mutex_);
  events_.clear();
  dropped_ = 0;
}

void Timeline::write(const std::string& path) const {
  std::vector<TraceEvent> snapshot;
  size_t dropped = 0;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    snapshot = events_;
    dropped = dropped_;
  }
  write_file_atomically(path, trace_json(snapshot, options_.rank, dropped).dump());
}

void Timeline::write() const {
  DTRAIN_CHECK(!options_.path.empty(),
               "Timeline::write() needs a path: set TimelineOptions::path or call write(path)");
  write(options_.path);
}

// ---- Span -----------------------------------------------------------------------------------

Timeline::Span::Span(Timeline& timeline, std::string_view name, std::string_view cat,
                     std::string_view lane, TraceArgs args)
    : timeline_(timeline.enabled() ? &timeline : nullptr) {
  if (!timeline_) return;
  name_ = name;
  cat_ = cat;
  lane_ = lane;
  args_ = std::move(args);
  start_ = Clock::now();
}

void Timeline::Span::set_arg(const std::string& key, double value) {
  if (timeline_) args_[key] = value;
}

void Timeline::Span::end() {
  if (!timeline_) return;
  Timeline* t = timeline_;
  timeline_ = nullptr;
  try {
    t->add_complete(name_, cat_, lane_, start_, Clock::now(), args_);
  } catch (...) {
    // Out of memory while recording: the event is lost, the step goes on (never throws).
  }
}

// ---- files ----------------------------------------------------------------------------------

std::string timeline_path_for_rank(const std::string& path, int rank, int world_size) {
  if (world_size <= 1) return path;
  const std::string tag = ".rank" + std::to_string(rank);
  const size_t slash = path.find_last_of('/');
  const size_t dot = path.find_last_of('.');
  // Before the extension of the file name ("trace.json"); appended when there is none.
  if (dot == std::string::npos || (slash != std::string::npos && dot < slash) ||
      dot == (slash == std::string::npos ? 0 : slash + 1)) {
    return path + tag;
  }
  return path.substr(0, dot) + tag + path.substr(dot);
}

std::vector<TraceEvent> read_timeline(const std::string& path) {
  const json trace = read_json(path);
  std::map<std::pair<int, int>, std::string> thread_names;
  std::vector<std::pair<TraceEvent, int>> events;  // with tid, named after the loop
  for (const auto& j : trace_events(trace, path)) {
    if (!j.is_object()) continue;
    const std::string ph = j.value("ph", "");
    const int pid = j.value("pid", 0), tid = j.value("tid", 0);
    if (ph == "M" && j.value("name", "") == "thread_name" && j.contains("args")) {
      thread_names[{pid, tid}] = j["args"].value("name", "");
      continue;
    }
    if (ph != "X" && ph != "i" && ph != "I") continue;
    TraceEvent e;
    e.name = j.value("name", "");
    e.cat = j.value("cat", "");
    e.phase = ph == "X" ? 'X' : 'i';
    e.rank = pid;
    e.ts_us = j.value("ts", 0.0);
    e.dur_us = j.value("dur", 0.0);
    if (j.contains("args") && j["args"].is_object()) {
      for (const auto& [key, value] : j["args"].items()) {
        if (value.is_number()) e.args[key] = value.get<double>();
      }
    }
    events.emplace_back(std::move(e), tid);
  }
  std::vector<TraceEvent> out;
  out.reserve(events.size());
  for (auto& [e, tid] : events) {
    auto it = thread_names.find({e.rank, tid});
    e.lane = it != thread_names.end() ? it->second : "tid " + std::to_string(tid);
    out.push_back(std::move(e));
  }
  return out;
}

void merge_timelines(const std::vector<std::string>& paths, const std::string& out) {
  DTRAIN_CHECK(!paths.empty(), "merge_timelines: no input files");
  json merged = json::array();
  std::map<int, std::string> owner;  // pid -> the file it came from
  for (const auto& path : paths) {
    const json trace = read_json(path);
    std::set<int> pids;
    for (const auto& j : trace_events(trace, path)) {
      if (j.is_object()) pids.insert(j.value("pid", 0));
      merged.push_back(j);
    }
    for (int pid : pids) {
      auto [it, fresh] = owner.emplace(pid, path);
      DTRAIN_CHECK(fresh, "cannot merge timelines: rank ", pid, " is in both '", it->second,
                   "' and '", path, "' (pass one file per rank)");
    }
  }
  json trace{{"traceEvents", std::move(merged)},
             {"displayTimeUnit", "ms"},
             {"otherData", {{"producer", "dtrain"}, {"merged_from", paths}}}};
  write_file_atomically(out, trace.dump());
}

// ---- overlap --------------------------------------------------------------------------------

OverlapSummary summarize_overlap(const std::vector<TraceEvent>& events,
                                 const OverlapOptions& options) {
  struct PerRank {
    std::vector<Interval> comm, backward;
    int steps = 0;
  };
  std::map<int, PerRank> ranks;
  for (const auto& e : events) {
    if (e.phase != 'X') continue;
    auto& r = ranks[e.rank];
    const Interval iv{e.ts_us, e.ts_us + e.dur_us};
    if (e.cat == options.comm_category) r.comm.push_back(iv);
    if (e.name == options.backward_name) r.backward.push_back(iv);
    if (e.name == options.step_name) ++r.steps;
  }
  OverlapSummary s;
  for (auto& [rank, r] : ranks) {
    const auto comm = interval_union(std::move(r.comm));
    const int steps = r.steps > 0 ? r.steps : static_cast<int>(r.backward.size());
    const auto backward = interval_union(std::move(r.backward));
    s.comm_ms += total_length(comm) / 1000.0;
    s.hidden_ms += intersection_length(comm, backward) / 1000.0;
    s.steps += steps;
    ++s.ranks;
  }
  if (s.ranks > 0) {
    s.comm_ms /= s.ranks;
    s.hidden_ms /= s.ranks;
    s.steps /= s.ranks;
  }
  return s;
}

OffloadSummary summarize_offload(const std::vector<TraceEvent>& events) {
  struct PerRank {
    std::vector<Interval> steps, backward, compute, cpu;
  };
  std::map<int, PerRank> ranks;
  for (const auto& e : events) {
    if (e.phase != 'X') continue;
    PerRank& r = ranks[e.rank];
    const Interval iv{e.ts_us, e.ts_us + e.dur_us};
    if (e.name == "step") r.steps.push_back(iv);
    if (e.name == "backward") r.backward.push_back(iv);
    if (e.name == "forward" || e.name == "backward") r.compute.push_back(iv);
    if (e.name.rfind("cpu update", 0) == 0) r.cpu.push_back(iv);
  }
  OffloadSummary s;
  for (auto& [rank, r] : ranks) {
    if (r.cpu.empty() || r.steps.empty()) continue;
    double after = 0, total = 0;
    for (const Interval& step : r.steps) {
      double last_backward = -1;
      for (const Interval& b : r.backward) {
        if (b.second >= step.first && b.second <= step.second) last_backward = std::max(last_backward, b.second);
      }
      total += step.second - step.first;
      if (last_backward >= 0) after += step.second - last_backward;
    }
    const auto cpu = interval_union(std::move(r.cpu));
    const auto compute = interval_union(std::move(r.compute));
    const double n = static_cast<double>(r.steps.size());
    s.steps += n;
    s.step_ms += total / n / 1000.0;
    s.after_backward_ms += after / n / 1000.0;
    s.cpu_update_ms += total_length(cpu) / n / 1000.0;
    s.cpu_update_beside_ms += intersection_length(cpu, compute) / n / 1000.0;
    ++s.ranks;
  }
  if (s.ranks > 0) {
    for (double* v : {&s.steps, &s.step_ms, &s.after_backward_ms, &s.cpu_update_ms, &s.cpu_update_beside_ms}) {
      *v /= s.ranks;
    }
  }
  return s;
}

std::string OffloadSummary::to_string() const {
  if (ranks == 0) return "";
  std::ostringstream os;
  os << std::fixed << std::setprecision(1) << "optimizer offload: host work after backward " << after_backward_ms
     << " ms/step (" << 100.0 * after_backward_fraction() << "% of " << step_ms << " ms); CPU updates "
     << cpu_update_ms << " ms/step, " << std::setprecision(0) << 100.0 * beside_fraction()
     << "% beside forward and backward (" << ranks << (ranks == 1 ? " rank, " : " ranks, ") << steps << " steps)";
  return os.str();
}

std::vector<PipelineStageSummary> summarize_pipeline(const std::vector<TraceEvent>& events) {
  struct PerRank {
    PipelineStageSummary s;
    bool pipelined = false;
    double micro_batches = 0;
    double sum[3] = {0, 0, 0};  // forward, backward input, backward weight
    int count[3] = {0, 0, 0};
  };
  std::map<int, PerRank> ranks;
  int stages = 0;
  for (const auto& e : events) {
    if (e.phase != 'X') continue;
    PerRank& r = ranks[e.rank];
    r.s.rank = e.rank;
    const double ms = e.dur_us / 1000.0;
    auto stage = e.args.find("stage");
    if (stage != e.args.end()) {
      r.pipelined = true;
      r.s.stage = static_cast<int>(stage->second);
      stages = std::max(stages, r.s.stage + 1);
    }
    if (e.name == "step") {
      ++r.s.steps;
      r.s.step_ms += ms;
      auto m = e.args.find("accum_steps");
      if (m != e.args.end()) r.micro_batches += m->second;
      auto v = e.args.find("pp_chunks");
      if (v != e.args.end()) r.s.chunks = static_cast<int>(v->second);
    } else if (e.cat == category::kCompute && (e.name == "forward" || e.name.rfind("backward", 0) == 0) &&
               stage != e.args.end()) {
      r.s.compute_ms += ms;
      if (e.name == "backward weight") r.s.zero_bubble = true;
      const int k = e.name == "forward" ? 0 : e.name == "backward input" ? 1 : e.name == "backward weight" ? 2 : -1;
      if (k >= 0) r.sum[k] += ms, ++r.count[k];
    } else if (e.name.rfind("wait for stage", 0) == 0) {
      r.pipelined = true;
      r.s.wait_ms += ms;
    }
  }
  std::vector<PipelineStageSummary> out;
  for (auto& [rank, r] : ranks) {
    if (!r.pipelined || r.s.steps == 0) continue;
    r.s.stages = stages;
    r.s.micro_batches = r.micro_batches / r.s.steps;
    r.s.step_ms /= r.s.steps;
    r.s.compute_ms /= r.s.steps;
    r.s.wait_ms /= r.s.steps;
    r.s.forward_ms = r.count[0] ? r.sum[0] / r.count[0] : 0;
    r.s.backward_input_ms = r.count[1] ? r.sum[1] / r.count[1] : 0;
    r.s.backward_weight_ms = r.count[2] ? r.sum[2] / r.count[2] : 0;
    out.push_back(r.s);
  }
  return out;
}

std::string to_string(const std::vector<PipelineStageSummary>& stages) {
  std::ostringstream os;
  for (const PipelineStageSummary& s : stages) {
    os << (os.tellp() > 0 ? "\n" : "") << std::fixed << "stage " << s.stage << " (rank " << s.rank << "): idle "
       << std::setprecision(0) << 100.0 * s.idle_fraction() << "% of " << std::setprecision(1) << s.step_ms
       << " ms/step (compute " << s.compute_ms << " ms, waiting for neighbours " << s.wait_ms
       << " ms); "
       << (s.zero_bubble ? "zero bubble's ideal (P-1)/(3m+P-1)"
           : s.chunks > 1 ? "the interleaved bubble (P-1)/(vm+P-1)"
                          : "the bubble (P-1)/(m+P-1)")
       << " is " << std::setprecision(0) << 100.0 * s.bubble_theory() << "% for P " << s.stages
       << (s.chunks > 1 ? ", v " + std::to_string(s.chunks) : std::string()) << ", m "
       << std::setprecision(s.micro_batches == static_cast<int>(s.micro_batches) ? 0 : 1) << s.micro_batches;
  }
  const std::string flag = zb_costs_flag(stages);
  if (!flag.empty()) {
    os << "\nzero bubble's measured costs (forward 1): " << flag
       << " orders its lists at them (the same flag on every rank)";
  }
  return os.str();
}

std::string zb_costs_flag(const std::vector<PipelineStageSummary>& stages) {
  double f = 0, b = 0, w = 0;
  const bool many = stages.size() > 1;
  for (const PipelineStageSummary& s : stages) {
    if (!s.zero_bubble || (many && s.stage == 0)) continue;
    f += s.forward_ms, b += s.backward_input_ms, w += s.backward_weight_ms;
  }
  if (f <= 0 || b <= 0 || w <= 0) return "";
  char buf[96];
  std::snprintf(buf, sizeof buf, "--pp_zb_costs=1,%.3g,%.3g", b / f, w / f);
  return buf;
}

std::string OverlapSummary::to_string() const {
  std::ostringstream os;
  os << std::fixed << std::setprecision(1) << "communication " << comm_ms_per_step()
     << (steps > 0 ? " ms/step, " : " ms, ") << hidden_ms_per_step() << " ms ("
     << std::setprecision(0) << 100.0 * hidden_fraction() << "%) hidden behind backward (" << ranks
     << (ranks == 1 ? " rank, " : " ranks, ") << std::setprecision(0) << steps << " steps)";
  return os.str();
}

}  // namespace dtrain::engine
