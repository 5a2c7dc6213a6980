// NVML, loaded at run time: device status for the memory report and the gpustat-like line.
#include <dlfcn.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <sstream>
#include <string>
#include <vector>

#include <c10/core/impl/VirtualGuardImpl.h>

#include "dtrain/engine/memory/memory_report.h"
#include "memory_limit_internal.h"

namespace dtrain::engine {
namespace {

// The calling thread's current CUDA device (dist::select_device sets it to this rank's GPU).
int current_cuda_device() { return c10::impl::VirtualGuardImpl(c10::kCUDA).getDevice().index(); }

// The few NVML declarations used (nvml.h, stable ABI); the header is not needed to build.
using nvmlReturn_t = int;
using nvmlDevice_t = struct nvmlDevice_st*;
constexpr nvmlReturn_t kNvmlSuccess = 0;
constexpr int kNvmlTemperatureGpu = 0;
constexpr unsigned long long kNvmlValueNotAvailable = ~0ull;
struct NvmlUtilization {
  unsigned int gpu, memory;
};
struct NvmlMemory {
  unsigned long long total, free, used;
};
struct NvmlProcessInfoV1 {  // nvmlDeviceGetComputeRunningProcesses (v1)
  unsigned int pid;
  unsigned long long used_gpu_memory;
};
struct NvmlProcessInfoV2 {  // _v2 and _v3: nvmlProcessInfo_t
  unsigned int pid;
  unsigned long long used_gpu_memory;
  unsigned int gpu_instance_id, compute_instance_id;
};

struct Nvml {
  std::string error;  // empty when loaded and initialized
  nvmlReturn_t (*init)() = nullptr;
  nvmlReturn_t (*by_index)(unsigned int, nvmlDevice_t*) = nullptr;
  nvmlReturn_t (*by_uuid)(const char*, nvmlDevice_t*) = nullptr;
  nvmlReturn_t (*by_pci_bus_id)(const char*, nvmlDevice_t*) = nullptr;
  nvmlReturn_t (*index_of)(nvmlDevice_t, unsigned int*) = nullptr;
  nvmlReturn_t (*name)(nvmlDevice_t, char*, unsigned int) = nullptr;
  nvmlReturn_t (*utilization)(nvmlDevice_t, NvmlUtilization*) = nullptr;
  nvmlReturn_t (*memory)(nvmlDevice_t, NvmlMemory*) = nullptr;
  nvmlReturn_t (*temperature)(nvmlDevice_t, int, unsigned int*) = nullptr;
  nvmlReturn_t (*power)(nvmlDevice_t, unsigned int*) = nullptr;
  nvmlReturn_t (*processes_v2)(nvmlDevice_t, unsigned int*, NvmlProcessInfoV2*) = nullptr;
  nvmlReturn_t (*processes_v1)(nvmlDevice_t, unsigned int*, NvmlProcessInfoV1*) = nullptr;
};

template <typename F>
void bind(void* lib, const char* symbol, F& fn) {
  fn = reinterpret_cast<F>(dlsym(lib, symbol));
}

// Loaded and initialized once; the library stays loaded for the life of the process.
const Nvml& nvml() {
  static const Nvml instance = [] {
    Nvml n;
    void* lib = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
      n.error = "libnvidia-ml.so.1 could not be loaded: no NVIDIA driver here?";
      return n;
    }
    bind(lib, "nvmlInit_v2", n.init);
    bind(lib, "nvmlDeviceGetHandleByIndex_v2", n.by_index);
    bind(lib, "nvmlDeviceGetHandleByUUID", n.by_uuid);
    bind(lib, "nvmlDeviceGetHandleByPciBusId_v2", n.by_pci_bus_id);
    bind(lib, "nvmlDeviceGetIndex", n.index_of);
    bind(lib, "nvmlDeviceGetName", n.name);
    bind(lib, "nvmlDeviceGetUtilizationRates", n.utilization);
    bind(lib, "nvmlDeviceGetMemoryInfo", n.memory);
    bind(lib, "nvmlDeviceGetTemperature", n.temperature);
    bind(lib, "nvmlDeviceGetPowerUsage", n.power);
    bind(lib, "nvmlDeviceGetComputeRunningProcesses_v2", n.processes_v2);
    bind(lib, "nvmlDeviceGetComputeRunningProcesses", n.processes_v1);
    if (!n.init || !n.by_index || !n.memory) {
      n.error = "libnvidia-ml.so.1 lacks nvmlInit_v2/nvmlDeviceGetHandleByIndex_v2";
    } else if (const nvmlReturn_t rc = n.init(); rc != kNvmlSuccess) {
      n.error = "nvmlInit failed with NVML error " + std::to_string(rc);
    }
    return n;
  }();
  return instance;
}

// The NVML handle of CUDA device `index`: by its PCI bus id (NVML numbers GPUs in PCI order,
// CUDA by default fastest first), else through CUDA_VISIBLE_DEVICES when it is set.
bool device_handle(const Nvml& n, int index, nvmlDevice_t* handle, int* nvml_index,
                   std::string* error) {
  if (n.by_pci_bus_id) {
    const std::string bus_id = detail::cuda_pci_bus_id(index);
    unsigned int found = 0;
    if (!bus_id.empty() && n.by_pci_bus_id(bus_id.c_str(), handle) == kNvmlSuccess) {
      *nvml_index = n.index_of && n.index_of(*handle, &found) == kNvmlSuccess
                        ? static_cast<int>(found)
                        : index;
      return true;
    }
  }
  std::vector<std::string> visible;
  if (const char* env = std::getenv("CUDA_VISIBLE_DEVICES")) {
    std::stringstream ss(env);
    for (std::string item; std::getline(ss, item, ',');) visible.push_back(item);
  }
  *nvml_index = index;
  if (index < static_cast<int>(visible.size())) {
    const std::string& id = visible[index];
    if (!id.empty() && std::isdigit(static_cast<unsigned char>(id[0]))) {
      *nvml_index = std::atoi(id.c_str());
    } else if (n.by_uuid) {
      if (n.by_uuid(id.c_str(), handle) == kNvmlSuccess) return true;
      *error = "NVML does not know the device '" + id + "' of CUDA_VISIBLE_DEVICES";
      return false;
    }
  }
  if (n.by_index(static_cast<unsigned int>(*nvml_index), handle) != kNvmlSuccess) {
    *error = "NVML has no device " + std::to_string(*nvml_index);
    return false;
  }
  return true;
}

// This process's memory on the device (-1: unknown). A PID namespace (containers) hides our
// PID from NVML: then a device with exactly one process is taken to be ours (*assumed).
template <typename Info>
bool find_process(nvmlReturn_t (*query)(nvmlDevice_t, unsigned int*, Info*), nvmlDevice_t handle,
                  double* used_mb, bool* assumed) {
  constexpr unsigned int kMax = 256;
  std::vector<Info> infos(kMax);
  unsigned int count = kMax;
  if (!query || query(handle, &count, infos.data()) != kNvmlSuccess) return false;
  const auto self = static_cast<unsigned int>(getpid());
  const Info* found = nullptr;
  for (unsigned int i = 0; i < std::min(count, kMax); ++i) {
    if (infos[i].pid == self) found = &infos[i];
  }
  if (!found && count == 1) {
    found = &infos[0];
    *assumed = true;
  }
  if (found && found->used_gpu_memory != kNvmlValueNotAvailable) {
    *used_mb = found->used_gpu_memory / (1024.0 * 1024.0);
  }
  return true;
}

}  // namespace

