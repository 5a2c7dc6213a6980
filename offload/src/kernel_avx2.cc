// The AVX2 + FMA + F16C kernel, 8 floats per vector. This file alone is compiled with
// -mavx2 -mfma -mf16c (offload/CMakeLists.txt); cpu_kernels.cc calls it only on CPUs that
// have those features.
#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "kernel_vector_ops.h"
#include "kernels_internal.h"

namespace dtrain::offload::detail {
namespace {

struct V {
  DTRAIN_OFFLOAD_VECTOR_OPS(256, __m128i, _mm_loadu_si128, _mm_storeu_si128)
  static IReg where_nan(Reg x, IReg r, IReg value) {
    return _mm256_blendv_epi8(r, value, _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q)));
  }
  // 8 x u32 -> 8 x u16: pack within lanes, then gather qwords 0 and 2.
  static __m128i narrow_16(IReg r) {
    return _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08));
  }
};

#include "kernel_body.h"

}  // namespace

void update_avx2(const UpdateConfig& config, const UpdateArrays& arrays) {
  dispatch(config, arrays);
}

}  // namespace dtrain::offload::detail
