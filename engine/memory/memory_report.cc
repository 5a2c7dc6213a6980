#include "dtrain/engine/memory/memory_report.h"

#include <c10/core/impl/VirtualGuardImpl.h>
#include <c10/core/StorageImpl.h>

#include <algorithm>
#include <cstdio>
#include <iomanip>
#include <sstream>
#include <unordered_set>

#include "dtrain/engine/memory/memory.h"

namespace dtrain::engine {
namespace {


// Counts each storage once across calls sharing `seen`.
int64_t count_storages(const std::vector<at::Tensor>& tensors, const c10::Device* device,
                       std::unordered_set<const c10::StorageImpl*>& seen) {
  int64_t bytes = 0;
  for (const auto& t : tensors) {
    if (!t.defined() || !t.has_storage()) continue;
    if (device && t.device() != *device) continue;
    const c10::StorageImpl* storage = t.storage().unsafeGetStorageImpl();
    if (!seen.insert(storage).second) continue;
    bytes += static_cast<int64_t>(t.storage().nbytes());
  }
  return bytes;
}

// A device index of -1 means "the current one"; memory_stats() wants a concrete index.
c10::Device concrete(c10::Device device) {
  if (device.is_cuda() && !device.has_index()) {
    return c10::Device(c10::kCUDA, c10::impl::VirtualGuardImpl(c10::kCUDA).getDevice().index());
  }
  return device;
}

std::string mib(double mb) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.1f MiB", mb);
  return buf;
}

void add_row(std::ostringstream& os, const std::string& label, double measured,
             const std::map<std::string, double>& predicted, const std::string& key) {
  os << "  " << std::left << std::setw(48) << label << std::right << std::setw(12) << measured;
  if (!predicted.empty()) {
    auto it = predicted.find(key);
    os << std::setw(12);
    if (it != predicted.end()) {
      os << it->second;
    } else {
      os << "-";
    }
  }
  os << "\n";
}

}  // namespace

int64_t tensor_bytes(const std::vector<at::Tensor>& tensors) {
  std::unordered_set<const c10::StorageImpl*> seen;
  return count_storages(tensors, nullptr, seen);
}

int64_t tensor_bytes(const std::vector<at::Tensor>& tensors, c10::Device device) {
  std::unordered_set<const c10::StorageImpl*> seen;
  return count_storages(tensors, &device, seen);
}

double MemoryReport::total_mb() const {
  return parameters_mb + gradients_mb + optimizer_state_mb + activations_mb + other_mb +
         allocator_cache_mb + cuda_context_mb;
}

double MemoryReport::host_total_mb() const {
  return host_offload_mb + host_staging_mb + host_parameters_mb + host_gradients_mb + host_optimizer_state_mb;
}

MemoryReport build_memory_report(c10::Device device, const std::vector<at::Tensor>& params,
                                 const std::vector<at::Tensor>& grads,
                                 const std::vector<at::Tensor>& optimizer_state,
                                 double step_start_allocated_mb, double step_peak_mb,
                                 const std::map<std::string, double>& predicted, double step_gradients_mb) {
  device = concrete(device);
  MemoryReport r;
  r.device = device.str();
  r.predicted = predicted;
  std::unordered_set<const c10::StorageImpl*> seen;
  r.parameters_mb = count_storages(params, &device, seen) / kBytesPerMiB;
  r.gradients_mb = count_storages(grads, &device, seen) / kBytesPerMiB;
  r.optimizer_state_mb = count_storages(optimizer_state, &device, seen) / kBytesPerMiB;
  if (!device.is_cpu()) {  // layer offload's host side
    const c10::Device cpu(c10::kCPU);
    std::unordered_set<const c10::StorageImpl*> host_seen;
    r.host_parameters_mb = count_storages(params, &cpu, host_seen) / kBytesPerMiB;
    r.host_gradients_mb = count_storages(grads, &cpu, host_seen) / kBytesPerMiB;
    r.host_optimizer_state_mb = count_storages(optimizer_state, &cpu, host_seen) / kBytesPerMiB;
  }
  // Gradients made during the step and freed after it: at the step's peak they were there, but
  // not at its start (nor now).
  const double grads_now = r.gradients_mb;
  const double grads_made = std::max(0.0, step_gradients_mb - grads_now);
  if (grads_made > 0) {
    r.gradients_mb += grads_made;
    r.notes.push_back("the gradients (" + mib(grads_made) + ") are made during each step and freed after its update: "
                      "counted here as gradients at the step's peak, not as activations");
  }
  const double model_state = r.parameters_mb + grads_now + r.optimizer_state_mb;
  r.allocated_peak_mb = step_peak_mb;
  r.other_mb = step_start_allocated_mb - model_state;
  if (r.other_mb < 0) {
    r.notes.push_back("allocated at step start (" + mib(step_start_allocated_mb) +
                      ") was below parameters + gradients + optimizer state (" + mib(model_state) +
                      "): some of them were allocated during the step "
                      "(gradients set to None?); they are not counted as activations");
    r.other_mb = 0;
  }
  r.activations_mb = std::max(0.0, step_peak_mb - std::max(step_start_allocated_mb, model_state) - grads_made);
  if (step_peak_mb < model_state + grads_made) {
    r.notes.push_back(
        "the step's peak is below parameters + gradients + optimizer state: "
        "was the peak measured over the step (reset_peak_memory at its start)?");
  }

  if (device.is_cuda()) {
    r.reserved_mb = memory_stats(device).reserved_mb;
    r.allocator_cache_mb = std::max(0.0, r.reserved_mb - step_peak_mb);
    const GpuStatus gpu = gpu_status(device);
    if (!gpu.available) {
      r.notes.push_back("CUDA context not measured: " + gpu.error);
    } else if (gpu.process_used_mb < 0) {
      r.notes.push_back("CUDA context not measured: NVML does not list this process on " +
                        gpu.name + " (a container's PID namespace?)");
    } else {
      r.process_total_mb = gpu.process_used_mb;
      if (gpu.process_assumed) {
        r.notes.push_back(
            "NVML does not list this PID; the device's only process was taken "
            "to be this one");
      }
      r.cuda_context_mb = std::max(0.0, gpu.process_used_mb - r.reserved_mb);
    }
  } else if (device.is_cpu() && !cpu_memory_tracked()) {
    r.notes.push_back(
        "CPU memory is not tracked (call track_cpu_memory() at start-up): the "
        "figures given are the process's resident set, not tensor bytes");
  }
  return r;
}

