// The CUDA caching allocator's memory fraction (needs a CUDA header: compiled only with
// DTRAIN_WITH_CUDA, see engine/CMakeLists.txt).
#include <ATen/Context.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <c10/cuda/CUDACachingAllocator.h>

#include <algorithm>
#include <cstdio>

#include "../memory_limit_internal.h"
#include "dtrain/dist/error.h"

namespace dtrain::engine::detail {

void set_cuda_memory_limit(c10::Device device, int64_t bytes) {
  at::globalContext().lazyInitDevice(c10::kCUDA);  // the allocator must exist for its fraction
  const c10::DeviceIndex index = device.has_index()
                                     ? device.index()
                                     : c10::impl::VirtualGuardImpl(c10::kCUDA).getDevice().index();
  const size_t total = c10::cuda::CUDACachingAllocator::get()->getMemoryInfo(index).second;
  DTRAIN_CHECK(total > 0, "apply_memory_limit: cuda:", static_cast<int>(index),
               " reports no memory");
  const double fraction =
      bytes == 0 ? 1.0 : std::min(1.0, static_cast<double>(bytes) / static_cast<double>(total));
  c10::cuda::CUDACachingAllocator::setMemoryFraction(fraction, index);
}

std::string cuda_pci_bus_id(int index) {
  try {
    const cudaDeviceProp* prop = at::cuda::getDeviceProperties(static_cast<c10::DeviceIndex>(index));
    char id[32];
    std::snprintf(id, sizeof id, "%08x:%02x:%02x.0", prop->pciDomainID, prop->pciBusID,
                  prop->pciDeviceID);
    return id;
  } catch (const std::exception&) {
    return "";
  }
}

}  // namespace dtrain::engine::detail
