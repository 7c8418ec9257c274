// CRC-32C (Castagnoli), the checksum of checkpoint files: SSE4.2's crc32 instruction where the
// CPU has it (~8 GB/s on one core, far above disk speed), a table otherwise. Same values as
// iSCSI/ext4/Google's crc32c ("123456789" -> 0xE3069283).
#pragma once

#include <cstddef>
#include <cstdint>

namespace torchspeed::checkpoint {

// Extends `crc` (0 for a new stream) with `n` bytes.
uint32_t crc32c(uint32_t crc, const void* data, size_t n);

}  // namespace torchspeed::checkpoint
