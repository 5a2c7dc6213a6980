// Stand-in for src/cuda/memory_fraction.cc in builds without CUDA.
#include "../memory_limit_internal.h"
#include "dtrain/dist/error.h"

namespace dtrain::engine::detail {

void set_cuda_memory_limit(c10::Device device, int64_t) {
  DTRAIN_CHECK(false, "cannot limit the memory of ", device,
               " because dtrain was not compiled with CUDA; rebuild with -DDTRAIN_WITH_CUDA=ON");
}

std::string cuda_pci_bus_id(int) { return ""; }

}  // namespace dtrain::engine::detail
