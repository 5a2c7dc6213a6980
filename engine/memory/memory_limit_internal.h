// The CUDA part of apply_memory_limit(), implemented in src/cuda/ when dtrain is built with
// CUDA and in src/no_cuda/ (throwing) otherwise: engine/CMakeLists.txt picks the file.
#pragma once

#include <c10/core/Device.h>

#include <cstdint>
#include <string>

namespace dtrain::engine::detail {

// Sets the CUDA caching allocator's memory fraction of `device` (no index: the current one)
// to bytes / its total memory (at most 1; bytes == 0: 1). Throws dtrain::Error when dtrain
// was built without CUDA.
void set_cuda_memory_limit(c10::Device device, int64_t bytes);

// The PCI bus id of CUDA device `index` ("0000:3b:00.0"), by which NVML finds the same GPU
// whatever CUDA's device order; "" when unknown or when dtrain was built without CUDA.
std::string cuda_pci_bus_id(int index);

}  // namespace dtrain::engine::detail
