// Page-locked (pinned) host memory of the size asked.
//
// PyTorch's pinned tensors (at::empty(..., pinned_memory(true))) come from its caching host
// allocator, which rounds every request up to a power of two and keeps a freed block
// page-locked for a later request of the same rounded size: a 40 GiB buffer of streamed weights
// locks 64 GiB, and two of them (the delayed update's) do not fit a 128 GiB host at all. Large
// requests here are page-locked at their exact size instead (the CUDA runtime's cudaHostAlloc),
// and returned to the system when the last tensor sharing them dies; small ones still come from
// PyTorch's cache, whose reuse is cheap and whose rounding costs little.
//
// Thread-safety: every function may be called from any thread.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>

namespace dtrain::offload {

// Where exact page-locked memory comes from: the CUDA runtime on a GPU machine (cuda_page_locker),
// a fake in tests.
class HostPageLocker {
 public:
  virtual ~HostPageLocker() = default;
  // `bytes` (>= 1) of page-locked host memory, aligned to at least 64 bytes, uninitialized.
  // Synchronous. Throws dtrain::Error naming the size and the runtime's reason; nothing is
  // allocated then.
  virtual void* allocate(int64_t bytes) = 0;
  // Returns memory from allocate(). Waits first for the work queued on the device that was
  // current at allocate() (a copy may still read or write the memory). Never throws: a failure
  // is logged. Not to be called inside a CUDA graph capture.
  virtual void release(void* data) noexcept = 0;
};

// The CUDA runtime's locker (cudaHostAlloc, cudaFreeHost), shared by every caller; nullptr in a
// build without CUDA or on a machine without a CUDA device.
std::shared_ptr<HostPageLocker> cuda_page_locker();

// Requests of at least this many bytes are page-locked at their exact size; smaller ones come
// from PyTorch's caching host allocator (a power of two: at most this much is wasted per block).
constexpr int64_t kExactPinMinBytes = int64_t{16} << 20;

// The host memory a page-locked request of `bytes` takes: its 4 KiB pages when it is at least
// exact_min_bytes, else the power of two PyTorch's cache rounds it to.
int64_t page_locked_footprint(int64_t bytes, int64_t exact_min_bytes = kExactPinMinBytes);

// An uninitialized contiguous CPU tensor of `sizes` and `dtype` in page-locked memory. At least
// exact_min_bytes: from `locker` at its exact size (the storage's deleter returns it when the
// last tensor sharing it dies, after the device's queued work, see HostPageLocker::release);
// smaller: from PyTorch's caching host allocator. Synchronous. Throws dtrain::Error when
// `locker` is null (no CUDA device: nothing to copy to, so nothing to lock) or fails.
at::Tensor page_locked_empty(at::IntArrayRef sizes, at::ScalarType dtype,
                             const std::shared_ptr<HostPageLocker>& locker = cuda_page_locker(),
                             int64_t exact_min_bytes = kExactPinMinBytes);

// A host tensor for data copied to and from a device: page_locked_empty() when `page_locked`
// (the copies then run asynchronously), else an uninitialized pageable CPU tensor.
at::Tensor host_empty(at::IntArrayRef sizes, at::ScalarType dtype, bool page_locked);

}  // namespace dtrain::offload
