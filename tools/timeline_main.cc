// dtrain-timeline: merges per-rank timeline files and prints how much communication was
// hidden behind backward (and, for a pipeline-parallel run, each stage's idle share of a step).
//
//   dtrain-timeline merge OUT.json trace.rank0.json trace.rank1.json ...
//   dtrain-timeline summary trace.json [more.json ...]
#include <cstdio>
#include <string>
#include <vector>

#include "dtrain/dist/error.h"
#include "dtrain/engine/observe/timeline.h"

namespace {

constexpr char kUsage[] =
    "usage:\n"
    "  dtrain-timeline merge OUT.json IN.json [IN.json ...]   one file, one process per rank\n"
    "  dtrain-timeline summary FILE.json [FILE.json ...]      communication hidden behind "
    "backward; with optimizer offload, the host work after backward and the CPU updates' overlap\n";

int summary(const std::vector<std::string>& files) {
  std::vector<dtrain::engine::TraceEvent> events;
  for (const auto& f : files) {
    auto more = dtrain::engine::read_timeline(f);
    events.insert(events.end(), more.begin(), more.end());
  }
  std::printf("%s\n", dtrain::engine::summarize_overlap(events).to_string().c_str());
  const std::string offload = dtrain::engine::summarize_offload(events).to_string();
  if (!offload.empty()) std::printf("%s\n", offload.c_str());
  const std::string stages = dtrain::engine::to_string(dtrain::engine::summarize_pipeline(events));
  if (!stages.empty()) std::printf("%s\n", stages.c_str());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const std::vector<std::string> args(argv + 1, argv + argc);
  try {
    if (args.size() >= 3 && args[0] == "merge") {
      const std::vector<std::string> inputs(args.begin() + 2, args.end());
      dtrain::engine::merge_timelines(inputs, args[1]);
      return summary({args[1]});
    }
    if (args.size() >= 2 && args[0] == "summary") {
      return summary(std::vector<std::string>(args.begin() + 1, args.end()));
    }
  } catch (const dtrain::Error& e) {
    std::fprintf(stderr, "dtrain-timeline: %s\n", e.what());
    return dtrain::kExitUsage;
  }
  std::fputs(kUsage, stderr);
  return dtrain::kExitUsage;
}
