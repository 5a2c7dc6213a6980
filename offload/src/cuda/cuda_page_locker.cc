// The CUDA runtime's page locker (needs the CUDA runtime's header: compiled only with
// DTRAIN_WITH_CUDA, see offload/CMakeLists.txt; no_cuda/ holds the stand-in).
#include <ATen/Context.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_runtime_api.h>
#include <glog/logging.h>

#include <cstdio>
#include <mutex>
#include <string>
#include <unordered_map>

#include "dtrain/dist/error.h"
#include "dtrain/offload/page_locked.h"

namespace dtrain::offload {
namespace {

std::string gib(int64_t bytes) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.2f GiB", static_cast<double>(bytes) / double(int64_t{1} << 30));
  return buf;
}

class CudaPageLocker final : public HostPageLocker {
 public:
  void* allocate(int64_t bytes) override {
    DTRAIN_CHECK(bytes >= 1, "page-locked host memory: cannot allocate ", bytes, " bytes");
    // Page-locked memory serves every device (unified addressing), so it is taken in a context
    // that exists already, as PyTorch's host allocator does: cudaHostAlloc on a thread whose
    // current device has none would create one (a rank of GPU 3 holding memory on GPU 0).
    c10::cuda::OptionalCUDAGuard guard;
    if (const auto primary = c10::cuda::getDeviceIndexWithPrimaryContext()) guard.set_index(*primary);
    void* data = nullptr;
    const cudaError_t rc = cudaHostAlloc(&data, static_cast<size_t>(bytes), cudaHostAllocDefault);
    if (rc != cudaSuccess) {
      (void)cudaGetLastError();  // the error is reported here; later calls must not see it
      throw Error(detail::concat("page-locking ", gib(bytes), " (", bytes, " bytes) of host memory failed: cudaHostAlloc returned ",
                                 cudaGetErrorString(rc),
                                 "; free host memory (other jobs on the node), lower --host_mem_limit_gb, or offload less"));
    }
    int device = 0;
    if (cudaGetDevice(&device) != cudaSuccess) device = 0;
    std::lock_guard<std::mutex> lock(mutex_);
    device_of_[data] = static_cast<c10::DeviceIndex>(device);
    return data;
  }

  void release(void* data) noexcept override {
    if (data == nullptr) return;
    c10::DeviceIndex device = 0;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      auto it = device_of_.find(data);
      if (it != device_of_.end()) {
        device = it->second;
        device_of_.erase(it);
      }
    }
    // A copy queued on the device may still read or write the memory: wait for the device's
    // work first (a block this large is long-lived state, so this runs rarely, at its end).
    cudaError_t rc = cudaSuccess;
    try {
      c10::cuda::OptionalCUDAGuard guard;
      if (c10::cuda::hasPrimaryContext(device)) guard.set_index(device);
      rc = cudaDeviceSynchronize();
      if (rc == cudaSuccess) rc = cudaFreeHost(data);
    } catch (const std::exception& e) {
      LOG(ERROR) << "returning page-locked host memory failed: " << e.what();
      return;
    }
    if (rc != cudaSuccess) {
      (void)cudaGetLastError();
      // At process exit the runtime may be gone before a static tensor: nothing is left to free.
      if (rc != cudaErrorCudartUnloading) {
        LOG(ERROR) << "returning page-locked host memory failed: " << cudaGetErrorString(rc);
      }
    }
  }

 private:
  std::mutex mutex_;
  std::unordered_map<void*, c10::DeviceIndex> device_of_;  // guarded by mutex_: the device current at allocate()
};

}  // namespace

std::shared_ptr<HostPageLocker> cuda_page_locker() {
  static const std::shared_ptr<HostPageLocker> locker =
      at::hasCUDA() ? std::make_shared<CudaPageLocker>() : std::shared_ptr<HostPageLocker>();
  return locker;
}

}  // namespace dtrain::offload
