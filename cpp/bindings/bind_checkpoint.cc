// Python access to the checkpoint I/O engine: batched parallel writes and checked parallel reads
// of raw memory (tensor data pointers the caller keeps alive), and atomic publication.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/unique_ptr.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <tuple>

#include "call_without_gil.h"
#include "fanrun/checkpoint_crc32c.h"
#include "fanrun/checkpoint_io.h"
#include "fanrun/checkpoint_publish.h"
#include "status_to_python.h"

namespace nb = nanobind;

namespace fanrun::bindings {
namespace {

using WriteTuple = std::tuple<uintptr_t, size_t, uint64_t, std::string>;  // (address, size, offset, label)
using ReadTuple = std::tuple<size_t, uint64_t, size_t, uintptr_t, size_t, uint32_t, std::string>;
//                          (file, offset, size, destination address, destination size, crc32c, label)

std::unique_ptr<CheckpointFileWriter> CreateWriter(const std::string& path, uint64_t size, int threads,
                                                   size_t chunk_bytes) {
  return CallWithoutGil([&] { return CheckpointFileWriter::Create(path, size, WriteOptions{threads, chunk_bytes}); });
}

std::vector<uint32_t> WriteBatch(CheckpointFileWriter& writer, const std::vector<WriteTuple>& tuples) {
  std::vector<WriteItem> items;
  items.reserve(tuples.size());
  for (const auto& [address, size, offset, label] : tuples) {
    items.push_back(WriteItem{reinterpret_cast<const void*>(address), size, offset, label});
  }
  return CallWithoutGil([&] { return writer.Write(items); });
}

void ReadItems(const std::vector<std::string>& files, const std::vector<ReadTuple>& tuples, int threads,
               size_t chunk_bytes) {
  std::vector<ReadItem> items;
  items.reserve(tuples.size());
  for (const auto& [file, offset, size, address, destination_size, crc, label] : tuples) {
    items.push_back(ReadItem{file, offset, size, reinterpret_cast<void*>(address), destination_size, crc, label});
  }
  CallWithoutGil([&] { return ReadItemsFromFiles(files, items, ReadOptions{threads, chunk_bytes}); });
}

}  // namespace

void BindCheckpoint(nb::module_& m) {
  m.attr("CHECKPOINT_CHUNK_BYTES") = kDefaultChunkBytes;
  nb::class_<CheckpointFileWriter>(m, "CheckpointFileWriter",
                                   "One rank's checkpoint data file, written in batches by the engine's threads; removed\n"
                                   "unless finish() succeeds (abort(), or garbage).")
      .def_static("create", &CreateWriter, nb::arg("path"), nb::arg("size"), nb::arg("threads"),
                  nb::arg("chunk_bytes"), "The file must not exist; size bytes are reserved at once.")
      .def("write", &WriteBatch, nb::arg("items"),
           "items: (address, size, offset, label), an address a tensor's data pointer that the caller keeps\n"
           "alive; returns each item's CRC32C.")
      .def("finish", [](CheckpointFileWriter& writer) { CallWithoutGil([&] { return writer.Finish(); }); })
      .def("abort", &CheckpointFileWriter::Abort);
  m.def("read_checkpoint_items", &ReadItems, nb::arg("files"), nb::arg("items"), nb::arg("threads"),
        nb::arg("chunk_bytes"),
        "items: (file index, offset, size, destination address, destination size, expected CRC32C, label),\n"
        "a destination a tensor's data pointer that the caller keeps alive. An item whose size is not its\n"
        "destination's, or that lies past its file's end, reads nothing.");
  m.def(
      "publish_directory",
      [](const std::string& staging, const std::string& target) {
        return CallWithoutGil([&] { return PublishDirectory(staging, target); });
      },
      nb::arg("staging"), nb::arg("target"),
      "Moves the complete checkpoint staging to target (checkpoint_publish.h); returns where the replaced\n"
      "checkpoint now lies (\"\" if there was none), for the caller to remove.");
  m.def("crc32c_has_hardware", &Crc32cHasHardware);
}

}  // namespace fanrun::bindings
