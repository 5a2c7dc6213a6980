#include "dtrain/engine/memory/memory.h"

#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstdio>
#include <mutex>
#include <string>

#include <c10/core/CPUAllocator.h>

#include <ATen/Context.h>
#include <c10/core/CachingDeviceAllocator.h>
#include <c10/core/impl/VirtualGuardImpl.h>

namespace dtrain::engine {
namespace {


double rss_mb() {
  long pages = 0, resident = 0;
  FILE* f = std::fopen("/proc/self/statm", "r");
  if (!f) return 0;
  int n = std::fscanf(f, "%ld %ld", &pages, &resident);
  std::fclose(f);
  return n == 2 ? resident * static_cast<double>(sysconf(_SC_PAGESIZE)) / kBytesPerMiB : 0;
}

double peak_rss_mb() {
  struct rusage usage {};
  getrusage(RUSAGE_SELF, &usage);
  return usage.ru_maxrss / 1024.0;  // kilobytes on Linux
}

// Counts live bytes of the CPU allocator it wraps. Each block carries a 64-byte header with
// its size, so raw_allocate/raw_deleter work as well as allocate().
class CountingCpuAllocator final : public c10::Allocator {
 public:
  explicit CountingCpuAllocator(c10::Allocator* inner) : inner_(inner) {}

  c10::DataPtr allocate(size_t n) override {
    void* base = inner_->raw_allocate(n + kHeader);
    *static_cast<size_t*>(base) = n;
    add(static_cast<int64_t>(n));
    void* data = static_cast<char*>(base) + kHeader;
    return {data, data, &CountingCpuAllocator::release, c10::Device(c10::kCPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &CountingCpuAllocator::release; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }

  static void release(void* data) {
    if (!data) return;
    void* base = static_cast<char*>(data) - kHeader;
    instance->add(-static_cast<int64_t>(*static_cast<size_t*>(base)));
    instance->inner_->raw_deallocate(base);
  }

  void add(int64_t delta) {
    int64_t now = current_.fetch_add(delta) + delta;
    int64_t peak = peak_.load();
    while (now > peak && !peak_.compare_exchange_weak(peak, now)) {
    }
  }

  static constexpr size_t kHeader = 64;  // keeps 64-byte alignment
  static CountingCpuAllocator* instance;
  c10::Allocator* inner_;
  std::atomic<int64_t> current_{0};
  std::atomic<int64_t> peak_{0};
};
CountingCpuAllocator* CountingCpuAllocator::instance = nullptr;
std::once_flag install_once;

}  // namespace

void track_cpu_memory() {
  std::call_once(install_once, [] {
    // Leaked on purpose: tensors freed at exit still call into it.
    CountingCpuAllocator::instance = new CountingCpuAllocator(c10::GetCPUAllocator());
    c10::SetCPUAllocator(CountingCpuAllocator::instance, /*priority=*/100);
  });
}

bool cpu_memory_tracked() { return CountingCpuAllocator::instance != nullptr; }

namespace {

// On by default, from library load: counted CPU figures are what the metrics, the memory report
// and the planner need, and the process's resident set (the fallback) says little about tensors.
const bool g_tracked_at_load = [] {
  const char* off = std::getenv("DTRAIN_TRACK_CPU_MEMORY");
  if (!off || std::string(off) != "0") track_cpu_memory();
  return true;
}();

}  // namespace

namespace {

// The CUDA caching allocator throws ("did you call init?") when asked for statistics before
// CUDA is initialized in this process (no CUDA tensor yet): initialize it first.
c10::DeviceAllocator* cuda_allocator() {
  at::globalContext().lazyInitDevice(c10::kCUDA);
  return c10::getDeviceAllocator(c10::kCUDA);
}

// A CUDA device without an index means the current one.
c10::DeviceIndex cuda_index(c10::Device device) {
  return device.has_index() ? device.index()
                            : c10::impl::VirtualGuardImpl(c10::kCUDA).getDevice().index();
}

}  // namespace

MemoryStats memory_stats(c10::Device device) {
  MemoryStats s;
  if (device.is_cuda()) {
    auto stats = cuda_allocator()->getDeviceStats(cuda_index(device));
    const auto all = static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE);
    s.allocated_mb = stats.allocated_bytes[all].current / kBytesPerMiB;
    s.peak_mb = stats.allocated_bytes[all].peak / kBytesPerMiB;
    s.reserved_mb = stats.reserved_bytes[all].current / kBytesPerMiB;
    s.requested_mb = stats.requested_bytes[all].current / kBytesPerMiB;
    s.counter = "cuda allocator";
  } else if (auto* counting = CountingCpuAllocator::instance) {
    s.allocated_mb = counting->current_.load() / kBytesPerMiB;
    s.peak_mb = counting->peak_.load() / kBytesPerMiB;
    s.reserved_mb = rss_mb();
    s.counter = "cpu tensors";
  } else {
    s.allocated_mb = rss_mb();
    s.peak_mb = peak_rss_mb();
    s.reserved_mb = s.allocated_mb;
    s.counter = "process rss";
  }
  // The two are read one after the other while other threads allocate (and the RSS and its peak
  // come from different sources): a peak below the current figure is never right.
  s.peak_mb = std::max(s.peak_mb, s.allocated_mb);
  if (!device.is_cuda()) s.requested_mb = s.allocated_mb;
  return s;
}

void reset_peak_memory(c10::Device device) {
  if (device.is_cuda()) {
    cuda_allocator()->resetPeakStats(cuda_index(device));
  } else if (auto* counting = CountingCpuAllocator::instance) {
    counting->peak_.store(counting->current_.load());
  }
}

void release_cached_memory(c10::Device device) {
  if (device.is_cuda()) c10::getDeviceAllocator(c10::kCUDA)->emptyCache();
}

}  // namespace dtrain::engine
