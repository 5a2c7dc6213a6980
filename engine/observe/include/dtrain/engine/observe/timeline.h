// A timeline of each rank's training steps as a Chrome trace (the Trace Event Format that
// chrome://tracing and ui.perfetto.dev open): forward, backward, each bucket's all-reduce,
// host-device copies, the optimizer step, with the bytes moved; one process per rank, one
// thread row per lane.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

namespace dtrain::engine {

// Lanes (thread rows in the viewer, in this order; other names get rows after them).
namespace lane {
inline constexpr char kMain[] = "main";          // the training loop: step, forward, loss
inline constexpr char kBackward[] = "backward";  // autograd's backward pass
inline constexpr char kComm[] = "comm";          // collectives (each bucket's all-reduce)
inline constexpr char kLoader[] = "loader";      // data loading and batching
inline constexpr char kCopy[] = "copy";          // host-device copies (loader, offload)
inline constexpr char kOptimizer[] = "optimizer";
inline constexpr char kUnits[] = "units";        // ZeRO-3's units: each one's forward and backward
inline constexpr char kRing[] = "ring";          // context parallelism: ring attention's steps and exchanges
}  // namespace lane

// Categories ("cat") that summarize_overlap() and the docs rely on.
namespace category {
inline constexpr char kCompute[] = "compute";
inline constexpr char kComm[] = "comm";
inline constexpr char kCopy[] = "copy";
inline constexpr char kData[] = "data";
inline constexpr char kOptimizer[] = "optimizer";
}  // namespace category

// Numeric arguments shown with an event, e.g. {{"bytes", 4.2e6}, {"bucket", 3}}.
using TraceArgs = std::map<std::string, double>;

// One event as recorded or read back from a trace file.
struct TraceEvent {
  std::string name;
  std::string cat;
  char phase = 'X';   // 'X': complete event (start and duration); 'i': instant
  int rank = 0;       // the trace's pid
  std::string lane;   // the trace's thread name
  double ts_us = 0;   // start, microseconds since the Unix epoch
  double dur_us = 0;  // duration ('X' only)
  TraceArgs args;
};

struct TimelineOptions {
  bool enabled = false;  // false: every call is a no-op (a Span reads no clock)
  int rank = 0;          // the process (pid) of every event
  // When set, the constructor checks at start-up that this file can be written (creating
  // its parent directories and an empty valid trace there) and write() with no argument
  // writes it.
  std::string path;
  // Events past this many are dropped (and counted in the file's otherData); bounds the
  // memory of long runs (about 200 bytes per event).
  size_t max_events = size_t{1} << 20;
};

// Records events in memory; writes them as one JSON trace file.
// Time: events are recorded with steady_clock and written as wall-clock microseconds
// (system_clock at construction plus the steady offset), so files of ranks on one host
// line up exactly and across hosts as well as their clocks agree.
// Threading: every method is thread-safe (one mutex); events may come from the training
// loop, autograd, communication, loader and copy threads. Within one lane, events should
// nest or be disjoint (the viewers draw a lane as a stack of nested slices).
class Timeline {
 public:
  using Clock = std::chrono::steady_clock;

  // Throws dtrain::Error naming options.path when it is set and cannot be written.
  explicit Timeline(TimelineOptions options);
  Timeline(bool enabled, int rank);
  Timeline(const Timeline&) = delete;
  Timeline& operator=(const Timeline&) = delete;

  bool enabled() const { return options_.enabled; }
  int rank() const { return options_.rank; }

  // A complete ('X') event from start to end.
  void add_complete(std::string_view name, std::string_view cat, std::string_view lane,
                    Clock::time_point start, Clock::time_point end, const TraceArgs& args = {});
  // An instant ('i') event, e.g. a bucket's all-reduce being enqueued.
  void add_instant(std::string_view name, std::string_view cat, std::string_view lane,
                   Clock::time_point at, const TraceArgs& args = {});

