// Tests of the checkpoint I/O engine: round trips over many threads and chunk sizes,
// damaged and short files, full disks (a file-size limit), no file left after a failure, and
// item descriptors from damaged metadata: every bit flipped and every length cut, checked by
// this binary's AddressSanitizer for any access outside the buffers.
#include "fanrun/checkpoint_io.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <numeric>
#include <random>

#include "fanrun/checkpoint_crc32c.h"
#include "common/test_util_internal.h"

namespace fanrun {
namespace {

class CheckpointIoTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = testing::MakeTempDir("fanrun-ckpt-io");
    ASSERT_FALSE(dir_.empty());
    std::mt19937 random(3);
    // Sizes that cross chunk boundaries, an empty item, and one of a single byte.
    for (size_t size : {size_t{100000}, size_t{0}, size_t{1}, size_t{65536}, size_t{300001}}) {
      std::vector<unsigned char> bytes(size);
      for (auto& b : bytes) b = static_cast<unsigned char>(random());
      data_.push_back(std::move(bytes));
    }
  }
  void TearDown() override { ASSERT_TRUE(testing::RemoveTree(dir_)); }

  std::vector<WriteItem> Items() const {
    std::vector<WriteItem> items;
    uint64_t offset = 0;
    for (size_t i = 0; i < data_.size(); ++i) {
      items.push_back(WriteItem{data_[i].data(), data_[i].size(), offset, "item" + std::to_string(i)});
      offset += data_[i].size() + 4096;  // gaps, as alignment leaves
    }
    return items;
  }

  std::string dir_;
  std::vector<std::vector<unsigned char>> data_;
};

TEST_F(CheckpointIoTest, RoundTripWithManyThreadsAndSmallChunks) {
  const std::string path = dir_ + "/rank0.data";
  const auto items = Items();
  auto crcs = WriteItemsToFile(path, items, WriteOptions{4, 4096});
  ASSERT_TRUE(crcs.ok()) << crcs.status().message();
  ASSERT_EQ(crcs->size(), items.size());
  for (size_t i = 0; i < items.size(); ++i) EXPECT_EQ((*crcs)[i], Crc32c(0, data_[i].data(), data_[i].size()));

  std::vector<std::vector<unsigned char>> back(items.size());
  std::vector<ReadItem> reads;
  for (size_t i = 0; i < items.size(); ++i) {
    back[i].resize(items[i].size);
    reads.push_back(
        ReadItem{0, items[i].offset, items[i].size, back[i].data(), back[i].size(), (*crcs)[i], items[i].label});
  }
  ASSERT_TRUE(ReadItemsFromFiles({path}, reads, ReadOptions{3, 5000}).ok());
  EXPECT_EQ(back, data_);
}

TEST_F(CheckpointIoTest, BatchesWrittenOneAfterAnotherReadBackAsOneFile) {
  const std::string path = dir_ + "/rank0.data";
  const auto items = Items();
  const uint64_t size = items.back().offset + items.back().size;
  auto writer = CheckpointFileWriter::Create(path, size, WriteOptions{3, 4096});
  ASSERT_TRUE(writer.ok()) << writer.status().message();
  auto first = (*writer)->Write({items[0], items[1]});
  auto second = (*writer)->Write({items[2], items[3], items[4]});
  ASSERT_TRUE(first.ok() && second.ok());
  ASSERT_TRUE((*writer)->Finish().ok());
  EXPECT_FALSE((*writer)->Write({items[0]}).ok());  // finished: no more writes

  std::vector<uint32_t> crcs = *first;
  crcs.insert(crcs.end(), second->begin(), second->end());
  std::vector<std::vector<unsigned char>> back(items.size());
  std::vector<ReadItem> reads;
  for (size_t i = 0; i < items.size(); ++i) {
    back[i].resize(items[i].size);
    reads.push_back(ReadItem{0, items[i].offset, items[i].size, back[i].data(), back[i].size(), crcs[i], items[i].label});
  }
  ASSERT_TRUE(ReadItemsFromFiles({path}, reads, ReadOptions{}).ok());
  EXPECT_EQ(back, data_);
}

TEST_F(CheckpointIoTest, AbortedOrAbandonedWriterRemovesItsFile) {
  const std::string path = dir_ + "/rank0.data";
  const auto items = Items();
  {
    auto writer = CheckpointFileWriter::Create(path, 1 << 20, WriteOptions{});
    ASSERT_TRUE(writer.ok());
    ASSERT_TRUE((*writer)->Write({items[0]}).ok());
    EXPECT_EQ(::access(path.c_str(), F_OK), 0);
  }  // destroyed without Finish
  EXPECT_NE(::access(path.c_str(), F_OK), 0);
  auto writer = CheckpointFileWriter::Create(path, 1 << 20, WriteOptions{});
  ASSERT_TRUE(writer.ok());
  (*writer)->Abort();
  EXPECT_NE(::access(path.c_str(), F_OK), 0);
}

