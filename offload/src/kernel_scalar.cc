// The portable kernel: one element at a time, compiled with the project's default flags.
// Conversions are bit-level and match at::Tensor::to (round to nearest even; NaN stays NaN).
#include <cmath>
#include <cstdint>
#include <cstring>

#include "kernels_internal.h"

namespace dtrain::offload::detail {
namespace {

float bits_to_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

uint32_t float_to_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

uint16_t float_to_bf16(float f) {
  if (std::isnan(f)) return 0x7FC0;
  uint32_t u = float_to_bits(f);
  u += 0x7FFF + ((u >> 16) & 1);
  return static_cast<uint16_t>(u >> 16);
}

float f16_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
  const uint32_t exp = (h >> 10) & 0x1F;
  const uint32_t mant = h & 0x3FF;
  if (exp == 0x1F) return bits_to_float(sign | 0x7F800000u | (mant << 13));  // inf / NaN
  if (exp != 0) return bits_to_float(sign | ((exp + 112) << 23) | (mant << 13));
  // Zero or subnormal: mant * 2^-24, exact in float.
  const float magnitude = static_cast<float>(mant) * 5.9604644775390625e-8f;
  return sign ? -magnitude : magnitude;
}

uint16_t float_to_f16(float f) {
  const uint32_t u = float_to_bits(f);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000);
  const uint32_t abs = u & 0x7FFFFFFFu;
  if (abs > 0x7F800000u) return sign | 0x7E00 | static_cast<uint16_t>((abs >> 13) & 0x3FF);
  if (abs >= 0x47800000u) return sign | 0x7C00;  // >= 65536: overflow to inf (and inf)
  const int exp = static_cast<int>(abs >> 23) - 127;
  if (exp >= -14) {  // normal half (or rounds up to inf)
    uint32_t mant = abs & 0x7FFFFF;
    uint32_t h = (static_cast<uint32_t>(exp + 15) << 10) | (mant >> 13);
    const uint32_t rest = mant & 0x1FFF;
    if (rest > 0x1000 || (rest == 0x1000 && (h & 1))) ++h;  // carries into the exponent
    return sign | static_cast<uint16_t>(h);
  }
  if (exp < -25) return sign;  // below half the smallest subnormal: zero
  // Subnormal: value = m * 2^-24 with m = full_mantissa >> shift, rounded to nearest even.
  const uint32_t full = (abs & 0x7FFFFF) | 0x800000;
  const int shift = -exp - 1;  // 14 .. 24
  uint32_t h = full >> shift;
  const uint32_t rest = full & ((1u << shift) - 1);
  const uint32_t half = 1u << (shift - 1);
  if (rest > half || (rest == half && (h & 1))) ++h;
  return sign | static_cast<uint16_t>(h);
}

struct ScalarV {
  using Reg = float;
  static constexpr int kWidth = 1;
  static Reg set1(float x) { return x; }
  static Reg load_f32(const float* p) { return *p; }
  static void store_f32(float* p, Reg x) { *p = x; }
  static Reg load_bf16(const uint16_t* p) { return bits_to_float(static_cast<uint32_t>(*p) << 16); }
  static Reg load_f16(const uint16_t* p) { return f16_to_float(*p); }
  static void store_bf16(uint16_t* p, Reg x) { *p = float_to_bf16(x); }
  static void store_f16(uint16_t* p, Reg x) { *p = float_to_f16(x); }
  static Reg add(Reg a, Reg b) { return a + b; }
  static Reg sub(Reg a, Reg b) { return a - b; }
  static Reg mul(Reg a, Reg b) { return a * b; }
  static Reg div(Reg a, Reg b) { return a / b; }
  static Reg sqrt(Reg a) { return std::sqrt(a); }
  static Reg max(Reg a, Reg b) { return std::isnan(a) || std::isnan(b) ? a + b : (a > b ? a : b); }
  static Reg fma(Reg a, Reg b, Reg c) { return a * b + c; }
  static Reg fnma(Reg a, Reg b, Reg c) { return c - a * b; }
};
using V = ScalarV;

#include "kernel_body.h"

}  // namespace

void update_scalar(const UpdateConfig& config, const UpdateArrays& arrays) {
  dispatch(config, arrays);
}

}  // namespace dtrain::offload::detail
