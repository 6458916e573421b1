// Parallel chunked writes and checked parallel reads of checkpoint data files.
#include "fanrun/checkpoint_io.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <mutex>
#include <thread>

#include "fanrun/checkpoint_crc32c.h"

namespace fanrun {
namespace {

// One piece of one item, handled by whichever thread takes it next.
struct Chunk {
  size_t item = 0;
  size_t offset_in_item = 0;
  size_t size = 0;
};

std::vector<Chunk> CutIntoChunks(const std::vector<size_t>& item_sizes, size_t chunk_bytes,
                                 std::vector<size_t>* first_chunk_of_item) {
  std::vector<Chunk> chunks;
  first_chunk_of_item->clear();
  for (size_t i = 0; i < item_sizes.size(); ++i) {
    first_chunk_of_item->push_back(chunks.size());
    size_t done = 0;
    do {  // an empty item still gets one (empty) chunk, so that it has a CRC
      const size_t size = std::min(chunk_bytes, item_sizes[i] - done);
      chunks.push_back(Chunk{i, done, size});
      done += size;
    } while (done < item_sizes[i]);
  }
  first_chunk_of_item->push_back(chunks.size());
  return chunks;
}

// Runs work(chunk_index) over every chunk on `threads` threads; the first failure stops the
// others from taking new chunks and is the one returned.
template <typename Work>
Status RunOnThreads(size_t chunk_count, int threads, Work work) {
  std::atomic<size_t> next{0};
  std::atomic<bool> failed{false};
  std::mutex mutex;
  Status first_error;
  auto loop = [&] {
    for (size_t index = next++; index < chunk_count && !failed; index = next++) {
      Status st = work(index);
      if (!st.ok()) {
        std::lock_guard<std::mutex> lock(mutex);
        if (first_error.ok()) first_error = std::move(st);
        failed = true;
      }
    }
  };
  const size_t count = std::max<size_t>(1, std::min<size_t>(static_cast<size_t>(std::max(threads, 1)), chunk_count));
  std::vector<std::thread> pool;
  pool.reserve(count - 1);
  for (size_t i = 1; i < count; ++i) pool.emplace_back(loop);
  loop();
  for (auto& thread : pool) thread.join();
  return first_error;
}

Status PwriteAll(int fd, const char* data, size_t size, uint64_t offset, const std::string& path,
                 const std::string& label) {
  while (size > 0) {
    const ssize_t n = ::pwrite(fd, data, size, static_cast<off_t>(offset));
    if (n < 0) {
      if (errno == EINTR) continue;
      return Status::IOErrorFromErrno(errno, "Failed to write item '", label, "' to '", path, "' at offset ",
                                      offset);
    }
    data += n;
    size -= static_cast<size_t>(n);
    offset += static_cast<uint64_t>(n);
  }
  return Status::OK();
}

Status PreadAll(int fd, char* data, size_t size, uint64_t offset, const std::string& path,
                const std::string& label) {
  while (size > 0) {
    const ssize_t n = ::pread(fd, data, size, static_cast<off_t>(offset));
    if (n < 0) {
      if (errno == EINTR) continue;
      return Status::IOErrorFromErrno(errno, "Failed to read item '", label, "' from '", path, "' at offset ",
                                      offset);
    }
    if (n == 0) {
      return Status::DataLoss("Checkpoint file '", path, "' is truncated: it ends at byte ", offset,
                              " but item '", label, "' needs ", size, " more bytes");
    }
    data += n;
    size -= static_cast<size_t>(n);
    offset += static_cast<uint64_t>(n);
  }
  return Status::OK();
}

// Reserves the file's blocks so that ENOSPC / EFBIG come before the data is written.
// Filesystems without fallocate (some network ones) are written without the reservation.
Status Reserve(int fd, uint64_t size, const std::string& path) {
  if (size == 0) return Status::OK();
  int rc;
  do {
    rc = ::fallocate(fd, 0, 0, static_cast<off_t>(size));
  } while (rc != 0 && errno == EINTR);
  if (rc != 0 && errno != EOPNOTSUPP && errno != ENOSYS) {
    return Status::IOErrorFromErrno(errno, "Failed to reserve ", size, " bytes for '", path, "'");
  }
  return Status::OK();
}

uint32_t CombineChunks(const std::vector<uint32_t>& chunk_crcs, const std::vector<Chunk>& chunks, size_t first,
                       size_t last) {
  uint32_t crc = chunk_crcs[first];
  for (size_t c = first + 1; c < last; ++c) crc = Crc32cCombine(crc, chunk_crcs[c], chunks[c].size);
  return crc;
}

}  // namespace

Result<std::unique_ptr<CheckpointFileWriter>> CheckpointFileWriter::Create(const std::string& path, uint64_t size,
                                                                          const WriteOptions& options) {
  if (options.chunk_bytes == 0) return Status::Invalid("chunk_bytes must be positive");
  FANRUN_ASSIGN_OR_RETURN(FileDescriptor file, OpenFile(path, O_WRONLY | O_CREAT | O_EXCL, 0644));
  std::unique_ptr<CheckpointFileWriter> writer(new CheckpointFileWriter(path, std::move(file), options));
  FANRUN_RETURN_NOT_OK(Reserve(writer->file_.fd(), size, path));  // the destructor removes the file
  return writer;
}

CheckpointFileWriter::~CheckpointFileWriter() { Abort(); }

void CheckpointFileWriter::Abort() {
  if (finished_) return;
  finished_ = true;
  FANRUN_WARN_NOT_OK(file_.Close(), "closing an abandoned checkpoint file");
  ::unlink(path_.c_str());
}

Result<std::vector<uint32_t>> CheckpointFileWriter::Write(const std::vector<WriteItem>& items) {
  if (finished_) return Status::Invalid("Checkpoint file '", path_, "' is already finished");
  std::vector<size_t> sizes;
  sizes.reserve(items.size());
  for (const WriteItem& item : items) {
    if (item.size > 0 && item.data == nullptr) return Status::Invalid("Item '", item.label, "' has no data");
    sizes.push_back(item.size);
  }
  std::vector<size_t> first_chunk;
  const std::vector<Chunk> chunks = CutIntoChunks(sizes, options_.chunk_bytes, &first_chunk);
  std::vector<uint32_t> chunk_crcs(chunks.size(), 0);
  const int fd = file_.fd();
  FANRUN_RETURN_NOT_OK(RunOnThreads(chunks.size(), options_.threads, [&](size_t index) -> Status {
    const Chunk& chunk = chunks[index];
    const WriteItem& item = items[chunk.item];
    if (chunk.size == 0) return Status::OK();
    const char* data = static_cast<const char*>(item.data) + chunk.offset_in_item;
    chunk_crcs[index] = Crc32c(0, data, chunk.size);
    const uint64_t offset = item.offset + chunk.offset_in_item;
    Status st = PwriteAll(fd, data, chunk.size, offset, path_, item.label);
    if (!st.ok()) return st;
    // Starts writeback of this chunk now, so that the disk works while later chunks are
    // still being copied and the final fsync has little left to wait for. A hint only: if it
    // fails, Finish's fsync still writes everything.
    ::sync_file_range(fd, static_cast<off_t>(offset), static_cast<off_t>(chunk.size), SYNC_FILE_RANGE_WRITE);
    return Status::OK();
  }));
  std::vector<uint32_t> crcs(items.size());
  for (size_t i = 0; i < items.size(); ++i) crcs[i] = CombineChunks(chunk_crcs, chunks, first_chunk[i], first_chunk[i + 1]);
  return crcs;
}

Status CheckpointFileWriter::Finish() {
  if (finished_) return Status::Invalid("Checkpoint file '", path_, "' is already finished");
  if (::fsync(file_.fd()) != 0) return Status::IOErrorFromErrno(errno, "Failed to fsync '", path_, "'");
  FANRUN_RETURN_NOT_OK(file_.Close());
  finished_ = true;
  return Status::OK();
}

Result<std::vector<uint32_t>> WriteItemsToFile(const std::string& path, const std::vector<WriteItem>& items,
                                               const WriteOptions& options) {
  uint64_t size = 0;
  for (const WriteItem& item : items) size = std::max<uint64_t>(size, item.offset + item.size);
  FANRUN_ASSIGN_OR_RETURN(std::unique_ptr<CheckpointFileWriter> writer,
                          CheckpointFileWriter::Create(path, size, options));
  FANRUN_ASSIGN_OR_RETURN(std::vector<uint32_t> crcs, writer->Write(items));
  FANRUN_RETURN_NOT_OK(writer->Finish());
  return crcs;
}

Status ReadItemsFromFiles(const std::vector<std::string>& files, const std::vector<ReadItem>& items,
                          const ReadOptions& options) {
  if (options.chunk_bytes == 0) return Status::Invalid("chunk_bytes must be positive");
  std::vector<size_t> sizes;
  sizes.reserve(items.size());
  std::vector<bool> used(files.size(), false);
  for (const ReadItem& item : items) {
    if (item.file >= files.size()) {
      return Status::Invalid("Item '", item.label, "' names file ", item.file, " of ", files.size());
    }
    if (item.destination_size > 0 && item.destination == nullptr) {
      return Status::Invalid("Item '", item.label, "' has no destination");
    }
    if (item.size != item.destination_size) {
      return Status::DataLoss("Checkpoint item '", item.label, "' is ", item.size,
                              " bytes long in the checkpoint's metadata, but its destination holds ",
                              item.destination_size, " bytes: the metadata is damaged. Load an older checkpoint");
    }
    used[item.file] = true;
    sizes.push_back(item.size);
  }
  std::vector<FileDescriptor> descriptors(files.size());
  std::vector<uint64_t> file_sizes(files.size(), 0);
  for (size_t f = 0; f < files.size(); ++f) {
    if (!used[f]) continue;
    auto opened = OpenFile(files[f], O_RDONLY);
    if (!opened.ok()) {
      if (opened.status().code() == StatusCode::kNotFound) {
        return Status::DataLoss("Checkpoint file '", files[f], "' is missing");
      }
      return opened.status();
    }
    descriptors[f] = std::move(opened).ValueOrDie();
    struct stat st;
    if (::fstat(descriptors[f].fd(), &st) != 0) {
      return Status::IOErrorFromErrno(errno, "Failed to stat '", files[f], "'");
    }
    file_sizes[f] = static_cast<uint64_t>(st.st_size);
    // A hint only: a filesystem that ignores it reads just the same.
    ::posix_fadvise(descriptors[f].fd(), 0, 0, POSIX_FADV_SEQUENTIAL);
  }
  for (const ReadItem& item : items) {
    const uint64_t file_size = file_sizes[item.file];
    // Written so that no sum can overflow: offset + size may not fit in 64 bits. An empty item
    // reads nothing, wherever it says it lies.
    if (item.size > 0 && (item.offset > file_size || item.size > file_size - item.offset)) {
      return Status::DataLoss("Checkpoint file '", files[item.file], "' is truncated or the metadata is damaged: item '",
                              item.label, "' is ", item.size, " bytes at offset ", item.offset,
                              ", past the file's end at byte ", file_size, ". Load an older checkpoint");
    }
  }

  std::vector<size_t> first_chunk;
  const std::vector<Chunk> chunks = CutIntoChunks(sizes, options.chunk_bytes, &first_chunk);
  std::vector<uint32_t> chunk_crcs(chunks.size(), 0);
  Status st = RunOnThreads(chunks.size(), options.threads, [&](size_t index) -> Status {
    const Chunk& chunk = chunks[index];
    const ReadItem& item = items[chunk.item];
    if (chunk.size == 0) return Status::OK();
    char* data = static_cast<char*>(item.destination) + chunk.offset_in_item;
    FANRUN_RETURN_NOT_OK(PreadAll(descriptors[item.file].fd(), data, chunk.size, item.offset + chunk.offset_in_item,
                                  files[item.file], item.label));
    chunk_crcs[index] = Crc32c(0, data, chunk.size);
    return Status::OK();
  });
  if (!st.ok()) return st;

  for (size_t i = 0; i < items.size(); ++i) {
    const uint32_t crc = CombineChunks(chunk_crcs, chunks, first_chunk[i], first_chunk[i + 1]);
    if (crc != items[i].crc32c) {
      char hex[2][16];
      std::snprintf(hex[0], sizeof(hex[0]), "%08x", items[i].crc32c);
      std::snprintf(hex[1], sizeof(hex[1]), "%08x", crc);
      return Status::DataLoss("Checksum mismatch in checkpoint file '", files[items[i].file], "', item '",
                              items[i].label, "' (bytes ", items[i].offset, " to ", items[i].offset + items[i].size,
                              "): stored CRC32C ", std::string_view(hex[0]), ", read ", std::string_view(hex[1]),
                              ". The file was damaged after it was written; load an older checkpoint");
    }
  }
  return Status::OK();
}

}  // namespace fanrun
