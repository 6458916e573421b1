// What a GPU's health gate reads from NVML, loaded with dlopen and kept open between readings,
// so that a gate before every call costs a few NVML queries, not a driver start.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "fanrun/status.h"

namespace fanrun {

// A process that holds memory on a GPU, as the driver lists it.
struct GpuProcess {
  uint32_t pid = 0;
  uint64_t used_memory = 0;  // bytes; NVML's "not available" marker where the driver cannot say
};

// One reading of one GPU's health. Each field is absent (nullopt) where NVML says that this GPU
// or driver does not support it, or could not answer: the gate judges what it was given.
struct GpuHealthReading {
  int nvml_index = 0;
  std::string uuid;
  std::optional<uint64_t> ecc_uncorrected_volatile;  // since the last driver load
  std::optional<bool> retired_pages_pending;         // pre-Ampere page retirement, awaiting a reset
  std::optional<bool> remapped_rows_pending;         // Ampere+ row remapping, awaiting a reset
  std::optional<bool> remapped_rows_failure;         // a row could not be remapped
  std::optional<uint64_t> throttle_reasons;          // nvmlClocksThrottleReason bits
  std::optional<uint32_t> pcie_generation, pcie_generation_max;
  std::optional<uint32_t> pcie_width, pcie_width_max;
  std::optional<uint32_t> utilization_percent;
  std::optional<uint64_t> memory_used, memory_total;  // bytes
  std::optional<std::vector<GpuProcess>> compute_processes;
};

class GpuHealthReader {
 public:
  // NotFound when the library cannot be loaded (no NVIDIA driver), Internal when NVML does not
  // initialise or lacks a function every driver has; the message says which.
  static Result<std::unique_ptr<GpuHealthReader>> Open(const std::string& nvml_library = "libnvidia-ml.so.1");
  ~GpuHealthReader();
  GpuHealthReader(const GpuHealthReader&) = delete;
  GpuHealthReader& operator=(const GpuHealthReader&) = delete;

  // The GPUs the driver reports now (a GPU fallen off the bus is not among them).
  unsigned int Count() const { return count_; }

  // One reading per index, in that order; Invalid for an index the driver does not have.
  Result<std::vector<GpuHealthReading>> Read(const std::vector<int>& nvml_indices);

 private:
  struct Library;
  GpuHealthReader(std::unique_ptr<Library> library, unsigned int count);
  std::unique_ptr<Library> library_;
  unsigned int count_ = 0;
};

}  // namespace fanrun
