// Tests of CRC32C: known values, hardware against software, and combination of ranges.
#include "fanrun/checkpoint_crc32c.h"

#include <gtest/gtest.h>

#include <random>
#include <string>
#include <vector>

namespace fanrun {
namespace {

TEST(Crc32cTest, KnownValues) {
  // RFC 3720 (iSCSI) B.4 check value and test vectors.
  EXPECT_EQ(Crc32c(0, "123456789", 9), 0xE3069283u);
  std::vector<unsigned char> zeros(32, 0);
  EXPECT_EQ(Crc32c(0, zeros.data(), zeros.size()), 0x8A9136AAu);
  std::vector<unsigned char> ones(32, 0xFF);
  EXPECT_EQ(Crc32c(0, ones.data(), ones.size()), 0x62A8AB43u);
  EXPECT_EQ(Crc32c(0, nullptr, 0), 0u);
}

TEST(Crc32cTest, HardwareAndSoftwareAgreeOnEveryLengthAndAlignment) {
  std::mt19937 random(7);
  std::vector<unsigned char> data(4096 + 16);
  for (auto& byte : data) byte = static_cast<unsigned char>(random());
  for (size_t start = 0; start < 9; ++start) {
    for (size_t length : {0u, 1u, 7u, 8u, 9u, 63u, 64u, 65u, 1000u, 4096u}) {
      EXPECT_EQ(Crc32c(0, data.data() + start, length), Crc32cSoftware(0, data.data() + start, length))
          << "start " << start << " length " << length;
    }
  }
}

TEST(Crc32cTest, IncrementalEqualsWhole) {
  const std::string text = "fanrun checkpoints are checked item by item";
  const uint32_t whole = Crc32c(0, text.data(), text.size());
  const uint32_t first = Crc32c(0, text.data(), 10);
  EXPECT_EQ(Crc32c(first, text.data() + 10, text.size() - 10), whole);
}

TEST(Crc32cTest, CombineEqualsTheCrcOfTheConcatenation) {
  std::mt19937 random(11);
  std::vector<unsigned char> data(1 << 20);
  for (auto& byte : data) byte = static_cast<unsigned char>(random());
  const uint32_t whole = Crc32c(0, data.data(), data.size());
  for (size_t split : {size_t{0}, size_t{1}, size_t{4095}, size_t{1} << 19, data.size() - 1, data.size()}) {
    const uint32_t a = Crc32c(0, data.data(), split);
    const uint32_t b = Crc32c(0, data.data() + split, data.size() - split);
    EXPECT_EQ(Crc32cCombine(a, b, data.size() - split), whole) << "split at " << split;
  }
}

TEST(Crc32cTest, AFlippedBitChangesTheCrc) {
  std::vector<unsigned char> data(1000, 0x5A);
  const uint32_t before = Crc32c(0, data.data(), data.size());
  data[500] ^= 0x04;
  EXPECT_NE(Crc32c(0, data.data(), data.size()), before);
}

}  // namespace
}  // namespace fanrun
