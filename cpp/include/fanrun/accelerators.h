// Which GPUs this machine has, read from NVML loaded with dlopen: fanrun has no
// link-time dependency on CUDA and runs the same where there is no driver at all.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "fanrun/status.h"

namespace fanrun {

struct GpuInfo {
  int nvml_index = 0;        // the driver's numbering, not CUDA_VISIBLE_DEVICES'
  std::string name;          // "NVIDIA H200"
  std::string uuid;          // "GPU-..."
  uint64_t memory_total = 0; // bytes
};

struct GpuInventory {
  std::vector<GpuInfo> gpus;
  std::string driver_version;
  // Why no GPU was found, when none was: "libnvidia-ml.so.1 not found", ...
  std::string note;
};

// Never an error for a machine without GPUs: that is an empty inventory with a note.
GpuInventory DetectGpus(const std::string& nvml_library = "libnvidia-ml.so.1");

// The GPUs a process sees under CUDA_VISIBLE_DEVICES=`visible`, in the order it
// sees them: indices or UUID prefixes, comma-separated; CUDA stops at the first
// entry it cannot resolve, and so does this. `visible_is_set` false: all of them.
std::vector<GpuInfo> ApplyVisibleDevices(const std::vector<GpuInfo>& gpus, bool visible_is_set,
                                         const std::string& visible);

// One reading of one GPU, for system metrics. A field NVML could not read is marked absent.
struct GpuSample {
  int nvml_index = 0;
  bool has_utilization = false;
  unsigned int utilization_percent = 0;  // of the last sample period the GPU was busy
  bool has_memory = false;
  uint64_t memory_used = 0;   // bytes
  uint64_t memory_total = 0;  // bytes
};

// Reads utilisation and memory of GPUs, again and again, with NVML opened once: opening
// it costs far more than a reading on a machine with many GPUs.
class GpuSampler {
 public:
  // NotFound when the library cannot be loaded (no NVIDIA driver), Internal when NVML
  // lacks a function or does not initialise; the message says which.
  static Result<std::unique_ptr<GpuSampler>> Open(const std::string& nvml_library = "libnvidia-ml.so.1");
  ~GpuSampler();
  GpuSampler(const GpuSampler&) = delete;
  GpuSampler& operator=(const GpuSampler&) = delete;

  // One sample per index, in that order; Invalid for an index the driver does not have.
  Result<std::vector<GpuSample>> Sample(const std::vector<int>& nvml_indices);

 private:
  struct Library;
  explicit GpuSampler(std::unique_ptr<Library> library);
  std::unique_ptr<Library> library_;
};

}  // namespace fanrun
