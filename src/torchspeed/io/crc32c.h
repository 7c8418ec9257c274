// CRC-32C (Castagnoli), the checksum of checkpoint files: SSE4.2's crc32 instruction where the
// CPU has it (~8 GB/s on one core, far above disk speed), a table otherwise. Same values as
// iSCSI/ext4/Google's crc32c ("123456789" -> 0xE3069283).
#pragma once

#include <cstddef>
#include <cstdint>

namespace torchspeed::io {

// Extends `crc` (0 for a new stream) with `n` bytes.
uint32_t crc32c(uint32_t crc, const void* data, size_t n);

// The CRC-32C of A followed by B from crc32c(A), crc32c(B) and B's length (zlib's
// crc32_combine over the Castagnoli polynomial), so parts of a file written out of order
// (streamed checkpoint tensors, each written in order at its own offset) still give the
// file's checksum without reading it back. O(log len_b).
uint32_t crc32c_combine(uint32_t crc_a, uint32_t crc_b, uint64_t len_b);

}  // namespace torchspeed::io