  // Records [construction, destruction) (or until end()) as a complete event.
  //   { Timeline::Span span(timeline, "forward", category::kCompute, lane::kMain); ... }
  class Span {
   public:
    Span(Timeline& timeline, std::string_view name, std::string_view cat,
         std::string_view lane = lane::kMain, TraceArgs args = {});
    ~Span() { end(); }
    Span(const Span&) = delete;
    Span& operator=(const Span&) = delete;
    void set_arg(const std::string& key, double value);
    // Ends the span now (idempotent).
    void end();

   private:
    Timeline* timeline_;  // null when disabled or ended
    std::string name_, cat_, lane_;
    TraceArgs args_;
    Clock::time_point start_;
  };

  // A copy of the events recorded so far, in recording order.
  std::vector<TraceEvent> events() const;
  size_t dropped_events() const;
  void clear();

  // Writes {"traceEvents": [...], "displayTimeUnit": "ms", "otherData": {...}} with the
  // process and lane names as metadata events. Synchronous; replaces the file atomically
  // (a temporary file renamed). Throws dtrain::Error naming the path when it cannot be
  // written. write() without a path writes options.path (an error when none was given).
  void write(const std::string& path) const;
  void write() const;

 private:
  double to_us(Clock::time_point t) const;
  void add(TraceEvent event);