TEST_F(CheckpointIoTest, ExistingFileIsNotOverwritten) {
  const std::string path = dir_ + "/rank0.data";
  ASSERT_TRUE(WriteItemsToFile(path, Items(), WriteOptions{}).ok());
  auto again = WriteItemsToFile(path, Items(), WriteOptions{});
  ASSERT_FALSE(again.ok());
  EXPECT_NE(again.status().message().find(path), std::string::npos);
}

TEST_F(CheckpointIoTest, FlippedByteIsReportedWithFileAndItem) {
  const std::string path = dir_ + "/rank0.data";
  const auto items = Items();
  auto crcs = WriteItemsToFile(path, items, WriteOptions{2, 8192});
  ASSERT_TRUE(crcs.ok());
  {
    const int fd = ::open(path.c_str(), O_RDWR);
    ASSERT_GE(fd, 0);
    unsigned char byte;
    const off_t where = static_cast<off_t>(items[4].offset + 12345);
    ASSERT_EQ(::pread(fd, &byte, 1, where), 1);
    byte ^= 0x10;
    ASSERT_EQ(::pwrite(fd, &byte, 1, where), 1);
    ::close(fd);
  }
  std::vector<std::vector<unsigned char>> back(items.size());
  std::vector<ReadItem> reads;
  for (size_t i = 0; i < items.size(); ++i) {
    back[i].resize(items[i].size);
    reads.push_back(
        ReadItem{0, items[i].offset, items[i].size, back[i].data(), back[i].size(), (*crcs)[i], items[i].label});
  }
  Status st = ReadItemsFromFiles({path}, reads, ReadOptions{2, 8192});
  ASSERT_FALSE(st.ok());
  EXPECT_EQ(st.code(), StatusCode::kDataLoss);
  EXPECT_NE(st.message().find(path), std::string::npos) << st.message();
  EXPECT_NE(st.message().find("'item4'"), std::string::npos) << st.message();
}

TEST_F(CheckpointIoTest, ShortAndMissingFilesAreDataLoss) {
  const std::string path = dir_ + "/rank0.data";
  const auto items = Items();
  auto crcs = WriteItemsToFile(path, items, WriteOptions{});
  ASSERT_TRUE(crcs.ok());
  ASSERT_EQ(::truncate(path.c_str(), static_cast<off_t>(items[4].offset + 10)), 0);
  std::vector<unsigned char> back(items[4].size);
  Status st = ReadItemsFromFiles(
      {path}, {ReadItem{0, items[4].offset, items[4].size, back.data(), back.size(), (*crcs)[4], "last"}}, ReadOptions{});
  EXPECT_EQ(st.code(), StatusCode::kDataLoss);
  EXPECT_NE(st.message().find("truncated"), std::string::npos) << st.message();

  st = ReadItemsFromFiles({dir_ + "/absent.data"}, {ReadItem{0, 0, 1, back.data(), 1, 0, "x"}}, ReadOptions{});
  EXPECT_EQ(st.code(), StatusCode::kDataLoss);
  EXPECT_NE(st.message().find("absent.data' is missing"), std::string::npos) << st.message();
}

// A file-size limit makes the reservation (or a write) fail with EFBIG, as a full disk would
// with ENOSPC: the error names the file and no partial file is left. Run in a child process
// so that the limit does not reach the test runner.
TEST_F(CheckpointIoTest, FileSizeLimitFailsCleanlyAndLeavesNoFile) {
  const std::string path = dir_ + "/rank0.data";
  const pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    ::signal(SIGXFSZ, SIG_IGN);
    rlimit limit{200000, 200000};
    ::setrlimit(RLIMIT_FSIZE, &limit);
    auto crcs = WriteItemsToFile(path, Items(), WriteOptions{2, 8192});
    const bool clear = !crcs.ok() && crcs.status().message().find(path) != std::string::npos &&
                       crcs.status().message().find("File too large") != std::string::npos;
    ::_exit(clear ? 0 : 1);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0);
  EXPECT_NE(::access(path.c_str(), F_OK), 0);
}

// Writes `bytes` as the whole content of `path`, replacing what was there.
void WriteWholeFile(const std::string& path, const std::vector<unsigned char>& bytes) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(::write(fd, bytes.data(), bytes.size()), static_cast<ssize_t>(bytes.size()));
  ::close(fd);
}

