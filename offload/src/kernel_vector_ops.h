// Private: the part of the AVX2 and AVX-512F vector traits (kernel_body.h's V) that is the
// same intrinsic at either width, written once.
// DTRAIN_OFFLOAD_VECTOR_OPS(BITS, HALF, HALF_LOADU, HALF_STOREU), expanded at the top of a
// traits struct, defines Reg (__m<BITS>), kWidth (BITS / 32 floats), the float arithmetic,
// float32 loads and stores, and the float16/bfloat16 conversions through the intrinsics
// _mm<BITS>_*; HALF is the integer vector of kWidth 16-bit values (__m128i for 256 bits) and
// HALF_LOADU/HALF_STOREU its unaligned load and store intrinsics. The struct adds the two
// operations that take different instructions at each width:
//   static IReg where_nan(Reg x, IReg r, IReg value);  // r, with value in the lanes where x is NaN
//   static HALF narrow_16(IReg r);  // each 32-bit lane (< 2^16) to 16 bits, in order
// Only a macro: the functions are defined in each struct, so each kernel file's code is
// compiled with its own target flags.
#pragma once

#define DTRAIN_OFFLOAD_VECTOR_OPS(BITS, HALF, HALF_LOADU, HALF_STOREU)                             \
  using Reg = __m##BITS;                                                                           \
  using IReg = __m##BITS##i;                                                                       \
  static constexpr int kWidth = BITS / 32;                                                         \
  static HALF load_half(const uint16_t* p) {                                                       \
    return HALF_LOADU(reinterpret_cast<const HALF*>(p));                                           \
  }                                                                                                \
  static void store_half(uint16_t* p, HALF h) { HALF_STOREU(reinterpret_cast<HALF*>(p), h); }      \
  static Reg set1(float x) { return _mm##BITS##_set1_ps(x); }                                      \
  static Reg load_f32(const float* p) { return _mm##BITS##_loadu_ps(p); }                          \
  static void store_f32(float* p, Reg x) { _mm##BITS##_storeu_ps(p, x); }                          \
  /* A bfloat16 is the high 16 bits of a float32. */                                               \
  static Reg load_bf16(const uint16_t* p) {                                                        \
    const IReg w = _mm##BITS##_cvtepu16_epi32(load_half(p));                                       \
    return _mm##BITS##_castsi##BITS##_ps(_mm##BITS##_slli_epi32(w, 16));                           \
  }                                                                                                \
  static Reg load_f16(const uint16_t* p) { return _mm##BITS##_cvtph_ps(load_half(p)); }            \
  static void store_f16(uint16_t* p, Reg x) {                                                      \
    store_half(p, _mm##BITS##_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));         \
  }                                                                                                \
  /* x rounded to nearest even on its high 16 bits; NaN becomes the canonical 0x7FC0. */           \
  static void store_bf16(uint16_t* p, Reg x) {                                                     \
    const IReg u = _mm##BITS##_castps_si##BITS(x);                                                 \
    const IReg lsb =                                                                               \
        _mm##BITS##_and_si##BITS(_mm##BITS##_srli_epi32(u, 16), _mm##BITS##_set1_epi32(1));        \
    IReg r = _mm##BITS##_add_epi32(u, _mm##BITS##_add_epi32(lsb, _mm##BITS##_set1_epi32(0x7FFF))); \
    r = _mm##BITS##_srli_epi32(r, 16);                                                             \
    r = where_nan(x, r, _mm##BITS##_set1_epi32(0x7FC0));                                           \
    store_half(p, narrow_16(r));                                                                   \
  }                                                                                                \
  static Reg add(Reg a, Reg b) { return _mm##BITS##_add_ps(a, b); }                                \
  static Reg sub(Reg a, Reg b) { return _mm##BITS##_sub_ps(a, b); }                                \
  static Reg mul(Reg a, Reg b) { return _mm##BITS##_mul_ps(a, b); }                                \
  static Reg div(Reg a, Reg b) { return _mm##BITS##_div_ps(a, b); }                                \
  static Reg sqrt(Reg a) { return _mm##BITS##_sqrt_ps(a); }                                        \
  /* max(a, b) with a NaN b propagated (vmaxps returns its second operand on NaN). */              \
  static Reg max(Reg a, Reg b) { return _mm##BITS##_max_ps(a, b); }                                \
  static Reg fma(Reg a, Reg b, Reg c) { return _mm##BITS##_fmadd_ps(a, b, c); }                    \
  static Reg fnma(Reg a, Reg b, Reg c) { return _mm##BITS##_fnmadd_ps(a, b, c); }
