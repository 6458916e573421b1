// The checkpoint I/O engine: one rank's items written to one data file by several threads
// with large buffered writes, a CRC32C per item, writeback started early and the file
// fsynced; and items read back in parallel, each checked against its CRC.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "fanrun/fd.h"
#include "fanrun/status.h"

namespace fanrun {

// Items are cut into chunks of this size so that a single large tensor is still written
// and read by every thread.
inline constexpr size_t kDefaultChunkBytes = size_t{16} << 20;

struct WriteItem {
  const void* data = nullptr;  // memory the caller keeps alive and unchanged during the call
  size_t size = 0;
  uint64_t offset = 0;         // where the item starts in the file
  std::string label;           // names the item in errors
};

struct WriteOptions {
  int threads = 8;
  size_t chunk_bytes = kDefaultChunkBytes;
};

// One rank's data file, written in batches: the caller can prepare the next batch (copy it
// from the GPU) while the threads write this one. Until Finish() succeeds, the file is removed
// when the writer is destroyed or aborted, so a failed save never leaves a partial file.
class CheckpointFileWriter {
 public:
  // Creates `path` (it must not exist) and reserves `size` bytes, so that a full disk or a
  // file-size limit is reported before any data is written.
  static Result<std::unique_ptr<CheckpointFileWriter>> Create(const std::string& path, uint64_t size,
                                                             const WriteOptions& options);
  CheckpointFileWriter(const CheckpointFileWriter&) = delete;
  CheckpointFileWriter& operator=(const CheckpointFileWriter&) = delete;
  ~CheckpointFileWriter();

  // Writes every item at its offset with the writer's threads and returns each item's CRC32C,
  // in item order. Writeback of each chunk starts as soon as it is written.
  Result<std::vector<uint32_t>> Write(const std::vector<WriteItem>& items);
  // fsyncs and closes the file; after this the file stays.
  Status Finish();
  // Closes and removes the file (a no-op after Finish).
  void Abort();

 private:
  CheckpointFileWriter(std::string path, FileDescriptor file, WriteOptions options)
      : path_(std::move(path)), file_(std::move(file)), options_(options) {}

  std::string path_;
  FileDescriptor file_;
  WriteOptions options_;
  bool finished_ = false;
};

// The whole file in one batch: Create, Write, Finish.
Result<std::vector<uint32_t>> WriteItemsToFile(const std::string& path, const std::vector<WriteItem>& items,
                                               const WriteOptions& options);

// An item as the checkpoint's metadata describes it (file, offset, size, CRC), and where it
// goes. The metadata is untrusted input: its size and offset are checked against the
// destination and the file before any byte moves.
struct ReadItem {
  size_t file = 0;      // index into the file list
  uint64_t offset = 0;
  size_t size = 0;
  void* destination = nullptr;
  size_t destination_size = 0;  // bytes at destination, as the caller allocated them
  uint32_t crc32c = 0;  // expected
  std::string label;
};

struct ReadOptions {
  int threads = 8;
  size_t chunk_bytes = kDefaultChunkBytes;
};

// Reads every item into its destination with several threads and checks each CRC; a
// mismatch is a kDataLoss error naming the file and the item, a short file a kDataLoss
// error naming how many bytes are missing. Before anything is read, every item must fill its
// destination exactly and lie inside its file; otherwise nothing is read and the kDataLoss
// error names the item (the metadata is damaged or does not belong to these files).
Status ReadItemsFromFiles(const std::vector<std::string>& files, const std::vector<ReadItem>& items,
                          const ReadOptions& options);

}  // namespace fanrun
