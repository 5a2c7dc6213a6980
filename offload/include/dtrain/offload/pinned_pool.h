// Host memory for offloaded state, with a cap: the CPU optimizer's master weights and
// optimizer state, copy-back staging buffers, offloaded layers.
//
// allocate() returns a 1-D uint8 CPU tensor. When a CUDA device is present (and
// options.pin), the memory is page-locked (page_locked.h: large requests at their exact size,
// small ones from PyTorch's caching host allocator) so device copies from and to it run
// asynchronously at full PCIe speed. Without a CUDA device there is nothing to lock for, and
// ordinary host memory is returned (pinned() says which); everything else behaves the same.
//
// Two checks run before any memory is taken, each a dtrain::Error that names the request,
// what is in use and the fix, so a job stops with a message instead of the node's
// out-of-memory killer ending it:
//  * the cap (options.limit_bytes, from --host_mem_limit_gb): used + request > cap;
//  * the machine: request > MemAvailable (/proc/meminfo) - options.min_free_bytes.
// A request counts what it really takes (charged_bytes()): a large pinned block its pages, a
// small one the power of two PyTorch's allocator rounds it to. Freed large blocks go back to the
// system; freed small ones stay cached by PyTorch's allocator for reuse.
//
// The memory is released (and uncharged) when the last tensor sharing it is destroyed, which
// may be after the pool itself is gone. Contents are uninitialized.
// Thread-safety: every method may be called from any thread concurrently.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <string>

#include "dtrain/offload/page_locked.h"

namespace dtrain::offload {

struct PinnedPoolOptions {
  // Cap on the bytes charged at once; 0: no cap of the pool's own (the machine check stays).
  int64_t limit_bytes = 0;
  // Flag that sets the cap, named in messages.
  std::string limit_flag = "--host_mem_limit_gb";
  // The machine check keeps this much of MemAvailable free for everything else (the
  // process's other allocations, the data loader, the OS page cache).
  int64_t min_free_bytes = int64_t{2} << 30;
  // Where MemAvailable is read (tests point this at a fake file). If the file cannot be read
  // or has no MemAvailable line, the machine check is skipped (logged once).
  std::string meminfo_path = "/proc/meminfo";
  // Page-lock when a CUDA device is present. false: ordinary host memory always.
  bool pin = true;
  // Pageable (not pinned) allocations of 4 MiB or more ask the kernel for transparent huge
  // pages (madvise MADV_HUGEPAGE; a hint, ignored where THP is off): fewer TLB misses when
  // the optimizer streams through gigabytes (~10% faster steps measured on the CPU).
  bool huge_pages = true;
  // Pinned requests of at least this many bytes are page-locked at their exact size; smaller
  // ones come from PyTorch's caching host allocator (page_locked_empty()).
  int64_t exact_pin_min_bytes = kExactPinMinBytes;
  // Where the exact page-locked blocks come from; null: the CUDA runtime (cuda_page_locker()).
  // One of a test's own also makes the pool pin without a CUDA device (then every request
  // must be at least exact_pin_min_bytes: the small ones' cache needs CUDA).
  std::shared_ptr<HostPageLocker> page_locker;
};

// GiB (2^30 bytes) as given to --host_mem_limit_gb -> bytes (0 stays 0: no cap). Throws
// dtrain::Error for a negative or non-finite value, naming the flag.
int64_t host_limit_bytes_from_gb(double gib, const std::string& flag = "--host_mem_limit_gb");

// MemAvailable from a /proc/meminfo-format file, in bytes; -1 when unknown.
int64_t read_mem_available(const std::string& meminfo_path = "/proc/meminfo");

class PinnedPool {
 public:
  // Throws dtrain::Error for a negative limit_bytes or min_free_bytes.
  explicit PinnedPool(PinnedPoolOptions options = {});
  ~PinnedPool();
  PinnedPool(const PinnedPool&) = delete;
  PinnedPool& operator=(const PinnedPool&) = delete;

  // A 1-D uint8 tensor of exactly `bytes` elements (bytes >= 1), 64-byte aligned.
  // Synchronous. Throws dtrain::Error (nothing allocated, nothing charged) for bytes < 1,
  // over the cap, over the machine's available memory, or when the allocator fails.
  at::Tensor allocate(int64_t bytes);
  // allocate() of numel elements of dtype, viewed as a 1-D tensor of that dtype.
  at::Tensor allocate(int64_t numel, at::ScalarType dtype);
  // Like allocate(numel, dtype), but never page-locked (huge pages advised): for host arrays
  // that no device copy reads or writes (the CPU optimizer's master weights and moments).
  // Page-locking them would only slow the start (cudaHostAlloc of 72 GiB for a 6B model)
  // and lock memory the system could otherwise page. Charged exactly, under the same checks.
  at::Tensor allocate_pageable(int64_t numel, at::ScalarType dtype);

  // What allocate(bytes) charges: bytes, or when pinning page_locked_footprint(bytes).
  int64_t charged_bytes(int64_t bytes) const;
  int64_t used_bytes() const;   // charged and not yet released
  int64_t peak_bytes() const;   // the most used_bytes() has been
  int64_t limit_bytes() const;  // 0: no cap
  bool pinned() const;          // whether allocations are page-locked
  const PinnedPoolOptions& options() const;

 private:
  at::Tensor allocate_bytes(int64_t bytes, bool pin);
  struct State;
  std::shared_ptr<State> state_;
};

}  // namespace dtrain::offload

#include "dtrain/dist/glog_compat.h"  // last: keeps glog's LOG macros whatever the include order
