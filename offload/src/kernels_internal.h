// Private: the per-ISA entry points (one per kernel_<isa>.cc), dispatched by cpu_kernels.cc.
#pragma once

#include "dtrain/offload/cpu_kernels.h"

namespace dtrain::offload::detail {

void update_scalar(const UpdateConfig& config, const UpdateArrays& arrays);
#if defined(__x86_64__)
void update_avx2(const UpdateConfig& config, const UpdateArrays& arrays);
void update_avx512(const UpdateConfig& config, const UpdateArrays& arrays);
#endif

}  // namespace dtrain::offload::detail
