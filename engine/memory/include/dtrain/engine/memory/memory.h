// Memory figures of a device, for metrics and reports.
#pragma once

#include <c10/core/Device.h>

namespace dtrain::engine {

struct MemoryStats {
  double allocated_mb = 0;  // bytes in live tensors (CPU: with tracking on; else the RSS)
  double peak_mb = 0;       // peak of allocated since the last reset (CPU untracked: peak RSS)
  double reserved_mb = 0;   // CUDA: held by the caching allocator; CPU: the resident set size
};

// Wraps ATen's CPU allocator so CPU tensor memory is counted exactly (current and peak), as
// the CUDA caching allocator counts device memory. Call once, early (tensors allocated before
// are not counted). Thread-safe; costs a few atomic operations per allocation.
void track_cpu_memory();
bool cpu_memory_tracked();

// Synchronous, cheap (no device sync). Thread-safe.
MemoryStats memory_stats(c10::Device device);
// Starts a new peak window (CUDA; a no-op on the CPU, whose peak RSS cannot be reset).
void reset_peak_memory(c10::Device device);
// Returns cached, unused device memory to the driver (CUDA; no-op on the CPU).
void release_cached_memory(c10::Device device);

}  // namespace dtrain::engine
