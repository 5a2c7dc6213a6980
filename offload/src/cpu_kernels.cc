// Run-time choice of the optimizer kernel by CPU feature detection.
#include "dtrain/offload/cpu_kernels.h"

#include "dtrain/dist/error.h"
#include "kernels_internal.h"

namespace dtrain::offload {

const char* to_string(Isa isa) {
  switch (isa) {
    case Isa::kScalar:
      return "scalar";
    case Isa::kAvx2:
      return "avx2";
    case Isa::kAvx512:
      return "avx512";
  }
  return "?";
}

bool isa_supported(Isa isa) {
  if (isa == Isa::kScalar) return true;
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  // libgcc's detection also checks that the OS saves the AVX / AVX-512 registers (XCR0).
  __builtin_cpu_init();
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                    __builtin_cpu_supports("f16c");
  if (isa == Isa::kAvx2) return avx2;
  if (isa == Isa::kAvx512) return avx2 && __builtin_cpu_supports("avx512f");
#endif
  return false;
}

Isa best_isa() {
  if (isa_supported(Isa::kAvx512)) return Isa::kAvx512;
  if (isa_supported(Isa::kAvx2)) return Isa::kAvx2;
  return Isa::kScalar;
}

UpdateFn update_kernel(Isa isa) {
  DTRAIN_CHECK(isa_supported(isa), "CPU optimizer kernel '", to_string(isa),
               "' cannot run here: it needs ",
               isa == Isa::kAvx512 ? "avx512f (and avx2, fma, f16c)" : "avx2, fma and f16c",
               " in /proc/cpuinfo and an x86-64 build; use isa=\"auto\" to pick the widest one "
               "this CPU supports (",
               to_string(best_isa()), ")");
  switch (isa) {
#if defined(__x86_64__)
    case Isa::kAvx512:
      return detail::update_avx512;
    case Isa::kAvx2:
      return detail::update_avx2;
#endif
    default:
      return detail::update_scalar;
  }
}

}  // namespace dtrain::offload