std::vector<unsigned char> RandomBytes(size_t size, unsigned seed) {
  std::mt19937 random(seed);
  std::vector<unsigned char> bytes(size);
  for (auto& b : bytes) b = static_cast<unsigned char>(random());
  return bytes;
}

TEST_F(CheckpointIoTest, LengthLargerThanTheDestinationMovesNoByte) {
  const std::string path = dir_ + "/rank0.data";
  const auto bytes = RandomBytes(8192, 5);
  WriteWholeFile(path, bytes);
  const uint32_t crc = Crc32c(0, bytes.data(), 4096);
  // The destination is the head of a larger buffer: a read past its 4096 bytes lands in the tail.
  std::vector<unsigned char> buffer(4096 + 256, 0xAB);
  for (size_t claimed : {size_t{4352}, size_t{4095}, size_t{0}}) {
    Status st = ReadItemsFromFiles({path}, {ReadItem{0, 0, claimed, buffer.data(), 4096, crc, "weight"}}, ReadOptions{});
    EXPECT_EQ(st.code(), StatusCode::kDataLoss) << claimed;
    EXPECT_NE(st.message().find("'weight' is " + std::to_string(claimed) + " bytes long"), std::string::npos)
        << st.message();
    EXPECT_NE(st.message().find("destination holds 4096 bytes"), std::string::npos) << st.message();
    EXPECT_EQ(buffer, std::vector<unsigned char>(4096 + 256, 0xAB)) << "bytes moved for a length of " << claimed;
  }
}

TEST_F(CheckpointIoTest, ItemPastTheEndOfItsFileMovesNoByte) {
  const std::string path = dir_ + "/rank0.data";
  const auto bytes = RandomBytes(1000, 6);
  WriteWholeFile(path, bytes);
  std::vector<unsigned char> back(100, 0xAB);
  // Past the end; straddling it; an offset whose sum with the size wraps around 2^64.
  for (uint64_t offset : {uint64_t{1001}, uint64_t{950}, ~uint64_t{0} - 50}) {
    Status st = ReadItemsFromFiles({path}, {ReadItem{0, offset, back.size(), back.data(), back.size(), 0, "bias"}},
                                   ReadOptions{});
    EXPECT_EQ(st.code(), StatusCode::kDataLoss) << offset;
    EXPECT_NE(st.message().find("item 'bias' is 100 bytes at offset " + std::to_string(offset)), std::string::npos)
        << st.message();
    EXPECT_NE(st.message().find("file's end at byte 1000"), std::string::npos) << st.message();
    EXPECT_EQ(back, std::vector<unsigned char>(100, 0xAB));
  }
  // An empty item reads nothing wherever it says it lies (a last empty item may lie past the end
  // of a file on a filesystem without fallocate).
  EXPECT_TRUE(ReadItemsFromFiles({path}, {ReadItem{0, 5000, 0, nullptr, 0, 0, "empty"}}, ReadOptions{}).ok());
}

// A file the size of a small checkpoint's metadata, read back as one item against the size and
// CRC32C its record gives: every single-bit flip and every truncation is a kDataLoss error.
TEST_F(CheckpointIoTest, EveryBitFlippedAndEveryLengthCutOfASmallFileIsDataLoss) {
  const std::string path = dir_ + "/metadata.pkl";
  const auto bytes = RandomBytes(300, 7);
  const uint32_t crc = Crc32c(0, bytes.data(), bytes.size());
  std::vector<unsigned char> back(bytes.size());
  const ReadItem item{0, 0, bytes.size(), back.data(), back.size(), crc, "metadata"};
  WriteWholeFile(path, bytes);
  ASSERT_TRUE(ReadItemsFromFiles({path}, {item}, ReadOptions{1, 64}).ok());
  ASSERT_EQ(back, bytes);
  for (size_t position = 0; position < bytes.size(); ++position) {
    for (int bit = 0; bit < 8; ++bit) {
      auto damaged = bytes;
      damaged[position] = static_cast<unsigned char>(damaged[position] ^ (1u << bit));
      WriteWholeFile(path, damaged);
      Status st = ReadItemsFromFiles({path}, {item}, ReadOptions{2, 64});
      ASSERT_EQ(st.code(), StatusCode::kDataLoss) << "byte " << position << " bit " << bit;
      ASSERT_NE(st.message().find("Checksum mismatch"), std::string::npos) << st.message();
    }
  }
  for (size_t length = 0; length < bytes.size(); ++length) {
    WriteWholeFile(path, std::vector<unsigned char>(bytes.begin(), bytes.begin() + static_cast<long>(length)));
    Status st = ReadItemsFromFiles({path}, {item}, ReadOptions{2, 64});
    ASSERT_EQ(st.code(), StatusCode::kDataLoss) << "cut at " << length;
    ASSERT_NE(st.message().find("truncated"), std::string::npos) << st.message();
  }
}

