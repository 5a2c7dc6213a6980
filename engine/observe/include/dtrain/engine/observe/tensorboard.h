// TensorBoard event files written from C++: `tensorboard --logdir DIR` shows the scalars.
//
// Format: TensorBoard's own. A file named events.out.tfevents.<unix seconds>.<host>.<pid>.<n>
// holds TFRecords (uint64 length, masked CRC32C of the length, an Event protobuf, masked
// CRC32C of the data); the first Event carries file_version "brain.Event:2", each scalar is
// Event{wall_time, step, summary{value{tag, simple_value}}}.
#pragma once

#include "dtrain/engine/core/crc32c.h"

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <optional>
#include <string>
#include <string_view>

#include "dtrain/engine/observe/metrics.h"

namespace dtrain::engine {

// Writes one TensorBoard events file into a directory (rank 0 only: construct with
// enabled=false elsewhere, and every call is a no-op that touches no file).
//
// Failure: the constructor creates the directory when missing and writes the file's first
// record, so a directory that cannot be created or written is reported at start-up, as a
// dtrain::Error naming the directory. A later write or flush that fails (disk full) throws
// dtrain::Error naming the file. The destructor flushes and closes; it logs a failure and
// never throws.
// Durability: records are buffered; flush() hands them to the OS. TensorBoard reads a file
// while it grows, so flush once per logged step (add_metrics() does).
// Threading: not thread-safe; one thread (the training loop's) writes.
class EventWriter {
 public:
  EventWriter(const std::string& dir, bool enabled);
  ~EventWriter();
  EventWriter(const EventWriter&) = delete;
  EventWriter& operator=(const EventWriter&) = delete;

  // One scalar point. wall_time: seconds since the Unix epoch (now when not given). The
  // value is stored as float32, as TensorBoard's simple_value. Buffered (see flush()).
  void add_scalar(const std::string& tag, int64_t step, double value,
                  std::optional<double> wall_time = std::nullopt);
  // A text entry (TensorBoard's Text tab; markdown), e.g. the run's configuration.
  void add_text(const std::string& tag, int64_t step, const std::string& text,
                std::optional<double> wall_time = std::nullopt);
  // The scalars of one logged step, then flush(). Tags (unset optional fields are skipped):
  //   train/loss, train/lr, train/loss_scale, train/grad_norm, eval/loss,
  //   perf/step_ms, perf/samples_per_s, perf/tokens_per_s,
  //   memory/allocated_mb, memory/peak_mb, and extra/<key> for each entry of m.extra.
  void add_metrics(const StepMetrics& m, std::optional<double> wall_time = std::nullopt);
  // A run that resumes at `step` (its checkpoint is of step - 1): a SessionLog START event,
  // on which TensorBoard's readers drop every point of step >= `step` that an earlier process
  // wrote into this directory (the steps it logged after that checkpoint and before it was
  // stopped), so each step keeps one point, this run's. Flushed.
  void add_resume(int64_t step);
  void flush();

  bool enabled() const { return file_ != nullptr; }
  // The events file ("" when disabled).
  const std::string& path() const { return path_; }

 private:
  void write_record(const std::string& data);
  std::string path_;
  std::FILE* file_ = nullptr;
};

// ---- TFRecord framing (public for tests and tools) ----------------------------------------

// TFRecord's mask: ((crc >> 15) | (crc << 17)) + 0xa282ead8.
uint32_t mask_crc32c(uint32_t crc);
// One TFRecord: length (uint64 little-endian), masked CRC of the length, data, masked CRC of
// the data.
std::string tfrecord_frame(std::string_view data);

}  // namespace dtrain::engine

#include "dtrain/dist/glog_compat.h"  // last: keeps glog's LOG macros whatever the include order
