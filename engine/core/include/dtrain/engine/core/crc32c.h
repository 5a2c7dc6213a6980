// CRC-32C (Castagnoli), the checksum of TensorBoard's TFRecords and of dtrain's checkpoints.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

namespace dtrain::engine {

// CRC-32C extending `crc` (the CRC of the bytes before these; 0 to start). Uses the SSE4.2
// crc32 instruction when the CPU has it, else crc32c_portable(). crc32c("123456789") ==
// 0xE3069283. Thread-safe (pure).
uint32_t crc32c(const void* data, size_t size, uint32_t crc = 0);
// The table-driven (slice-by-8) implementation, on every CPU.
uint32_t crc32c_portable(const void* data, size_t size, uint32_t crc = 0);

}  // namespace dtrain::engine

#include "dtrain/dist/glog_compat.h"  // last: keeps glog's LOG macros whatever the include order
