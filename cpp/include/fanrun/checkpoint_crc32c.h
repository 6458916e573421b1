// CRC32C (Castagnoli) of checkpoint items: the SSE4.2 / ARMv8 CRC instruction when the CPU
// has one, a table-driven fallback otherwise, and the combination of two CRCs of adjacent
// ranges, so that chunks written by different threads still give one CRC per item.
#pragma once

#include <cstddef>
#include <cstdint>

namespace fanrun {

// Extends `crc` (0 for an empty prefix) over `size` bytes at `data`.
uint32_t Crc32c(uint32_t crc, const void* data, size_t size);

// The table-driven path alone, so that tests can compare it with the hardware path.
uint32_t Crc32cSoftware(uint32_t crc, const void* data, size_t size);

// True when Crc32c uses a CPU instruction.
bool Crc32cHasHardware();

// CRC of A followed by B, from crc_a = Crc32c(0, A), crc_b = Crc32c(0, B) and B's length.
uint32_t Crc32cCombine(uint32_t crc_a, uint32_t crc_b, size_t length_b);

}  // namespace fanrun
