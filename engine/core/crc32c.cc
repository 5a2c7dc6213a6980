// CRC-32C (checkpoint records, TFRecord framing): a slice-by-8 table implementation and, on
// x86-64 CPUs with SSE4.2, the crc32 instruction (chosen once at run time).
#include <array>
#include <cstdint>
#include <cstring>

#include "dtrain/engine/core/crc32c.h"

#if defined(__x86_64__)
#include <nmmintrin.h>
#endif

namespace dtrain::engine {
namespace {

constexpr uint32_t kPolynomial = 0x82F63B78u;  // Castagnoli, bit-reversed

using Tables = std::array<std::array<uint32_t, 256>, 8>;

// tables[0] is the byte-at-a-time table; tables[k][b] is the CRC of byte b followed by k
// zero bytes, so eight bytes are folded with eight look-ups.
constexpr Tables make_tables() {
  Tables t{};
  for (uint32_t b = 0; b < 256; ++b) {
    uint32_t crc = b;
    for (int bit = 0; bit < 8; ++bit) crc = (crc >> 1) ^ ((crc & 1u) ? kPolynomial : 0u);
    t[0][b] = crc;
  }
  for (uint32_t b = 0; b < 256; ++b) {
    for (size_t k = 1; k < 8; ++k) t[k][b] = (t[k - 1][b] >> 8) ^ t[0][t[k - 1][b] & 0xFFu];
  }
  return t;
}
constexpr Tables kTables = make_tables();

uint64_t load_le64(const unsigned char* p) {
  uint64_t v;
  std::memcpy(&v, p, sizeof v);
#if __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
  v = __builtin_bswap64(v);
#endif
  return v;
}

#if defined(__x86_64__)
__attribute__((target("sse4.2"))) uint32_t crc32c_sse42(const unsigned char* p, size_t n,
                                                        uint32_t state) {
  uint64_t s = state;
  for (; n >= 8; n -= 8, p += 8) s = _mm_crc32_u64(s, load_le64(p));
  uint32_t s32 = static_cast<uint32_t>(s);
  for (; n > 0; --n, ++p) s32 = _mm_crc32_u8(s32, *p);
  return s32;
}

bool cpu_has_sse42() {
  static const bool has = __builtin_cpu_supports("sse4.2");
  return has;
}
#endif

// The raw (pre- and post-inverted by the callers) table update.
uint32_t crc32c_tables(const unsigned char* p, size_t n, uint32_t state) {
  for (; n >= 8; n -= 8, p += 8) {
    const uint64_t v = load_le64(p) ^ state;
    state = kTables[7][v & 0xFF] ^ kTables[6][(v >> 8) & 0xFF] ^ kTables[5][(v >> 16) & 0xFF] ^
            kTables[4][(v >> 24) & 0xFF] ^ kTables[3][(v >> 32) & 0xFF] ^
            kTables[2][(v >> 40) & 0xFF] ^ kTables[1][(v >> 48) & 0xFF] ^
            kTables[0][(v >> 56) & 0xFF];
  }
  for (; n > 0; --n, ++p) state = (state >> 8) ^ kTables[0][(state ^ *p) & 0xFFu];
  return state;
}

}  // namespace

uint32_t crc32c_portable(const void* data, size_t size, uint32_t crc) {
  return ~crc32c_tables(static_cast<const unsigned char*>(data), size, ~crc);
}

uint32_t crc32c(const void* data, size_t size, uint32_t crc) {
#if defined(__x86_64__)
  if (cpu_has_sse42()) return ~crc32c_sse42(static_cast<const unsigned char*>(data), size, ~crc);
#endif
  return crc32c_portable(data, size, crc);
}

}  // namespace dtrain::engine