GpuStatus gpu_status(c10::Device device) {
  GpuStatus s;
  if (!device.is_cuda()) {
    s.error = "not a CUDA device: " + device.str();
    return s;
  }
  const Nvml& n = nvml();
  if (!n.error.empty()) {
    s.error = n.error;
    return s;
  }
  nvmlDevice_t handle = nullptr;
  if (!device_handle(n, device.has_index() ? device.index() : current_cuda_device(), &handle, &s.nvml_index,
                     &s.error)) {
    return s;
  }
  s.available = true;
  char name[96] = {};
  if (n.name && n.name(handle, name, sizeof name) == kNvmlSuccess) s.name = name;
  NvmlUtilization util{};
  if (n.utilization && n.utilization(handle, &util) == kNvmlSuccess) s.utilization_pct = util.gpu;
  NvmlMemory mem{};
  if (n.memory(handle, &mem) == kNvmlSuccess) {
    s.memory_used_mb = mem.used / (1024.0 * 1024.0);
    s.memory_total_mb = mem.total / (1024.0 * 1024.0);
  }
  unsigned int value = 0;
  if (n.temperature && n.temperature(handle, kNvmlTemperatureGpu, &value) == kNvmlSuccess) {
    s.temperature_c = value;
  }
  if (n.power && n.power(handle, &value) == kNvmlSuccess) s.power_w = value / 1000.0;
  if (!find_process(n.processes_v2, handle, &s.process_used_mb, &s.process_assumed)) {
    find_process(n.processes_v1, handle, &s.process_used_mb, &s.process_assumed);
  }
  return s;
}

std::string gpu_summary_line(c10::Device device) {
  if (!device.is_cuda()) return "";
  const GpuStatus s = gpu_status(device);
  if (!s.available) return "NVML not available (" + s.error + ")";
  std::string line = "[" + std::to_string(s.nvml_index) + "] " + s.name;
  // One field when its value is known (>= 0).
  auto field = [&line](const char* format, double value) {
    if (value < 0) return;
    char buf[96];
    std::snprintf(buf, sizeof buf, format, value);
    line += buf;
  };
  field(" | %.0f°C", s.temperature_c);
  field(", %3.0f %%", s.utilization_pct);
  field(" | %.0f", s.memory_used_mb);
  field(" / %.0f MB", s.memory_total_mb);
  field(" | %.0f W", s.power_w);
  field(" | this process %.0f MB", s.process_used_mb);
  return line;
}

}  // namespace dtrain::engine