  TimelineOptions options_;
  Clock::time_point steady_origin_;
  double wall_origin_us_ = 0;
  mutable std::mutex mutex_;
  std::vector<TraceEvent> events_;  // guarded by mutex_
  size_t dropped_ = 0;              // guarded by mutex_
};

// The per-rank file name for a trace path when the world has several ranks:
// "run/trace.json" -> "run/trace.rank3.json" (unchanged for world_size 1).
std::string timeline_path_for_rank(const std::string& path, int rank, int world_size);

// Reads a trace file (this module's or any Trace Event Format file: an object with
// "traceEvents" or a bare array): its 'X' and 'i' events, lanes named from the thread_name
// metadata ("tid N" where there is none). Throws dtrain::Error naming the path when it is
// missing or not valid JSON.
std::vector<TraceEvent> read_timeline(const std::string& path);

// Combines per-rank trace files into one (each file's events keep their pid = rank, so the
// viewer shows one process per rank). Throws dtrain::Error when a file cannot be read, when
// two files hold the same rank, or when `out` cannot be written.
void merge_timelines(const std::vector<std::string>& paths, const std::string& out);

// How much communication was hidden behind backward, from recorded intervals.
struct OverlapOptions {
  std::string comm_category = category::kComm;  // 'X' events of this cat are communication
  std::string backward_name = "backward";       // 'X' events of this name are backward
  std::string step_name = "step";               // 'X' events of this name count steps
};
struct OverlapSummary {
  int ranks = 0;         // ranks with events
  double steps = 0;      // steps per rank (mean)
  double comm_ms = 0;    // per rank (mean): length of the union of communication intervals
  double hidden_ms = 0;  // per rank (mean): the part of it inside the union of backward spans
  double comm_ms_per_step() const { return steps > 0 ? comm_ms / steps : comm_ms; }
  double hidden_ms_per_step() const { return steps > 0 ? hidden_ms / steps : hidden_ms; }
  double hidden_fraction() const { return comm_ms > 0 ? hidden_ms / comm_ms : 0; }
  // "communication 12.3 ms/step, 9.8 ms (80%) hidden behind backward (2 ranks, 20 steps)"
  std::string to_string() const;
};
// Per rank: comm = |∪ comm intervals|, hidden = |(∪ comm) ∩ (∪ backward)|, steps = the
// number of step events (the number of backward spans where there are none); then the mean
// over ranks. Pure.
OverlapSummary summarize_overlap(const std::vector<TraceEvent>& events,
                                 const OverlapOptions& options = {});

// Optimizer offload: what of a step the host does after backward, and where the CPU updates
// ("cpu update" and "cpu update (delayed)" spans, the optimizer lane) ran. Per rank: for each
// "step" span, the time from the end of its last "backward" span to the step's end (the update's
// critical path: gradients to the host, the CPU update unless delayed, weights back, gathers);
// the union of the CPU update spans, and its part inside the union of the "forward" and
// "backward" spans (the delayed update beside the next step's compute). Then the mean over ranks.
struct OffloadSummary {
  int ranks = 0;              // ranks with CPU update spans
  double steps = 0;           // per rank (mean): step spans
  double step_ms = 0;         // per step
  double after_backward_ms = 0;  // per step
  double cpu_update_ms = 0;   // per step
  double cpu_update_beside_ms = 0;  // per step: inside forward or backward
  double after_backward_fraction() const { return step_ms > 0 ? after_backward_ms / step_ms : 0; }
  double beside_fraction() const { return cpu_update_ms > 0 ? cpu_update_beside_ms / cpu_update_ms : 0; }
  // "optimizer offload: host work after backward 3.1 ms/step (1.3% of 245.0 ms); CPU updates
  // 10.4 ms/step, 95% beside forward and backward (1 rank, 10 steps)"; "" with no CPU updates.
  std::string to_string() const;
};
// Pure.
OffloadSummary summarize_offload(const std::vector<TraceEvent>& events);

// Pipeline parallelism: where each stage's steps went. The trainer records, per micro-batch,
// "forward" and "backward" spans (zero bubble: "backward input" and "backward weight"; cat
// compute, args "stage" and "micro_batch") and "wait for
// stage S" spans (the receive of an activation or its gradient), inside "step" spans (arg
// "accum_steps": the micro-batches m).
struct PipelineStageSummary {
  int rank = 0;
  int stage = 0;
  int stages = 0;             // of the pipeline: the highest stage in the events + 1
  int steps = 0;
  double micro_batches = 0;   // per step (mean accum_steps)
  double step_ms = 0;         // per step
  double compute_ms = 0;      // per step: the forward and backward spans
  double wait_ms = 0;         // per step: waiting for a neighbour stage's activation or gradient
  bool zero_bubble = false;   // the backwards came in halves ("backward input", "backward weight")
  int chunks = 1;             // model chunks per stage (the interleaved schedule: "step" arg "pp_chunks")
  // Mean milliseconds of one "forward", "backward input" and "backward weight" span (0: none).
  double forward_ms = 0, backward_input_ms = 0, backward_weight_ms = 0;
  // 1 - compute / step: the stage's bubble, plus what else the step does (optimizer, norm).
  double idle_fraction() const { return step_ms > 0 ? 1 - compute_ms / step_ms : 0; }
  // The schedule's bubble in theory: (P - 1) / (m + P - 1) for GPipe and 1F1B; zero bubble's
  // ideal at equal costs of a forward and each half of a backward, (P - 1) / (3m + P - 1);
  // interleaved with v chunks, (P - 1) / (v m + P - 1).
  double bubble_theory() const {
    if (stages <= 0) return 0;
    const double m = zero_bubble ? 3 * micro_batches : chunks * micro_batches;
    return (stages - 1) / (m + stages - 1);
  }
};
// One entry per rank with pipeline spans, by rank. Pure.
std::vector<PipelineStageSummary> summarize_pipeline(const std::vector<TraceEvent>& events);
// One line per stage: "stage 1 (rank 1): idle 24% of 113.6 ms/step (compute 86.3 ms, waiting
// for neighbours 21.0 ms); the bubble (P-1)/(m+P-1) is 20% for P 2, m 4". "" for none. Under
// zero bubble a last line gives the stages' measured F, B and W as the flag that orders zb's
// lists at them (zb_costs_flag).
// "--pp_zb_costs=1,B,W" from the mean forward, backward-input and backward-weight spans of the
// stages after the first (whose B has nothing to compute and whose W is the whole backward; the
// first stage when it is the only one), scaled so that F is 1. "" without zero-bubble spans.
std::string zb_costs_flag(const std::vector<PipelineStageSummary>& stages);
std::string to_string(const std::vector<PipelineStageSummary>& stages);

}  // namespace dtrain::engine

#include "dtrain/dist/glog_compat.h"  // last: keeps glog's LOG macros whatever the include order
