// Memory figures of a device, for metrics and reports.
#pragma once

#include <c10/core/Device.h>

namespace dtrain::engine {

// Bytes in a MiB (the unit of the memory figures here and in the planner).
inline constexpr double kBytesPerMiB = 1024.0 * 1024.0;

struct MemoryStats {
  double allocated_mb = 0;  // bytes in live tensors (CPU: with tracking on; else the RSS)
  double peak_mb = 0;       // peak of allocated since the last reset (>= allocated_mb)
  double reserved_mb = 0;   // CUDA: held by the caching allocator; CPU: the resident set size
  // The live tensors' own bytes: on CUDA without the caching allocator's rounding (a cached
  // block reused whole counts whole in allocated_mb); elsewhere allocated_mb.
  double requested_mb = 0;
  // Which counter allocated/peak show: "cuda allocator", "cpu tensors" (the counting CPU
  // allocator) or "process rss" (CPU tracking off). The metrics carry it as mem_counter.
  const char* counter = "";
};

// Wraps ATen's CPU allocator so CPU tensor memory is counted exactly (current and peak), as
// the CUDA caching allocator counts device memory. The engine library does this when it is
// loaded (before a program builds its model), unless DTRAIN_TRACK_CPU_MEMORY=0; calling it
// again is a no-op. Tensors allocated before are not counted. Thread-safe; costs a few atomic
// operations per allocation.
void track_cpu_memory();
bool cpu_memory_tracked();

// Synchronous, cheap (no device sync). Thread-safe.
MemoryStats memory_stats(c10::Device device);
// Starts a new peak window (CUDA; a no-op on the CPU, whose peak RSS cannot be reset).
void reset_peak_memory(c10::Device device);
// Returns cached, unused device memory to the driver (CUDA; no-op on the CPU).
void release_cached_memory(c10::Device device);

}  // namespace dtrain::engine

#include "dtrain/dist/glog_compat.h"  // last: keeps glog's LOG macros whatever the include order
