// The AVX-512F kernel, 16 floats per vector. This file alone is compiled with -mavx512f
// (plus AVX2/FMA/F16C, which every AVX-512 CPU has; offload/CMakeLists.txt); cpu_kernels.cc
// calls it only on CPUs (and OSes) that support AVX-512F.
#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "kernel_vector_ops.h"
#include "kernels_internal.h"

namespace dtrain::offload::detail {
namespace {

struct V {
  DTRAIN_OFFLOAD_VECTOR_OPS(512, __m256i, _mm256_loadu_si256, _mm256_storeu_si256)
  static IReg where_nan(Reg x, IReg r, IReg value) {
    return _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), r, value);
  }
  static __m256i narrow_16(IReg r) { return _mm512_cvtepi32_epi16(r); }
};

#include "kernel_body.h"

}  // namespace

void update_avx512(const UpdateConfig& config, const UpdateArrays& arrays) {
  dispatch(config, arrays);
}

}  // namespace dtrain::offload::detail