// Items of a small data file, described as the metadata describes them. Every bit of every
// field the metadata gives (file index, offset, size, CRC32C) is flipped in turn, and the file
// is cut at every length: each read either returns exactly the bytes written or fails with an
// error that names the item. The destinations are exactly as large as the items, so
// AddressSanitizer stops the test at any byte written or read outside them.
TEST_F(CheckpointIoTest, EveryBitOfEveryItemDescriptorFlippedAndEveryFileLengthCut) {
  const std::string path = dir_ + "/rank0.data";
  const std::vector<size_t> sizes = {300, 0, 1, 64, 500};
  std::vector<std::vector<unsigned char>> data;
  std::vector<WriteItem> writes;
  uint64_t offset = 0;
  for (size_t i = 0; i < sizes.size(); ++i) {
    data.push_back(RandomBytes(sizes[i], static_cast<unsigned>(10 + i)));
    writes.push_back(WriteItem{data[i].data(), sizes[i], offset, "item" + std::to_string(i)});
    offset += sizes[i] + 16;
  }
  auto crcs = WriteItemsToFile(path, writes, WriteOptions{2, 128});
  ASSERT_TRUE(crcs.ok()) << crcs.status().message();
  const uint64_t file_size = writes.back().offset + writes.back().size;

  std::vector<std::vector<unsigned char>> back(sizes.size());
  auto describe = [&] {
    std::vector<ReadItem> reads;
    for (size_t i = 0; i < sizes.size(); ++i) {
      back[i].assign(sizes[i], 0);
      back[i].shrink_to_fit();
      reads.push_back(ReadItem{0, writes[i].offset, sizes[i], back[i].data(), back[i].size(), (*crcs)[i],
                               writes[i].label});
    }
    return reads;
  };
  // Either every item is exactly what was written, or the error names the damaged item.
  auto check = [&](const Status& st, size_t damaged, const std::string& what) {
    if (st.ok()) {
      for (size_t i = 0; i < sizes.size(); ++i) ASSERT_EQ(back[i], data[i]) << what << ": item " << i;
      return;
    }
    ASSERT_TRUE(st.code() == StatusCode::kDataLoss || st.code() == StatusCode::kInvalid) << what;
    ASSERT_NE(st.message().find("'" + writes[damaged].label + "'"), std::string::npos) << what << ": " << st.message();
  };
  ASSERT_TRUE(ReadItemsFromFiles({path}, describe(), ReadOptions{}).ok());

  size_t errors = 0;
  for (size_t i = 0; i < sizes.size(); ++i) {
    for (int field = 0; field < 4; ++field) {
      const int bits = field == 3 ? 32 : 64;
      for (int bit = 0; bit < bits; ++bit) {
        std::vector<ReadItem> reads = describe();
        ReadItem& item = reads[i];
        const uint64_t mask = uint64_t{1} << bit;
        switch (field) {
          case 0: item.file ^= static_cast<size_t>(mask); break;
          case 1: item.offset ^= mask; break;
          case 2: item.size ^= static_cast<size_t>(mask); break;
          default: item.crc32c ^= static_cast<uint32_t>(mask); break;
        }
        Status st = ReadItemsFromFiles({path}, reads, ReadOptions{3, 128});
        if (!st.ok()) ++errors;
        check(st, i, "item " + std::to_string(i) + " field " + std::to_string(field) + " bit " + std::to_string(bit));
      }
    }
  }
  EXPECT_GT(errors, 0u);

  std::vector<unsigned char> whole(file_size);
  {
    const int fd = ::open(path.c_str(), O_RDONLY);
    ASSERT_GE(fd, 0);
    ASSERT_EQ(::pread(fd, whole.data(), whole.size(), 0), static_cast<ssize_t>(whole.size()));
    ::close(fd);
  }
  for (uint64_t length = 0; length < file_size; ++length) {
    WriteWholeFile(path, std::vector<unsigned char>(whole.begin(), whole.begin() + static_cast<long>(length)));
    Status st = ReadItemsFromFiles({path}, describe(), ReadOptions{3, 128});
    ASSERT_FALSE(st.ok()) << "cut at " << length;  // the last item always loses a byte
    ASSERT_EQ(st.code(), StatusCode::kDataLoss) << st.message();
    ASSERT_NE(st.message().find("truncated"), std::string::npos) << st.message();
  }
}

}  // namespace
}  // namespace fanrun
