// The AVX2 + FMA + F16C kernel, 8 floats per vector. This file alone is compiled with
// -mavx2 -mfma -mf16c (offload/CMakeLists.txt); cpu_kernels.cc calls it only on CPUs that
// have those features.
#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "kernels_internal.h"

namespace dtrain::offload::detail {
namespace {

struct Avx2V {
  using Reg = __m256;
  static constexpr int kWidth = 8;
  static Reg set1(float x) { return _mm256_set1_ps(x); }
  static Reg load_f32(const float* p) { return _mm256_loadu_ps(p); }
  static void store_f32(float* p, Reg x) { _mm256_storeu_ps(p, x); }
  static Reg load_bf16(const uint16_t* p) {
    __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
  }
  static Reg load_f16(const uint16_t* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static void store_bf16(uint16_t* p, Reg x) {
    // Round to nearest even on the high 16 bits; NaN becomes the canonical 0x7FC0.
    const __m256i u = _mm256_castps_si256(x);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF)));
    r = _mm256_srli_epi32(r, 16);
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), nan);
    // 8 x u32 (< 2^16) -> 8 x u16: pack within lanes, then gather qwords 0 and 2.
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
  }
  static void store_f16(uint16_t* p, Reg x) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                     _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  static Reg add(Reg a, Reg b) { return _mm256_add_ps(a, b); }
  static Reg sub(Reg a, Reg b) { return _mm256_sub_ps(a, b); }
  static Reg mul(Reg a, Reg b) { return _mm256_mul_ps(a, b); }
  static Reg div(Reg a, Reg b) { return _mm256_div_ps(a, b); }
  static Reg sqrt(Reg a) { return _mm256_sqrt_ps(a); }
  // max(a, b) with a NaN b propagated (vmaxps returns its second operand on NaN).
  static Reg max(Reg a, Reg b) { return _mm256_max_ps(a, b); }
  static Reg fma(Reg a, Reg b, Reg c) { return _mm256_fmadd_ps(a, b, c); }
  static Reg fnma(Reg a, Reg b, Reg c) { return _mm256_fnmadd_ps(a, b, c); }
};
using V = Avx2V;

#include "kernel_body.h"

}  // namespace

void update_avx2(const UpdateConfig& config, const UpdateArrays& arrays) {
  dispatch(config, arrays);
}

}  // namespace dtrain::offload::detail
