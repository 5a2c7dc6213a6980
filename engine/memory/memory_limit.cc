// apply_memory_limit(): validation and the CPU case; the CUDA call lives in src/cuda/.
#include "dtrain/dist/error.h"
#include "dtrain/engine/memory/planner.h"
#include "memory_limit_internal.h"

namespace dtrain::engine {

bool apply_memory_limit(c10::Device device, int64_t bytes) {
  DTRAIN_CHECK(bytes >= 0, "GPU memory limit must be >= 0 bytes (0: no limit), got ", bytes,
               "; check --gpu_mem_limit_gb");
  if (device.is_cpu()) return false;  // CPU memory is not capped (the pinned pool has its own cap)
  DTRAIN_CHECK(
      device.is_cuda(), "apply_memory_limit: device ", device,
      " is not supported (cpu: nothing is enforced; cuda: the caching allocator's fraction)");
  detail::set_cuda_memory_limit(device, bytes);
  return true;
}

}  // namespace dtrain::engine
