// CRC32C with a hardware path chosen once at run time and a slicing-by-8 fallback.
#include "fanrun/checkpoint_crc32c.h"

#include <array>
#include <cstring>

#if defined(__x86_64__)
#include <nmmintrin.h>
#elif defined(__aarch64__)
#include <arm_acle.h>
#include <sys/auxv.h>
#ifndef HWCAP_CRC32
#define HWCAP_CRC32 (1 << 7)
#endif
#endif

namespace fanrun {
namespace {

constexpr uint32_t kPolynomial = 0x82F63B78u;  // reflected Castagnoli polynomial

using Tables = std::array<std::array<uint32_t, 256>, 8>;

Tables MakeTables() {
  Tables tables{};
  for (uint32_t i = 0; i < 256; ++i) {
    uint32_t crc = i;
    for (int bit = 0; bit < 8; ++bit) crc = (crc >> 1) ^ ((crc & 1u) ? kPolynomial : 0u);
    tables[0][i] = crc;
  }
  for (size_t t = 1; t < 8; ++t) {
    for (size_t i = 0; i < 256; ++i) {
      const uint32_t previous = tables[t - 1][i];
      tables[t][i] = (previous >> 8) ^ tables[0][previous & 0xFFu];
    }
  }
  return tables;
}

const Tables& GetTables() {
  static const Tables tables = MakeTables();
  return tables;
}

uint64_t LoadLittleEndian64(const unsigned char* p) {
  uint64_t value;
  std::memcpy(&value, p, sizeof(value));  // x86-64 and aarch64 Linux are little-endian
  return value;
}

uint32_t SoftwareRaw(uint32_t crc, const unsigned char* p, size_t size) {
  const Tables& t = GetTables();
  while (size >= 8) {
    const uint64_t word = LoadLittleEndian64(p) ^ crc;
    crc = t[7][word & 0xFF] ^ t[6][(word >> 8) & 0xFF] ^ t[5][(word >> 16) & 0xFF] ^
          t[4][(word >> 24) & 0xFF] ^ t[3][(word >> 32) & 0xFF] ^ t[2][(word >> 40) & 0xFF] ^
          t[1][(word >> 48) & 0xFF] ^ t[0][word >> 56];
    p += 8;
    size -= 8;
  }
  while (size-- > 0) crc = (crc >> 8) ^ t[0][(crc ^ *p++) & 0xFFu];
  return crc;
}

#if defined(__x86_64__)
// crc32 named as well: clang 20 no longer takes it as part of sse4.2.
__attribute__((target("sse4.2,crc32"))) uint32_t HardwareRaw(uint32_t crc, const unsigned char* p, size_t size) {
  uint64_t crc64 = crc;
  while (size >= 8) {
    crc64 = _mm_crc32_u64(crc64, LoadLittleEndian64(p));
    p += 8;
    size -= 8;
  }
  uint32_t crc32 = static_cast<uint32_t>(crc64);
  while (size-- > 0) crc32 = _mm_crc32_u8(crc32, *p++);
  return crc32;
}
bool DetectHardware() { return __builtin_cpu_supports("sse4.2"); }
#elif defined(__aarch64__)
__attribute__((target("+crc"))) uint32_t HardwareRaw(uint32_t crc, const unsigned char* p, size_t size) {
  while (size >= 8) {
    crc = __crc32cd(crc, LoadLittleEndian64(p));
    p += 8;
    size -= 8;
  }
  while (size-- > 0) crc = __crc32cb(crc, *p++);
  return crc;
}
bool DetectHardware() { return (getauxval(AT_HWCAP) & HWCAP_CRC32) != 0; }
#else
uint32_t HardwareRaw(uint32_t crc, const unsigned char* p, size_t size) { return SoftwareRaw(crc, p, size); }
bool DetectHardware() { return false; }
#endif

bool UseHardware() {
  static const bool use = DetectHardware();
  return use;
}

// Multiplication in GF(2) modulo the polynomial, of the (reflected) 32x32 bit matrices that
// zlib's crc32_combine uses: appending n zero bytes to a CRC register is a linear map.
uint32_t MatrixTimes(const uint32_t* matrix, uint32_t vector) {
  uint32_t sum = 0;
  for (int i = 0; vector != 0; ++i, vector >>= 1) {
    if (vector & 1u) sum ^= matrix[i];
  }
  return sum;
}

void MatrixSquare(uint32_t* square, const uint32_t* matrix) {
  for (int i = 0; i < 32; ++i) square[i] = MatrixTimes(matrix, matrix[i]);
}

}  // namespace

uint32_t Crc32cSoftware(uint32_t crc, const void* data, size_t size) {
  return ~SoftwareRaw(~crc, static_cast<const unsigned char*>(data), size);
}

uint32_t Crc32c(uint32_t crc, const void* data, size_t size) {
  const auto* p = static_cast<const unsigned char*>(data);
  return ~(UseHardware() ? HardwareRaw(~crc, p, size) : SoftwareRaw(~crc, p, size));
}

bool Crc32cHasHardware() { return UseHardware(); }

uint32_t Crc32cCombine(uint32_t crc_a, uint32_t crc_b, size_t length_b) {
  if (length_b == 0) return crc_a;
  uint32_t even[32];  // operator for 2^k zero bits, k even
  uint32_t odd[32];   // ... k odd
  odd[0] = kPolynomial;  // the operator for one zero bit
  uint32_t row = 1;
  for (int i = 1; i < 32; ++i) {
    odd[i] = row;
    row <<= 1;
  }
  MatrixSquare(even, odd);  // two zero bits
  MatrixSquare(odd, even);  // four zero bits
  // Applies length_b zero bytes to crc_a, one squaring per bit of the length.
  do {
    MatrixSquare(even, odd);
    if (length_b & 1u) crc_a = MatrixTimes(even, crc_a);
    length_b >>= 1;
    if (length_b == 0) break;
    MatrixSquare(odd, even);
    if (length_b & 1u) crc_a = MatrixTimes(odd, crc_a);
    length_b >>= 1;
  } while (length_b != 0);
  return crc_a ^ crc_b;
}

}  // namespace fanrun
