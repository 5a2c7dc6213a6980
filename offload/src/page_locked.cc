// Exact-size page-locked host memory (see page_locked.h); the CUDA runtime's locker is in
// cuda/cuda_page_locker.cc (no_cuda/ in builds without CUDA).
#include "dtrain/offload/page_locked.h"

#include <ATen/ATen.h>
#include <c10/util/accumulate.h>

#include <algorithm>

#include "dtrain/dist/error.h"

namespace dtrain::offload {
namespace {

constexpr int64_t kPage = 4096;

int64_t next_power_of_two(int64_t x) {
  int64_t p = 1;
  while (p < x) p <<= 1;
  return p;
}

}  // namespace

int64_t page_locked_footprint(int64_t bytes, int64_t exact_min_bytes) {
  if (bytes >= exact_min_bytes) return (bytes + kPage - 1) / kPage * kPage;
  return next_power_of_two(bytes);
}

at::Tensor page_locked_empty(at::IntArrayRef sizes, at::ScalarType dtype, const std::shared_ptr<HostPageLocker>& locker,
                             int64_t exact_min_bytes) {
  DTRAIN_CHECK(std::all_of(sizes.begin(), sizes.end(), [](int64_t s) { return s >= 0; }),
               "page-locked host memory: negative size in ", sizes);
  const int64_t numel = c10::multiply_integers(sizes);
  DTRAIN_CHECK(locker != nullptr, "page-locked host memory of ", sizes, " ", dtype,
               " needs a CUDA device to lock it for (none is visible, or dtrain was built without CUDA)");
  const int64_t bytes = numel * static_cast<int64_t>(c10::elementSize(dtype));
  if (bytes < exact_min_bytes) return at::empty(sizes, at::TensorOptions().dtype(dtype).pinned_memory(true));
  void* data = locker->allocate(bytes);
  std::shared_ptr<HostPageLocker> owner = locker;
  return at::for_blob(data, sizes)
      .options(at::TensorOptions().dtype(dtype))
      .deleter([owner](void* p) { owner->release(p); })
      .make_tensor();
}

at::Tensor host_empty(at::IntArrayRef sizes, at::ScalarType dtype, bool page_locked) {
  return page_locked ? page_locked_empty(sizes, dtype) : at::empty(sizes, at::TensorOptions().dtype(dtype));
}

}  // namespace dtrain::offload
