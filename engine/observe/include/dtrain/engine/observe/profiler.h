// Operator- and kernel-level profiles of chosen steps, through libtorch's Kineto profiler (the
// engine under Python's torch.profiler): every ATen operator on the CPU with its thread, and on
// CUDA every kernel, copy and memset on its stream, written as a Chrome trace that Perfetto,
// chrome://tracing and TensorBoard's profiler plugin open. Each profiled step is a range named
// "dtrain step N". The timeline (timeline.h) shows dtrain's own phases on every step at no
// cost; this shows what the device did inside them, at a profiler's cost, for a few steps.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include <c10/core/Device.h>

namespace dtrain::engine {

struct ProfileSteps {
  int64_t first = 0;  // 1-based, inclusive; 0: off
  int64_t last = 0;
  bool enabled() const { return first > 0; }
};

// "N" or "A-B" (1 <= A <= B); "" is off. Throws dtrain::Error naming the text otherwise.
ProfileSteps parse_profile_steps(const std::string& text);
// The same for any flag that takes steps (named in the message).
ProfileSteps parse_step_range(const std::string& text, const std::string& flag);

// Drives the profiler around a training loop's steps:
//   profiler.begin_step(k); ...the step's work...; profiler.end_step(k);
// begin_step(first) starts profiling; end_step(last) waits for the device, stops and writes the
// trace to `path` (through a temporary file and a rename). A profiler that is destroyed while
// still profiling (the loop ended early) writes what it has. One per process at a time (Kineto
// is process-wide); the step ranges cover the calling thread and the threads it hands work to
// (autograd's backward threads inherit the profiler).
class StepProfiler {
 public:
  StepProfiler(ProfileSteps steps, std::string path, c10::Device device);
  ~StepProfiler();
  StepProfiler(const StepProfiler&) = delete;
  StepProfiler& operator=(const StepProfiler&) = delete;

  void begin_step(int64_t step);
  void end_step(int64_t step);
  bool active() const { return active_; }

 private:
  void stop_and_write();

  ProfileSteps steps_;
  std::string path_;
  c10::Device device_;
  bool active_ = false;
  struct StepRange;
  std::unique_ptr<StepRange> range_;  // the "dtrain step N" range of the step running
};

}  // namespace dtrain::engine

#include "dtrain/dist/glog_compat.h"  // last: keeps glog's LOG macros whatever the include order
