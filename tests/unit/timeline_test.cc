// The Chrome-trace timeline: structure of the written JSON (parsed back with nlohmann),
// events from several threads, the overlap summary against closed-form interval arithmetic,
// merging per-rank files, and bad paths.
#include "dtrain/engine/observe/timeline.h"

#include <ftw.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "dtrain/dist/error.h"
#include "test_util.h"

namespace dtrain::engine {
namespace {

using nlohmann::json;
using testing_util::error_of;
using testing_util::ScratchDir;
using Clock = Timeline::Clock;
using std::chrono::microseconds;
using std::chrono::milliseconds;

json parse_file(const std::string& path) {
  std::ifstream in(path);
  EXPECT_TRUE(in.good()) << path;
  return json::parse(in);
}

// Three steps of 100 ms from t0. Rank 0 (per step, ms from the step's start): forward
// [0, 30), backward [30, 70), all-reduces [40, 50) and [55, 75) on "comm" and [45, 60) on
// a second communication lane, optimizer [78, 88). Union of communication: [40, 75) = 35 ms;
// inside backward: [40, 70) = 30 ms.
// Rank 1: the same compute, one all-reduce [70, 90) after backward: 20 ms, none hidden.
void record_steps(Timeline& t, Clock::time_point t0, int rank) {
  auto at = [&](int step, int ms) { return t0 + milliseconds(100 * step + ms); };
  for (int s = 0; s < 3; ++s) {
    t.add_complete("step", category::kCompute, lane::kMain, at(s, 0), at(s, 90));
    t.add_complete("forward", category::kCompute, lane::kMain, at(s, 0), at(s, 30));
    t.add_complete("backward", category::kCompute, lane::kBackward, at(s, 30), at(s, 70));
    if (rank == 0) {
      t.add_instant("enqueue bucket 0", category::kComm, lane::kComm, at(s, 39), {{"bucket", 0}});
      t.add_complete("allreduce bucket 0", category::kComm, lane::kComm, at(s, 40), at(s, 50),
                     {{"bytes", 1 << 20}, {"bucket", 0}});
      t.add_complete("allreduce bucket 1", category::kComm, lane::kComm, at(s, 55), at(s, 75),
                     {{"bytes", 25 << 20}, {"bucket", 1}});
      t.add_complete("allreduce (second stream)", category::kComm, "comm2", at(s, 45), at(s, 60));
    } else {
      t.add_complete("allreduce bucket 0", category::kComm, lane::kComm, at(s, 70), at(s, 90),
                     {{"bytes", 1 << 20}});
    }
    t.add_complete("optimizer", category::kOptimizer, lane::kOptimizer, at(s, 78), at(s, 88));
  }
}

TEST(Timeline, WritesChromeTraceJson) {
  ScratchDir dir("tl_json", /*create=*/true);
  Timeline t(true, /*rank=*/3);
  const auto t0 = Clock::now();
  t.add_complete("h2d batch", category::kCopy, lane::kCopy, t0, t0 + microseconds(1500),
                 {{"bytes", 4096}});
  t.add_instant("enqueue", category::kComm, lane::kComm, t0 + microseconds(200));
  t.add_complete("custom", "misc", "my lane", t0, t0 + microseconds(10));
  t.write(dir / "trace.json");

  const json j = parse_file(dir / "trace.json");
  ASSERT_TRUE(j.is_object());
  EXPECT_EQ(j["displayTimeUnit"], "ms");
  ASSERT_TRUE(j["traceEvents"].is_array());
  std::map<int, std::string> thread_names;
  std::string process_name;
  std::vector<json> real;
  for (const auto& e : j["traceEvents"]) {
    EXPECT_EQ(e["pid"], 3);
    if (e["ph"] == "M") {
      if (e["name"] == "process_name") process_name = e["args"]["name"];
      if (e["name"] == "thread_name") thread_names[e["tid"]] = e["args"]["name"];
    } else {
      real.push_back(e);
    }
  }
  EXPECT_EQ(process_name, "rank 3");
  // One named row per lane used, with distinct ids.
  std::set<std::string> names;
  for (const auto& [tid, name] : thread_names) names.insert(name);
  EXPECT_EQ(names, (std::set<std::string>{"copy", "comm", "my lane"}));
  ASSERT_EQ(real.size(), 3u);
  const json& copy = real[0];
  EXPECT_EQ(copy["ph"], "X");
  EXPECT_EQ(copy["name"], "h2d batch");
  EXPECT_EQ(copy["cat"], "copy");
  EXPECT_EQ(thread_names[copy["tid"]], "copy");
  EXPECT_NEAR(copy["dur"].get<double>(), 1500.0, 1.0);
  EXPECT_EQ(copy["args"]["bytes"], 4096);
  const json& instant = real[1];
  EXPECT_EQ(instant["ph"], "i");
  EXPECT_EQ(instant["s"], "t");
  EXPECT_FALSE(instant.contains("dur"));
  EXPECT_NEAR(instant["ts"].get<double>() - copy["ts"].get<double>(), 200.0, 1.0);
  EXPECT_EQ(thread_names[real[2]["tid"]], "my lane");
  // Timestamps are wall-clock microseconds: within a minute of now.
  const double now_us =
      std::chrono::duration<double, std::micro>(std::chrono::system_clock::now().time_since_epoch())
          .count();
  EXPECT_NEAR(copy["ts"].get<double>(), now_us, 60e6);
}

TEST(Timeline, SpansAndThreads) {
  Timeline t(true, 0);
  {
    Timeline::Span span(t, "forward", category::kCompute, lane::kMain, {{"micro_batch", 1}});
    span.set_arg("rows", 16);
    std::this_thread::sleep_for(milliseconds(3));
  }
  {
    Timeline::Span span(t, "early", category::kCompute);
    span.end();
    span.end();  // idempotent: one event
  }
  // Four threads record concurrently while another thread writes snapshots.
  const char* lanes[] = {lane::kBackward, lane::kComm, lane::kLoader, lane::kCopy};
  std::vector<std::thread> threads;
  for (const char* l : lanes) {
    threads.emplace_back([&t, l] {
      for (int i = 0; i < 500; ++i) {
        Timeline::Span span(t, "work", "test", l, {{"i", i}});
      }
    });
  }
  ScratchDir dir("tl_threads", /*create=*/true);
  for (int i = 0; i < 3; ++i) t.write(dir / "snapshot.json");
  for (auto& th : threads) th.join();

  const auto events = t.events();
  ASSERT_EQ(events.size(), 2u + 4 * 500);
  EXPECT_EQ(events[0].name, "forward");
  EXPECT_GE(events[0].dur_us, 3000.0);
  EXPECT_EQ(events[0].args.at("micro_batch"), 1);
  EXPECT_EQ(events[0].args.at("rows"), 16);
  EXPECT_EQ(events[1].name, "early");
  std::map<std::string, int> per_lane;
  for (const auto& e : events) ++per_lane[e.lane];
  for (const char* l : lanes) EXPECT_EQ(per_lane[l], 500) << l;
  // Each thread's spans are disjoint and in order on its lane.
  std::map<std::string, double> last_end;
  for (const auto& e : events) {
    if (e.cat != "test") continue;
    EXPECT_GE(e.ts_us, last_end[e.lane] - 1.0);
    last_end[e.lane] = e.ts_us + e.dur_us;
  }
  t.write(dir / "final.json");
  EXPECT_EQ(read_timeline(dir / "final.json").size(), events.size());
}

TEST(Timeline, DisabledRecordsNothing) {
  Timeline t(false, 0);
  { Timeline::Span span(t, "forward", category::kCompute); }
  t.add_complete("x", "y", "z", Clock::now(), Clock::now());
  t.add_instant("x", "y", "z", Clock::now());
  EXPECT_TRUE(t.events().empty());
  EXPECT_FALSE(t.enabled());
}

TEST(Timeline, MaxEventsDropsAndCounts) {
  ScratchDir dir("tl_cap", /*create=*/true);
  TimelineOptions o;
  o.enabled = true;
  o.max_events = 5;
  Timeline t(o);
  for (int i = 0; i < 8; ++i) t.add_instant("tick", "test", lane::kMain, Clock::now());
  EXPECT_EQ(t.events().size(), 5u);
  EXPECT_EQ(t.dropped_events(), 3u);
  t.write(dir / "capped.json");
  EXPECT_EQ(parse_file(dir / "capped.json")["otherData"]["dropped_events"], 3);
}

// Two stages' spans of two steps each, and a rank without a pipeline (left out): per step,
// stage 0 computes 4 x 10 + 4 x 20 = 120 of 200 ms and waits 2 x 15; stage 1 computes
// 4 x 12 + 4 x 24 = 144 of 180 ms and waits 4 x 5.
TEST(Timeline, PipelineSummaryMatchesClosedForm) {
  std::vector<TraceEvent> events;
  auto add = [&](int rank, const std::string& name, const std::string& cat, double ms, TraceArgs args) {
    TraceEvent e;
    e.rank = rank;
    e.name = name;
    e.cat = cat;
    e.dur_us = ms * 1000;
    e.args = std::move(args);
    events.push_back(e);
  };
  for (int step = 0; step < 2; ++step) {
    for (int rank = 0; rank < 2; ++rank) {
      add(rank, "step", category::kCompute, rank == 0 ? 200 : 180, {{"accum_steps", 4}});
      for (int i = 0; i < 4; ++i) {
        const TraceArgs args = {{"stage", rank}, {"micro_batch", i}};
        add(rank, "forward", category::kCompute, rank == 0 ? 10 : 12, args);
        add(rank, "backward", category::kCompute, rank == 0 ? 20 : 24, args);
        if (rank == 1 || i < 2) add(rank, "wait for stage " + std::to_string(1 - rank), "wait", rank == 0 ? 15 : 5, args);
      }
    }
    add(2, "step", category::kCompute, 50, {{"accum_steps", 1}});
    add(2, "forward", category::kCompute, 20, {});
  }
  const std::vector<PipelineStageSummary> s = summarize_pipeline(events);
  ASSERT_EQ(s.size(), 2u);
  EXPECT_EQ(s[0].stage, 0);
  EXPECT_EQ(s[1].stage, 1);
  EXPECT_EQ(s[1].rank, 1);
  EXPECT_EQ(s[0].stages, 2);
  EXPECT_EQ(s[0].steps, 2);
  EXPECT_NEAR(s[0].step_ms, 200, 1e-9);
  EXPECT_NEAR(s[0].compute_ms, 120, 1e-9);
  EXPECT_NEAR(s[0].wait_ms, 30, 1e-9);
  EXPECT_NEAR(s[0].idle_fraction(), 0.4, 1e-12);
  EXPECT_NEAR(s[0].bubble_theory(), 0.2, 1e-12);
  EXPECT_NEAR(s[1].compute_ms, 144, 1e-9);
  EXPECT_NEAR(s[1].wait_ms, 20, 1e-9);
  EXPECT_NEAR(s[1].idle_fraction(), 0.2, 1e-12);
  EXPECT_EQ(to_string(s),
            "stage 0 (rank 0): idle 40% of 200.0 ms/step (compute 120.0 ms, waiting for neighbours 30.0 ms); "
            "the bubble (P-1)/(m+P-1) is 20% for P 2, m 4\n"
            "stage 1 (rank 1): idle 20% of 180.0 ms/step (compute 144.0 ms, waiting for neighbours 20.0 ms); "
            "the bubble (P-1)/(m+P-1) is 20% for P 2, m 4");
  EXPECT_TRUE(summarize_pipeline({}).empty());
  EXPECT_EQ(to_string(std::vector<PipelineStageSummary>{}), "");
  EXPECT_EQ(zb_costs_flag(s), "");  // 1F1B: no halves
  EXPECT_NEAR(s[1].forward_ms, 12, 1e-9);
}

// Zero bubble: the measured F, B and W of the stages after the first, as the flag that orders
// the lists at them (the first stage's W is its whole backward, so it does not count).
TEST(Timeline, ZeroBubbleSummaryGivesTheMeasuredCosts) {
  std::vector<TraceEvent> events;
  auto add = [&](int rank, const std::string& name, double ms, TraceArgs args) {
    TraceEvent e;
    e.rank = rank;
    e.name = name;
    e.cat = category::kCompute;
    e.dur_us = ms * 1000;
    e.args = std::move(args);
    events.push_back(e);
  };
  for (int rank = 0; rank < 3; ++rank) {
    add(rank, "step", 100, {{"accum_steps", 2}});
    for (int i = 0; i < 2; ++i) {
      const TraceArgs args = {{"stage", rank}, {"micro_batch", i}};
      add(rank, "forward", 10, args);
      add(rank, "backward input", rank == 0 ? 1 : 10 + 4 * i, args);  // B: 10 and 14 -> 12
      add(rank, "backward weight", rank == 0 ? 25 : 7, args);
    }
  }
  const std::vector<PipelineStageSummary> s = summarize_pipeline(events);
  ASSERT_EQ(s.size(), 3u);
  EXPECT_TRUE(s[1].zero_bubble);
  EXPECT_NEAR(s[1].backward_input_ms, 12, 1e-9);
  EXPECT_NEAR(s[2].backward_weight_ms, 7, 1e-9);
  EXPECT_EQ(zb_costs_flag(s), "--pp_zb_costs=1,1.2,0.7");
  EXPECT_NE(to_string(s).find("--pp_zb_costs=1,1.2,0.7 orders its lists at them"), std::string::npos) << to_string(s);
}

TEST(Timeline, OverlapSummaryMatchesClosedForm) {
  Timeline r0(true, 0), r1(true, 1);
  const auto t0 = Clock::now();
  record_steps(r0, t0, 0);
  record_steps(r1, t0, 1);

  const OverlapSummary s0 = summarize_overlap(r0.events());
  EXPECT_EQ(s0.ranks, 1);
  EXPECT_EQ(s0.steps, 3);
  EXPECT_NEAR(s0.comm_ms, 3 * 35.0, 1e-3);
  EXPECT_NEAR(s0.hidden_ms, 3 * 30.0, 1e-3);
  EXPECT_NEAR(s0.comm_ms_per_step(), 35.0, 1e-3);
  EXPECT_NEAR(s0.hidden_fraction(), 30.0 / 35.0, 1e-6);
  EXPECT_EQ(s0.to_string(),
            "communication 35.0 ms/step, 30.0 ms (86%) hidden behind backward (1 rank, 3 steps)");

  const OverlapSummary s1 = summarize_overlap(r1.events());
  EXPECT_NEAR(s1.comm_ms_per_step(), 20.0, 1e-3);
  EXPECT_NEAR(s1.hidden_ms, 0.0, 1e-3);

  // Both ranks through files: per-rank files, merged, read back.
  ScratchDir dir("tl_merge", /*create=*/true);
  r0.write(dir / "trace.rank0.json");
  r1.write(dir / "trace.rank1.json");
  merge_timelines({dir / "trace.rank0.json", dir / "trace.rank1.json"}, dir / "merged.json");
  const auto merged = read_timeline(dir / "merged.json");
  EXPECT_EQ(merged.size(), r0.events().size() + r1.events().size());
  const OverlapSummary both = summarize_overlap(merged);
  EXPECT_EQ(both.ranks, 2);
  EXPECT_EQ(both.steps, 3);
  EXPECT_NEAR(both.comm_ms_per_step(), (35.0 + 20.0) / 2, 1e-3);
  EXPECT_NEAR(both.hidden_ms_per_step(), 30.0 / 2, 1e-3);
  EXPECT_NEAR(both.hidden_fraction(), 30.0 / 55.0, 1e-6);

  // The merged file keeps each rank's process and lane names.
  const json j = parse_file(dir / "merged.json");
  std::set<std::string> processes;
  std::set<std::pair<int, std::string>> backward_rows;
  for (const auto& e : j["traceEvents"]) {
    if (e["ph"] == "M" && e["name"] == "process_name") processes.insert(e["args"]["name"]);
    if (e["ph"] == "M" && e["name"] == "thread_name" && e["args"]["name"] == "backward") {
      backward_rows.insert({e["pid"], "backward"});
    }
  }
  EXPECT_EQ(processes, (std::set<std::string>{"rank 0", "rank 1"}));
  EXPECT_EQ(backward_rows.size(), 2u);
  for (const auto& e : merged) {
    EXPECT_TRUE(e.rank == 0 || e.rank == 1);
    if (e.name == "backward") EXPECT_EQ(e.lane, "backward");
  }
}

TEST(Timeline, OverlapWithoutStepEventsCountsBackwardPasses) {
  Timeline t(true, 0);
  const auto t0 = Clock::now();
  // Two backward passes [0, 10) and [20, 30); communication [5, 25): 20 ms, 10 ms hidden.
  t.add_complete("backward", "compute", lane::kBackward, t0, t0 + milliseconds(10));
  t.add_complete("backward", "compute", lane::kBackward, t0 + milliseconds(20),
                 t0 + milliseconds(30));
  t.add_complete("allreduce", "comm", lane::kComm, t0 + milliseconds(5), t0 + milliseconds(25));
  const OverlapSummary s = summarize_overlap(t.events());
  EXPECT_EQ(s.steps, 2);
  EXPECT_NEAR(s.comm_ms, 20.0, 1e-3);
  EXPECT_NEAR(s.hidden_ms, 10.0, 1e-3);
  EXPECT_EQ(summarize_overlap({}).ranks, 0);
  EXPECT_EQ(summarize_overlap({}).hidden_fraction(), 0.0);
}

TEST(Timeline, MergeRejectsTwoFilesOfOneRank) {
  ScratchDir dir("tl_dup", /*create=*/true);
  Timeline a(true, 0), b(true, 0);
  a.add_instant("x", "y", lane::kMain, Clock::now());
  b.add_instant("x", "y", lane::kMain, Clock::now());
  a.write(dir / "a.json");
  b.write(dir / "b.json");
  const std::string what = error_of([&] {
    merge_timelines({dir / "a.json", dir / "b.json"}, dir / "m.json");
  });
  EXPECT_NE(what.find("rank 0"), std::string::npos) << what;
  EXPECT_NE(what.find("b.json"), std::string::npos) << what;
}

TEST(Timeline, BadPathsAreReportedAtStartUp) {
  ScratchDir dir("tl_bad", /*create=*/true);
  // With a path, the constructor creates the directory and an empty, valid trace at once.
  TimelineOptions o;
  o.enabled = true;
  o.path = dir / "sub/dir/trace.json";
  {
    Timeline t(o);
    const json j = parse_file(o.path);
    EXPECT_TRUE(j["traceEvents"].is_array());
    t.add_instant("x", "y", lane::kMain, Clock::now());
    t.write();
    EXPECT_EQ(read_timeline(o.path).size(), 1u);
  }
  std::ofstream(dir / "file") << "not a directory";
  o.path = dir / "file/trace.json";
  std::string what = error_of([&] { Timeline t(o); });
  EXPECT_NE(what.find(o.path), std::string::npos) << what;
  EXPECT_NE(what.find("--timeline"), std::string::npos) << what;
  o.path = "/proc/self/trace.json";  // no one may create files there, not even root
  what = error_of([&] { Timeline t(o); });
  EXPECT_NE(what.find(o.path), std::string::npos) << what;
  // Disabled: the path is not touched.
  o.enabled = false;
  Timeline off(o);
  what = error_of([&] { Timeline(true, 0).write(); });
  EXPECT_NE(what.find("path"), std::string::npos) << what;
  // Reading: a missing file and a file that is not JSON name the path.
  what = error_of([&] { read_timeline(dir / "missing.json"); });
  EXPECT_NE(what.find("missing.json"), std::string::npos) << what;
  std::ofstream(dir / "bad.json") << "{\"traceEvents\": [";
  what = error_of([&] { read_timeline(dir / "bad.json"); });
  EXPECT_NE(what.find("bad.json"), std::string::npos) << what;
}

TEST(Timeline, PathForRank) {
  EXPECT_EQ(timeline_path_for_rank("run/trace.json", 3, 4), "run/trace.rank3.json");
  EXPECT_EQ(timeline_path_for_rank("run/trace.json", 0, 1), "run/trace.json");
  EXPECT_EQ(timeline_path_for_rank("trace", 1, 2), "trace.rank1");
  EXPECT_EQ(timeline_path_for_rank("out.v2/trace", 1, 2), "out.v2/trace.rank1");
  EXPECT_EQ(timeline_path_for_rank("/tmp/.trace", 1, 2), "/tmp/.trace.rank1");
}

}  // namespace
}  // namespace dtrain::engine