std::string MemoryReport::to_string() const {
  std::ostringstream os;
  os << std::fixed << std::setprecision(1);
  os << "memory on " << device;
  if (step >= 0) os << " at step " << step;
  os << " (MiB)";
  const int title_width = static_cast<int>(os.str().size());
  os << std::right << std::setw(std::max(0, 50 - title_width + 12)) << "measured";
  if (!predicted.empty()) os << std::setw(12) << "predicted";
  os << "\n";
  const auto& p = predicted;
  add_row(os, "parameters", parameters_mb, p, "parameters");
  add_row(os, "gradients", gradients_mb, p, "gradients");
  add_row(os, "optimizer state", optimizer_state_mb, p, "optimizer_state");
  add_row(os, "activations (step peak - step start)", activations_mb, p, "activations");
  add_row(os, "other (batch, buffers, workspaces)", other_mb, p, "other");
  add_row(os, "= allocated at the step's peak", allocated_peak_mb, p, "allocated");
  if (reserved_mb > 0) {
    add_row(os, "allocator cache (reserved - peak)", allocator_cache_mb, p, "allocator_cache");
    add_row(os, "= reserved by the caching allocator", reserved_mb, p, "reserved");
  }
  if (process_total_mb > 0) {
    add_row(os, "CUDA context, NCCL, libraries (NVML - reserved)", cuda_context_mb, p,
            "cuda_context");
    add_row(os, "= this process on the device (NVML)", process_total_mb, p, "total");
  }
  if (host_offload_mb > 0) {
    add_row(os, "host: optimizer offload (master, state, buffers)", host_offload_mb, p, "host_offload");
  }
  if (host_parameters_mb > 0) add_row(os, "host: parameters (layer offload, pinned)", host_parameters_mb, p, "host_parameters");
  if (host_gradients_mb > 0) add_row(os, "host: gradients (layer offload)", host_gradients_mb, p, "host_gradients");
  if (host_optimizer_state_mb > 0) {
    add_row(os, "host: optimizer state (beside optimizer offload)", host_optimizer_state_mb, p, "host_optimizer_state");
  }
  if (host_staging_mb > 0) {
    add_row(os, "host: checkpoint staging (pinned, --async_save)", host_staging_mb, p, "host_staging");
  }
  for (const auto& note : notes) os << "  note: " << note << "\n";
  return os.str();
}

ActivationProbe::ActivationProbe(c10::Device device) : device_(concrete(device)) {}

void ActivationProbe::begin() {
  marks_.clear();
  reset_peak_memory(device_);
  start_allocated_mb_ = memory_stats(device_).allocated_mb;
}

void ActivationProbe::mark(const std::string& point) {
  const MemoryStats s = memory_stats(device_);
  marks_.push_back(Mark{point, s.allocated_mb, s.peak_mb});
}

double ActivationProbe::peak_mb() const {
  if (!marks_.empty()) return marks_.back().peak_mb;
  return memory_stats(device_).peak_mb;
}

}  // namespace dtrain::engine
