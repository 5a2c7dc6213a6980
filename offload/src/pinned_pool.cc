// Capped host memory: the cap and the machine check run before any allocation.
#include "dtrain/offload/pinned_pool.h"

#include <ATen/ATen.h>
#include <ATen/Context.h>
#include <glog/logging.h>
#include <sys/mman.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <mutex>
#include <sstream>

#include "dtrain/dist/error.h"

namespace dtrain::offload {
namespace {

std::string format_bytes(int64_t bytes) {
  char buf[64];
  const double gib = static_cast<double>(bytes) / double(int64_t{1} << 30);
  if (gib >= 0.1) {
    std::snprintf(buf, sizeof(buf), "%.2f GiB", gib);
  } else {
    std::snprintf(buf, sizeof(buf), "%.2f MiB", static_cast<double>(bytes) / double(1 << 20));
  }
  return std::string(buf) + " (" + std::to_string(bytes) + " bytes)";
}

// Bytes as the flag's unit: "12" or "0.5" GiB.
std::string format_gib(int64_t bytes) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%g", static_cast<double>(bytes) / double(int64_t{1} << 30));
  return buf;
}

// Asks for transparent huge pages on the 2 MiB-aligned interior of [data, data + bytes).
// Best effort: a failure only costs speed.
void advise_huge_pages(void* data, int64_t bytes) {
  constexpr uintptr_t kHuge = uintptr_t{2} << 20;
  const uintptr_t begin = (reinterpret_cast<uintptr_t>(data) + kHuge - 1) & ~(kHuge - 1);
  const uintptr_t end =
      (reinterpret_cast<uintptr_t>(data) + static_cast<uintptr_t>(bytes)) & ~(kHuge - 1);
  if (end > begin) madvise(reinterpret_cast<void*>(begin), end - begin, MADV_HUGEPAGE);
}

}  // namespace

int64_t host_limit_bytes_from_gb(double gib, const std::string& flag) {
  DTRAIN_CHECK(std::isfinite(gib) && gib >= 0.0, flag, "=", gib,
               " must be a number of GiB >= 0 (0: no cap of its own)");
  return static_cast<int64_t>(std::llround(gib * double(int64_t{1} << 30)));
}

int64_t read_mem_available(const std::string& meminfo_path) {
  std::ifstream in(meminfo_path);
  std::string line;
  while (in && std::getline(in, line)) {
    if (line.rfind("MemAvailable:", 0) != 0) continue;
    std::istringstream fields(line.substr(13));
    int64_t value = -1;
    std::string unit;
    fields >> value >> unit;
    if (value < 0) return -1;
    return unit == "kB" ? value * 1024 : value;
  }
  return -1;
}

struct PinnedPool::State {
  PinnedPoolOptions options;
  bool pin = false;
  std::shared_ptr<HostPageLocker> locker;  // where pinned blocks are locked (pin only)
  mutable std::mutex mutex;
  int64_t used = 0;                // GUARDED_BY(mutex)
  int64_t peak = 0;                // GUARDED_BY(mutex)
  bool warned_no_meminfo = false;  // GUARDED_BY(mutex)

  void release(int64_t charge) {
    std::lock_guard<std::mutex> lock(mutex);
    used -= charge;
  }
};

PinnedPool::PinnedPool(PinnedPoolOptions options) : state_(std::make_shared<State>()) {
  DTRAIN_CHECK(options.limit_bytes >= 0, "pinned host pool: limit_bytes = ", options.limit_bytes,
               " must be >= 0 (0: no cap); check ", options.limit_flag);
  DTRAIN_CHECK(options.min_free_bytes >= 0,
               "pinned host pool: min_free_bytes = ", options.min_free_bytes, " must be >= 0");
  DTRAIN_CHECK(options.exact_pin_min_bytes >= 1, "pinned host pool: exact_pin_min_bytes = ",
               options.exact_pin_min_bytes, " must be >= 1");
  state_->locker = options.page_locker ? options.page_locker : cuda_page_locker();
  state_->pin = options.pin && state_->locker != nullptr;
  state_->options = std::move(options);
}

PinnedPool::~PinnedPool() = default;

int64_t PinnedPool::charged_bytes(int64_t bytes) const {
  return state_->pin ? page_locked_footprint(bytes, state_->options.exact_pin_min_bytes) : bytes;
}

at::Tensor PinnedPool::allocate(int64_t bytes) { return allocate_bytes(bytes, state_->pin); }

