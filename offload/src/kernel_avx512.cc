// The AVX-512F kernel, 16 floats per vector. This file alone is compiled with -mavx512f
// (plus AVX2/FMA/F16C, which every AVX-512 CPU has; offload/CMakeLists.txt); cpu_kernels.cc
// calls it only on CPUs (and OSes) that support AVX-512F.
#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "kernels_internal.h"

namespace dtrain::offload::detail {
namespace {

struct Avx512V {
  using Reg = __m512;
  static constexpr int kWidth = 16;
  static Reg set1(float x) { return _mm512_set1_ps(x); }
  static Reg load_f32(const float* p) { return _mm512_loadu_ps(p); }
  static void store_f32(float* p, Reg x) { _mm512_storeu_ps(p, x); }
  static Reg load_bf16(const uint16_t* p) {
    __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
  }
  static Reg load_f16(const uint16_t* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static void store_bf16(uint16_t* p, Reg x) {
    // Round to nearest even on the high 16 bits; NaN becomes the canonical 0x7FC0.
    const __m512i u = _mm512_castps_si512(x);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
    r = _mm512_srli_epi32(r, 16);
    const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    r = _mm512_mask_blend_epi32(nan, r, _mm512_set1_epi32(0x7FC0));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(r));
  }
  static void store_f16(uint16_t* p, Reg x) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                        _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  static Reg add(Reg a, Reg b) { return _mm512_add_ps(a, b); }
  static Reg sub(Reg a, Reg b) { return _mm512_sub_ps(a, b); }
  static Reg mul(Reg a, Reg b) { return _mm512_mul_ps(a, b); }
  static Reg div(Reg a, Reg b) { return _mm512_div_ps(a, b); }
  static Reg sqrt(Reg a) { return _mm512_sqrt_ps(a); }
  // max(a, b) with a NaN b propagated (vmaxps returns its second operand on NaN).
  static Reg max(Reg a, Reg b) { return _mm512_max_ps(a, b); }
  static Reg fma(Reg a, Reg b, Reg c) { return _mm512_fmadd_ps(a, b, c); }
  static Reg fnma(Reg a, Reg b, Reg c) { return _mm512_fnmadd_ps(a, b, c); }
};
using V = Avx512V;

#include "kernel_body.h"

}  // namespace

void update_avx512(const UpdateConfig& config, const UpdateArrays& arrays) {
  dispatch(config, arrays);
}

}  // namespace dtrain::offload::detail
