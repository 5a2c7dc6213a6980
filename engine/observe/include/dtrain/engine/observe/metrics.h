// Training metrics: the JSON-lines file of docs/ARCHITECTURE.md (every field: docs/API.md) and the console progress.
#pragma once

#include <cstdio>
#include <map>
#include <memory>
#include <optional>
#include <string>

namespace dtrain::engine {

// One logged step. Fields that are unset are left out of the JSON object.
struct StepMetrics {
  int64_t step = 0;
  double loss = 0;
  double lr = 0;
  double step_ms = 0;
  double samples_per_s = 0;
  double mem_allocated_mb = 0;
  double mem_peak_mb = 0;
  std::string mem_counter;  // what the two show: "cuda allocator", "cpu tensors" or "process rss"
  std::optional<double> tokens_per_s;
  std::optional<double> loss_scale;
  std::optional<double> grad_norm;
  std::optional<double> eval_loss;
  std::optional<int> accum_steps;
  std::map<std::string, double> extra;  // anything else worth a column
};

// Writes one JSON object per line to a file (rank 0 only: construct with enabled=false
// elsewhere). The file is created (truncated) at construction, so an unwritable path is
// reported at start-up as dtrain::Error; each line is flushed as it is written.
// Not thread-safe.
class MetricsWriter {
 public:
  MetricsWriter(const std::string& path, bool enabled);
  ~MetricsWriter();
  void write(const StepMetrics& m);
  // Appends instead of truncating (resuming a run).
  static std::unique_ptr<MetricsWriter> open_append(const std::string& path, bool enabled);
  // A run that resumed from its checkpoint of `step`: drops the file's lines of later steps
  // (what an earlier process logged after that checkpoint before it was stopped), so the file
  // keeps one line per step, and appends after the rest. The file is rewritten through a
  // temporary file and a rename: a crash leaves the old file or the new one, never a mix.
  // Lines that are not JSON objects with a "step" are kept. dtrain::Error on I/O failure.
  void keep_through_step(int64_t step);

 private:
  MetricsWriter() = default;
  std::FILE* file_ = nullptr;
  std::string path_;
};

// Serializes one step as a JSON object (no newline).
std::string to_json(const StepMetrics& m);

// Console output on rank 0: a progress bar redrawn in place when stdout is a terminal,
// plain lines otherwise.
class Progress {
 public:
  Progress(int64_t total_steps, bool enabled);
  void update(const StepMetrics& m);
  void finish();

 private:
  int64_t total_;
  bool enabled_;
  bool tty_;
};

}  // namespace dtrain::engine

#include "dtrain/dist/glog_compat.h"  // last: keeps glog's LOG macros whatever the include order
