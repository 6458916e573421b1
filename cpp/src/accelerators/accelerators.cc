// GPU detection through NVML, loaded at run time.
#include "fanrun/accelerators.h"

#include <dlfcn.h>

#include <cctype>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <string>

#include "accelerators/nvml_internal.h"

namespace fanrun {
namespace {

using nvml::Bind;
using nvml::NvmlMemory;
using nvml::nvmlDevice_t;
using nvml::nvmlReturn_t;
using nvml::NvmlUtilization;

// The few NVML entry points fanrun uses.

struct Nvml {
  void* handle = nullptr;
  nvmlReturn_t (*init)() = nullptr;
  nvmlReturn_t (*shutdown)() = nullptr;
  nvmlReturn_t (*device_count)(unsigned int*) = nullptr;
  nvmlReturn_t (*device_by_index)(unsigned int, nvmlDevice_t*) = nullptr;
  nvmlReturn_t (*device_name)(nvmlDevice_t, char*, unsigned int) = nullptr;
  nvmlReturn_t (*device_uuid)(nvmlDevice_t, char*, unsigned int) = nullptr;
  nvmlReturn_t (*device_memory)(nvmlDevice_t, NvmlMemory*) = nullptr;
  nvmlReturn_t (*driver_version)(char*, unsigned int) = nullptr;
  nvmlReturn_t (*device_utilization)(nvmlDevice_t, NvmlUtilization*) = nullptr;
};

// An NVML failure as a status.
Status NvmlStatus(StatusCode code, std::string message) { return Status(code, std::move(message)); }

// Opens NVML and initialises it; the caller shuts it down. NotFound: the library is not
// there (no NVIDIA driver); Internal: it lacks a function fanrun needs or does not start.
Status OpenNvml(const std::string& library, Nvml& nvml) {
  nvml.handle = ::dlopen(library.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (nvml.handle == nullptr) {
    const char* why = ::dlerror();
    return NvmlStatus(StatusCode::kNotFound,
                      library + " could not be loaded (no NVIDIA driver): " + (why != nullptr ? why : "unknown error"));
  }
  const bool bound = Bind(nvml.handle, "nvmlInit_v2", nvml.init) &&
                     Bind(nvml.handle, "nvmlShutdown", nvml.shutdown) &&
                     Bind(nvml.handle, "nvmlDeviceGetCount_v2", nvml.device_count) &&
                     Bind(nvml.handle, "nvmlDeviceGetHandleByIndex_v2", nvml.device_by_index) &&
                     Bind(nvml.handle, "nvmlDeviceGetName", nvml.device_name) &&
                     Bind(nvml.handle, "nvmlDeviceGetUUID", nvml.device_uuid) &&
                     Bind(nvml.handle, "nvmlDeviceGetMemoryInfo", nvml.device_memory) &&
                     Bind(nvml.handle, "nvmlSystemGetDriverVersion", nvml.driver_version);
  // Optional: detection works without it, only sampling needs it.
  Bind(nvml.handle, "nvmlDeviceGetUtilizationRates", nvml.device_utilization);
  Status status;
  if (!bound) {
    status = NvmlStatus(StatusCode::kInternal, library + " lacks an NVML function fanrun needs");
  } else if (nvml.init() != 0) {
    status = NvmlStatus(StatusCode::kInternal, "NVML failed to initialise (driver not loaded?)");
  } else {
    return Status::OK();
  }
  ::dlclose(nvml.handle);
  nvml.handle = nullptr;
  return status;
}

void CloseNvml(Nvml& nvml) {
  nvml.shutdown();
  ::dlclose(nvml.handle);
}

// NVML is not documented as safe to initialise from several threads at once.
std::mutex nvml_mutex;

bool StartsWith(const std::string& s, const std::string& prefix) { return s.compare(0, prefix.size(), prefix) == 0; }

std::string Trim(const std::string& s) {
  size_t begin = 0, end = s.size();
  while (begin < end && std::isspace(static_cast<unsigned char>(s[begin]))) ++begin;
  while (end > begin && std::isspace(static_cast<unsigned char>(s[end - 1]))) --end;
  return s.substr(begin, end - begin);
}

}  // namespace

GpuInventory DetectGpus(const std::string& nvml_library) {
  std::lock_guard<std::mutex> lock(nvml_mutex);
  GpuInventory inventory;
  Nvml nvml;
  Status opened = OpenNvml(nvml_library, nvml);
  if (!opened.ok()) {
    inventory.note = opened.message();
    return inventory;
  }
  char text[96] = {0};
  if (nvml.driver_version(text, sizeof(text)) == 0) inventory.driver_version = text;
  unsigned int count = 0;
  if (nvml.device_count(&count) != 0) {
    inventory.note = "NVML could not count the GPUs";
    count = 0;
  }
  for (unsigned int i = 0; i < count; ++i) {
    nvmlDevice_t device = nullptr;
    if (nvml.device_by_index(i, &device) != 0) continue;
    GpuInfo info;
    info.nvml_index = static_cast<int>(i);
    if (nvml.device_name(device, text, sizeof(text)) == 0) info.name = text;
    if (nvml.device_uuid(device, text, sizeof(text)) == 0) info.uuid = text;
    NvmlMemory memory{};
    if (nvml.device_memory(device, &memory) == 0) info.memory_total = memory.total;
    inventory.gpus.push_back(info);
  }
  if (inventory.gpus.empty() && inventory.note.empty()) inventory.note = "the NVIDIA driver reports no GPU";
  CloseNvml(nvml);
  return inventory;
}

struct GpuSampler::Library {
  Nvml nvml;
  unsigned int count = 0;
};

Result<std::unique_ptr<GpuSampler>> GpuSampler::Open(const std::string& nvml_library) {
  std::lock_guard<std::mutex> lock(nvml_mutex);
  auto library = std::make_unique<Library>();
  FANRUN_RETURN_NOT_OK(OpenNvml(nvml_library, library->nvml));
  Status status;
  if (library->nvml.device_utilization == nullptr) {
    status = NvmlStatus(StatusCode::kInternal, nvml_library + " lacks nvmlDeviceGetUtilizationRates (driver too old?)");
  } else if (library->nvml.device_count(&library->count) != 0) {
    status = NvmlStatus(StatusCode::kInternal, "NVML could not count the GPUs");
  }
  if (!status.ok()) {
    CloseNvml(library->nvml);
    return status;
  }
  return std::unique_ptr<GpuSampler>(new GpuSampler(std::move(library)));
}

GpuSampler::GpuSampler(std::unique_ptr<Library> library) : library_(std::move(library)) {}

GpuSampler::~GpuSampler() {
  std::lock_guard<std::mutex> lock(nvml_mutex);
  CloseNvml(library_->nvml);
}

Result<std::vector<GpuSample>> GpuSampler::Sample(const std::vector<int>& nvml_indices) {
  const Nvml& nvml = library_->nvml;
  std::vector<GpuSample> samples;
  for (int index : nvml_indices) {
    if (index < 0 || static_cast<unsigned int>(index) >= library_->count) {
      return NvmlStatus(StatusCode::kInvalid, "GPU " + std::to_string(index) + " does not exist: NVML reports " +
                                                  std::to_string(library_->count) + " GPUs");
    }
    GpuSample sample;
    sample.nvml_index = index;
    nvmlDevice_t device = nullptr;
    // A GPU that stopped answering (fallen off the bus, reset) has its fields absent,
    // so the others are still reported.
    if (nvml.device_by_index(static_cast<unsigned int>(index), &device) == 0) {
      NvmlUtilization utilization{};
      if (nvml.device_utilization(device, &utilization) == 0) {
        sample.has_utilization = true;
        sample.utilization_percent = utilization.gpu;
      }
      NvmlMemory memory{};
      if (nvml.device_memory(device, &memory) == 0) {
        sample.has_memory = true;
        sample.memory_used = memory.used;
        sample.memory_total = memory.total;
      }
    }
    samples.push_back(sample);
  }
  return samples;
}

std::vector<GpuInfo> ApplyVisibleDevices(const std::vector<GpuInfo>& gpus, bool visible_is_set,
                                         const std::string& visible) {
  if (!visible_is_set) return gpus;
  std::vector<GpuInfo> seen;
  size_t start = 0;
  while (start <= visible.size()) {
    size_t end = visible.find(',', start);
    if (end == std::string::npos) end = visible.size();
    const std::string entry = Trim(visible.substr(start, end - start));
    start = end + 1;
    const GpuInfo* match = nullptr;
    if (!entry.empty() && std::isdigit(static_cast<unsigned char>(entry[0]))) {
      char* parsed_end = nullptr;
      const long index = std::strtol(entry.c_str(), &parsed_end, 10);
      const bool whole = parsed_end == entry.c_str() + entry.size();
      for (const auto& gpu : gpus) {
        if (whole && gpu.nvml_index == index) match = &gpu;
      }
    } else if (StartsWith(entry, "GPU-")) {
      for (const auto& gpu : gpus) {
        if (StartsWith(gpu.uuid, entry)) {
          if (match != nullptr) return seen;  // an ambiguous prefix: CUDA stops there
          match = &gpu;
        }
      }
    }
    if (match == nullptr) break;
    seen.push_back(*match);
  }
  return seen;
}

}  // namespace fanrun
