// Where a device's memory goes during a training step, as a table that adds up:
//
//   parameters + gradients + optimizer state + activations + other = allocated at the peak
//   + allocator cache                                               = reserved (CUDA)
//   + CUDA context, NCCL and libraries                              = process total (NVML)
//
// and a one-line GPU status (utilization, memory, temperature, power) like gpustat, through
// NVML loaded at run time (dlopen("libnvidia-ml.so.1"); no link-time dependency).
// Sizes are MiB (2^20 bytes), as memory_stats().
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace dtrain::engine {

struct MemoryReport {
  std::string device;  // "cuda:0", "cpu"
  int64_t step = -1;   // the step measured (shown in the title when >= 0)

  // Components.
  double parameters_mb = 0;
  double gradients_mb = 0;        // storages not already counted as parameters
  double optimizer_state_mb = 0;  // storages not already counted above
  double activations_mb = 0;      // peak - max(allocated at step start, params + grads + state)
  double other_mb = 0;            // allocated at step start beyond params + grads + state:
                                  // the batch, buffers, loss scaler, workspaces, ...
  double allocator_cache_mb = 0;  // CUDA: reserved - peak (held by the caching allocator)
  double cuda_context_mb = 0;     // CUDA with NVML: process total - reserved (context, NCCL,
                                  // cuBLAS/cuDNN handles outside the allocator); else 0

  // The measured figures the components add up to.
  double allocated_peak_mb = 0;  // the allocator's peak of allocated bytes during the step
  double reserved_mb = 0;        // CUDA: the caching allocator's reserved bytes (else 0)
  double process_total_mb = 0;   // NVML: this process's device memory (0: unknown)

  // Host memory of optimizer offload (pinned pool: fp32 master weights, optimizer state,
  // gradient and copy-back buffers); shown in a row of its own after the device's total,
  // when > 0. Not part of total_mb() (another memory, except on a CPU device, where the
  // allocator figures already include it).
  double host_offload_mb = 0;
  // Pinned host buffers that a background checkpoint save keeps for reuse (HostStaging: about
  // the size of the device-resident weights and optimizer state, from the first save on).
  double host_staging_mb = 0;
  // On a device other than the CPU, what lives in host memory beside it (layer offload): the
  // parameters, gradients and optimizer state tensors on the CPU (storages not counted above;
  // the optimizer's state outside host_offload_mb, e.g. the streamed blocks' own optimizer and
  // the delayed update's second weight buffer). Rows of their own after the device's total.
  double host_parameters_mb = 0;
  double host_gradients_mb = 0;
  double host_optimizer_state_mb = 0;
  // The host rows together: offload, staging, parameters, gradients, optimizer state.
  double host_total_mb() const;
  std::vector<std::string> notes;  // caveats: NVML missing, CPU memory untracked, ...
  // What a planner predicted, by key: "parameters", "gradients", "optimizer_state",
  // "activations", "other", "allocated", "allocator_cache", "reserved", "cuda_context",
  // "total". Shown in a second column where present.
  std::map<std::string, double> predicted;

  // Sum of the components: the process total when NVML knows it, else reserved (CUDA) or
  // the allocated peak (CPU).
  double total_mb() const;
  // A table with one row per component and subtotal, measured and predicted, then notes.
  std::string to_string() const;
};

// Bytes of the storages behind tensors, each storage counted once (views of one flat
// buffer count the whole buffer once); undefined tensors and tensors without storage are
// skipped. With a device: only tensors on that device. Pure; no device sync.
int64_t tensor_bytes(const std::vector<at::Tensor>& tensors);
int64_t tensor_bytes(const std::vector<at::Tensor>& tensors, c10::Device device);

// Builds the report for a step measured as: step_start_allocated_mb = memory_stats().
// allocated_mb at the start of forward (after the previous step's optimizer and zero_grad,
// so gradients and optimizer state are already allocated), step_peak_mb = memory_stats().
// peak_mb after backward, with reset_peak_memory() at the start (ActivationProbe does
// both). Only tensors on `device` are counted in the device's rows; with a device other than
// the CPU, the tensors on the CPU go to the host rows (host_parameters_mb, ...). A storage
// shared by two lists counts in the first (parameters, then gradients, then optimizer
// state); cuda without an index is
// cuda:0. Reads memory_stats() for
// reserved and NVML for the process total (CUDA). Synchronous, no device sync.
// step_gradients_mb (>= 0): the gradients' bytes on `device` at the end of the step's backward,
// when they may be freed before the report (a lone rank's trainer drops them after the update):
// then they are counted as gradients at the step's peak, not as activations, and a note says so.
MemoryReport build_memory_report(c10::Device device, const std::vector<at::Tensor>& params,
                                 const std::vector<at::Tensor>& grads,
                                 const std::vector<at::Tensor>& optimizer_state,
                                 double step_start_allocated_mb, double step_peak_mb,
                                 const std::map<std::string, double>& predicted = {},
                                 double step_gradients_mb = -1);

// Records allocated memory at named points of a step and the peak since begin():
//   probe.begin();  forward...  probe.mark("forward");  backward...  probe.mark("backward");
//   build_memory_report(device, ..., probe.start_allocated_mb(), probe.peak_mb());
// begin() resets the device's peak counter (reset_peak_memory()): do not nest probes or mix
// them with other peak measurements of the same device. On the CPU the peak is exact only
// with track_cpu_memory(). Not thread-safe; no device sync.
class ActivationProbe {
 public:
  struct Mark {
    std::string point;
    double allocated_mb = 0;  // at the mark
    double peak_mb = 0;       // the peak between begin() and the mark
  };
  // device: the one to measure (cuda without an index: cuda:0).
  explicit ActivationProbe(c10::Device device);
  void begin();
  void mark(const std::string& point);
  double start_allocated_mb() const { return start_allocated_mb_; }
  // The peak since begin(), as of the last mark() (or now, when there is none).
  double peak_mb() const;
  double activations_mb() const { return peak_mb() - start_allocated_mb_; }
  const std::vector<Mark>& marks() const { return marks_; }

 private:
  c10::Device device_;
  double start_allocated_mb_ = 0;
  std::vector<Mark> marks_;
};

// ---- GPU status through NVML --------------------------------------------------------------

struct GpuStatus {
  bool available = false;  // NVML loaded and the device found; else `error` says why
  std::string error;
  int nvml_index = -1;  // the device as NVML numbers it (after CUDA_VISIBLE_DEVICES)
  std::string name;
  double utilization_pct = -1;  // -1: NVML could not say
  double memory_used_mb = 0;    // whole device, every process
  double memory_total_mb = 0;
  double temperature_c = -1;
  double power_w = -1;
  double process_used_mb = -1;  // this process's memory on the device; -1: unknown
  // NVML did not list this PID (a container's PID namespace) and the device's only process
  // was taken to be this one.
  bool process_assumed = false;
};

// Queries NVML for a CUDA device (no index: cuda:0). Maps the CUDA index to
// NVML's through CUDA_VISIBLE_DEVICES (indices or GPU-/MIG- UUIDs). Thread-safe; loads and
// initializes NVML once per process; never throws (failures are in `error`).
GpuStatus gpu_status(c10::Device device);
// One line like gpustat: "[0] NVIDIA H100 80GB HBM3 | 61°C, 87 % | 35210 / 81559 MB |
// 312 W | this process 30112 MB". "NVML not available (<why>)" when NVML cannot be used;
// "" for a non-CUDA device.
std::string gpu_summary_line(c10::Device device);

}  // namespace dtrain::engine

#include "dtrain/dist/glog_compat.h"  // last: keeps glog's LOG macros whatever the include order
