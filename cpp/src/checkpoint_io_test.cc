// Tests of the checkpoint I/O engine: round trips over many threads and chunk sizes,
// damaged and short files, full disks (a file-size limit), no file left after a failure.
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
#include "test_util_internal.h"

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
    reads.push_back(ReadItem{0, items[i].offset, items[i].size, back[i].data(), (*crcs)[i], items[i].label});
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
    reads.push_back(ReadItem{0, items[i].offset, items[i].size, back[i].data(), crcs[i], items[i].label});
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
    reads.push_back(ReadItem{0, items[i].offset, items[i].size, back[i].data(), (*crcs)[i], items[i].label});
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
  Status st = ReadItemsFromFiles({path}, {ReadItem{0, items[4].offset, items[4].size, back.data(), (*crcs)[4], "last"}},
                                 ReadOptions{});
  EXPECT_EQ(st.code(), StatusCode::kDataLoss);
  EXPECT_NE(st.message().find("truncated"), std::string::npos) << st.message();

  st = ReadItemsFromFiles({dir_ + "/absent.data"}, {ReadItem{0, 0, 1, back.data(), 0, "x"}}, ReadOptions{});
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

}  // namespace
}  // namespace fanrun