at::Tensor PinnedPool::allocate_pageable(int64_t numel, at::ScalarType dtype) {
  DTRAIN_CHECK(numel >= 1, "pinned host pool: cannot allocate ", numel, " elements of ", dtype,
               "; a request must be at least 1 element");
  return allocate_bytes(numel * static_cast<int64_t>(c10::elementSize(dtype)), /*pin=*/false).view(dtype);
}

at::Tensor PinnedPool::allocate_bytes(int64_t bytes, bool pin) {
  const PinnedPoolOptions& opt = state_->options;
  DTRAIN_CHECK(bytes >= 1, "pinned host pool: cannot allocate ", bytes,
               " bytes; a request must be at least 1 byte");
  const int64_t charge = pin ? charged_bytes(bytes) : bytes;
  const std::string what = pin ? "pinned host memory" : "host memory";
  {
    std::lock_guard<std::mutex> lock(state_->mutex);
    if (opt.limit_bytes > 0 && state_->used + charge > opt.limit_bytes) {
      throw Error("pinned host pool: cannot allocate " + format_bytes(charge) + " of " + what +
                  ": " + format_bytes(state_->used) + " of the " + format_bytes(opt.limit_bytes) +
                  " cap is in use; raise " + opt.limit_flag + " (now " +
                  format_gib(opt.limit_bytes) +
                  ") or offload less (more data-parallel ranks share the optimizer state)");
    }
    const int64_t available = read_mem_available(opt.meminfo_path);
    if (available < 0) {
      if (!state_->warned_no_meminfo) {
        LOG(WARNING) << "pinned host pool: no MemAvailable in " << opt.meminfo_path
                     << "; only the cap is checked";
        state_->warned_no_meminfo = true;
      }
    } else if (charge > available - opt.min_free_bytes) {
      throw Error("pinned host pool: cannot allocate " + format_bytes(charge) + " of " + what +
                  ": the machine has " + format_bytes(available) + " available (MemAvailable in " +
                  opt.meminfo_path + ") and " + format_bytes(opt.min_free_bytes) +
                  " is kept free; this pool already holds " + format_bytes(state_->used) +
                  ". Lower " + opt.limit_flag +
                  ", free host memory (other jobs on the node), or offload less (more ranks "
                  "or nodes share the optimizer state)");
    }
    state_->used += charge;
    state_->peak = std::max(state_->peak, state_->used);
  }
  at::Tensor raw;
  try {
    raw = pin ? page_locked_empty({bytes}, at::kByte, state_->locker, opt.exact_pin_min_bytes)
              : at::empty({bytes}, at::TensorOptions().dtype(at::kByte));
  } catch (const std::exception& e) {
    state_->release(charge);
    throw Error("pinned host pool: allocating " + format_bytes(charge) + " of " + what +
                " failed: " + e.what());
  }
  std::shared_ptr<State> state = state_;
  void* data = raw.data_ptr();
  if (!pin && opt.huge_pages && bytes >= (int64_t{4} << 20)) {
    advise_huge_pages(data, bytes);  // before the first touch, so faults map huge pages
  }
  // The returned tensor owns `raw`; when its storage dies, raw is freed and the charge lifted.
  return at::for_blob(data, {bytes})
      .options(at::TensorOptions().dtype(at::kByte))
      .deleter([state, raw, charge](void*) mutable {
        raw = at::Tensor();
        state->release(charge);
      })
      .make_tensor();
}

at::Tensor PinnedPool::allocate(int64_t numel, at::ScalarType dtype) {
  DTRAIN_CHECK(numel >= 1, "pinned host pool: cannot allocate ", numel, " elements of ", dtype,
               "; a request must be at least 1 element");
  return allocate(numel * static_cast<int64_t>(c10::elementSize(dtype))).view(dtype);
}

int64_t PinnedPool::used_bytes() const {
  std::lock_guard<std::mutex> lock(state_->mutex);
  return state_->used;
}

int64_t PinnedPool::peak_bytes() const {
  std::lock_guard<std::mutex> lock(state_->mutex);
  return state_->peak;
}

int64_t PinnedPool::limit_bytes() const { return state_->options.limit_bytes; }
bool PinnedPool::pinned() const { return state_->pin; }
const PinnedPoolOptions& PinnedPool::options() const { return state_->options; }

}  // namespace dtrain::offload
