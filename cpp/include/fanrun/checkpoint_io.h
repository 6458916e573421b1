// The checkpoint I/O engine: one rank's items written to one data file by several threads
// with large buffered writes, a CRC32C per item, writeback started early and the file
// fsynced; and items read back in parallel, each checked against its CRC.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

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

// Creates `path` (it must not exist), writes every item at its offset, fsyncs the file and
// returns each item's CRC32C in item order. Space for the whole file is reserved first, so
// that a full disk or a file-size limit is reported before any data is written. On error the
// partial file is removed.
Result<std::vector<uint32_t>> WriteItemsToFile(const std::string& path, const std::vector<WriteItem>& items,
                                               const WriteOptions& options);

struct ReadItem {
  size_t file = 0;      // index into the file list
  uint64_t offset = 0;
  size_t size = 0;
  void* destination = nullptr;  // size bytes the caller owns
  uint32_t crc32c = 0;  // expected
  std::string label;
};

struct ReadOptions {
  int threads = 8;
  size_t chunk_bytes = kDefaultChunkBytes;
};

// Reads every item into its destination with several threads and checks each CRC; a
// mismatch is a kDataLoss error naming the file and the item, a short file a kDataLoss
// error naming how many bytes are missing.
Status ReadItemsFromFiles(const std::vector<std::string>& files, const std::vector<ReadItem>& items,
                          const ReadOptions& options);

}  // namespace fanrun
