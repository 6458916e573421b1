// Which GPUs this machine has, read from NVML loaded with dlopen: fanrun has no
// link-time dependency on CUDA and runs the same where there is no driver at all.
#pragma once

#include <cstdint>
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

}  // namespace fanrun
