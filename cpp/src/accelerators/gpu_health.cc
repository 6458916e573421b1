// The health gate's NVML reader: ECC, retired and remapped memory, throttle reasons, PCIe link,
// processes and memory of each GPU, with NVML opened once.
#include "fanrun/gpu_health.h"

#include <dlfcn.h>

#include <mutex>
#include <string>
#include <utility>

#include "accelerators/nvml_internal.h"

namespace fanrun {
namespace {

using nvml::Bind;
using nvml::NvmlMemory;
using nvml::nvmlDevice_t;
using nvml::nvmlReturn_t;
using nvml::NvmlUtilization;
constexpr nvmlReturn_t kNvmlSuccess = nvml::kSuccess;
constexpr nvmlReturn_t kNvmlInsufficientSize = 7;
constexpr int kUncorrectedErrors = 1;  // NVML_MEMORY_ERROR_TYPE_UNCORRECTED
constexpr int kVolatileCounter = 0;    // NVML_VOLATILE_ECC: since the driver was loaded
// nvmlProcessInfo_v2_t, which nvmlDeviceGetComputeRunningProcesses_v3 fills.
struct NvmlProcessInfo {
  unsigned int pid;
  unsigned long long used_gpu_memory;
  unsigned int gpu_instance_id;
  unsigned int compute_instance_id;
};
static_assert(sizeof(NvmlProcessInfo) == 24, "nvmlProcessInfo_v2_t is 24 bytes in nvml.h");

// NVML counts its initialisations; it is not documented as safe to start from several threads.
std::mutex init_mutex;

// A reading NVML gives through one out-argument: the value, or absent where it cannot answer.
template <typename T, typename F, typename... Args>
std::optional<T> Ask(F function, Args... args) {
  if (function == nullptr) return std::nullopt;
  T value{};
  if (function(args..., &value) != kNvmlSuccess) return std::nullopt;
  return value;
}

}  // namespace

struct GpuHealthReader::Library {
  void* handle = nullptr;
  nvmlReturn_t (*init)() = nullptr;
  nvmlReturn_t (*shutdown)() = nullptr;
  nvmlReturn_t (*device_count)(unsigned int*) = nullptr;
  nvmlReturn_t (*device_by_index)(unsigned int, nvmlDevice_t*) = nullptr;
  nvmlReturn_t (*device_uuid)(nvmlDevice_t, char*, unsigned int) = nullptr;
  nvmlReturn_t (*device_memory)(nvmlDevice_t, NvmlMemory*) = nullptr;
  // Each of these may be missing from an old driver: its reading is then absent.
  nvmlReturn_t (*total_ecc_errors)(nvmlDevice_t, int, int, unsigned long long*) = nullptr;
  nvmlReturn_t (*retired_pages_pending)(nvmlDevice_t, int*) = nullptr;
  nvmlReturn_t (*remapped_rows)(nvmlDevice_t, unsigned int*, unsigned int*, unsigned int*, unsigned int*) = nullptr;
  nvmlReturn_t (*throttle_reasons)(nvmlDevice_t, unsigned long long*) = nullptr;
  nvmlReturn_t (*pcie_generation)(nvmlDevice_t, unsigned int*) = nullptr;
  nvmlReturn_t (*pcie_generation_max)(nvmlDevice_t, unsigned int*) = nullptr;
  nvmlReturn_t (*pcie_width)(nvmlDevice_t, unsigned int*) = nullptr;
  nvmlReturn_t (*pcie_width_max)(nvmlDevice_t, unsigned int*) = nullptr;
  nvmlReturn_t (*utilization)(nvmlDevice_t, NvmlUtilization*) = nullptr;
  nvmlReturn_t (*compute_processes)(nvmlDevice_t, unsigned int*, NvmlProcessInfo*) = nullptr;
};

Result<std::unique_ptr<GpuHealthReader>> GpuHealthReader::Open(const std::string& nvml_library) {
  std::lock_guard<std::mutex> lock(init_mutex);
  auto library = std::make_unique<Library>();
  Library& nvml = *library;
  nvml.handle = ::dlopen(nvml_library.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (nvml.handle == nullptr) {
    const char* why = ::dlerror();
    return Status(StatusCode::kNotFound, nvml_library + " could not be loaded (no NVIDIA driver): " +
                                             (why != nullptr ? why : "unknown error"));
  }
  const bool bound = Bind(nvml.handle, "nvmlInit_v2", nvml.init) && Bind(nvml.handle, "nvmlShutdown", nvml.shutdown) &&
                     Bind(nvml.handle, "nvmlDeviceGetCount_v2", nvml.device_count) &&
                     Bind(nvml.handle, "nvmlDeviceGetHandleByIndex_v2", nvml.device_by_index) &&
                     Bind(nvml.handle, "nvmlDeviceGetUUID", nvml.device_uuid) &&
                     Bind(nvml.handle, "nvmlDeviceGetMemoryInfo", nvml.device_memory);
  Bind(nvml.handle, "nvmlDeviceGetTotalEccErrors", nvml.total_ecc_errors);
  Bind(nvml.handle, "nvmlDeviceGetRetiredPagesPendingStatus", nvml.retired_pages_pending);
  Bind(nvml.handle, "nvmlDeviceGetRemappedRows", nvml.remapped_rows);
  // The same entry point under its newer name (drivers since R535) first, then its older one.
  Bind(nvml.handle, "nvmlDeviceGetCurrentClocksEventReasons", nvml.throttle_reasons) ||
      Bind(nvml.handle, "nvmlDeviceGetCurrentClocksThrottleReasons", nvml.throttle_reasons);
  Bind(nvml.handle, "nvmlDeviceGetCurrPcieLinkGeneration", nvml.pcie_generation);
  Bind(nvml.handle, "nvmlDeviceGetMaxPcieLinkGeneration", nvml.pcie_generation_max);
  Bind(nvml.handle, "nvmlDeviceGetCurrPcieLinkWidth", nvml.pcie_width);
  Bind(nvml.handle, "nvmlDeviceGetMaxPcieLinkWidth", nvml.pcie_width_max);
  Bind(nvml.handle, "nvmlDeviceGetUtilizationRates", nvml.utilization);
  Bind(nvml.handle, "nvmlDeviceGetComputeRunningProcesses_v3", nvml.compute_processes);
  Status status;
  unsigned int count = 0;
  if (!bound) {
    status = Status(StatusCode::kInternal, nvml_library + " lacks an NVML function fanrun needs");
  } else if (nvml.init() != kNvmlSuccess) {
    status = Status(StatusCode::kInternal, "NVML failed to initialise (driver not loaded?)");
  } else if (nvml.device_count(&count) != kNvmlSuccess) {
    nvml.shutdown();
    status = Status(StatusCode::kInternal, "NVML could not count the GPUs");
  } else {
    return std::unique_ptr<GpuHealthReader>(new GpuHealthReader(std::move(library), count));
  }
  ::dlclose(nvml.handle);
  return status;
}

GpuHealthReader::GpuHealthReader(std::unique_ptr<Library> library, unsigned int count)
    : library_(std::move(library)), count_(count) {}

GpuHealthReader::~GpuHealthReader() {
  std::lock_guard<std::mutex> lock(init_mutex);
  library_->shutdown();
  ::dlclose(library_->handle);
}

Result<std::vector<GpuHealthReading>> GpuHealthReader::Read(const std::vector<int>& nvml_indices) {
  const Library& nvml = *library_;
  std::vector<GpuHealthReading> readings;
  for (int index : nvml_indices) {
    if (index < 0 || static_cast<unsigned int>(index) >= count_) {
      return Status(StatusCode::kInvalid, "GPU " + std::to_string(index) + " does not exist: NVML reports " +
                                              std::to_string(count_) + " GPUs");
    }
    GpuHealthReading reading;
    reading.nvml_index = index;
    nvmlDevice_t device = nullptr;
    // A GPU that stopped answering keeps every field absent; the gate says so.
    if (nvml.device_by_index(static_cast<unsigned int>(index), &device) != kNvmlSuccess) {
      readings.push_back(reading);
      continue;
    }
    char uuid[96] = {0};
    if (nvml.device_uuid(device, uuid, sizeof(uuid)) == kNvmlSuccess) reading.uuid = uuid;
    reading.ecc_uncorrected_volatile =
        Ask<unsigned long long>(nvml.total_ecc_errors, device, kUncorrectedErrors, kVolatileCounter);
    if (auto pending = Ask<int>(nvml.retired_pages_pending, device)) reading.retired_pages_pending = *pending != 0;
    unsigned int corrected = 0, uncorrected = 0, pending = 0, failure = 0;
    if (nvml.remapped_rows != nullptr &&
        nvml.remapped_rows(device, &corrected, &uncorrected, &pending, &failure) == kNvmlSuccess) {
      reading.remapped_rows_pending = pending != 0;
      reading.remapped_rows_failure = failure != 0;
    }
    reading.throttle_reasons = Ask<unsigned long long>(nvml.throttle_reasons, device);
    reading.pcie_generation = Ask<unsigned int>(nvml.pcie_generation, device);
    reading.pcie_generation_max = Ask<unsigned int>(nvml.pcie_generation_max, device);
    reading.pcie_width = Ask<unsigned int>(nvml.pcie_width, device);
    reading.pcie_width_max = Ask<unsigned int>(nvml.pcie_width_max, device);
    if (auto utilization = Ask<NvmlUtilization>(nvml.utilization, device)) {
      reading.utilization_percent = utilization->gpu;
    }
    if (auto memory = Ask<NvmlMemory>(nvml.device_memory, device)) {
      reading.memory_used = memory->used;
      reading.memory_total = memory->total;
    }
    if (nvml.compute_processes != nullptr) {
      // The list may grow between asking its size and reading it: ask again, a few times.
      std::vector<NvmlProcessInfo> infos(8);
      for (int round = 0; round < 4; ++round) {
        unsigned int size = static_cast<unsigned int>(infos.size());
        const nvmlReturn_t answer = nvml.compute_processes(device, &size, infos.data());
        if (answer == kNvmlInsufficientSize) {
          infos.resize(size + 8);
          continue;
        }
        if (answer == kNvmlSuccess) {
          std::vector<GpuProcess> processes;
          for (unsigned int i = 0; i < size && i < infos.size(); ++i) {
            processes.push_back(GpuProcess{infos[i].pid, infos[i].used_gpu_memory});
          }
          reading.compute_processes = std::move(processes);
        }
        break;
      }
    }
    readings.push_back(std::move(reading));
  }
  return readings;
}

}  // namespace fanrun
