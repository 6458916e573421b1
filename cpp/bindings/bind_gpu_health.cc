// Python access to the health gate's NVML reader.
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <optional>

#include "call_without_gil.h"
#include "fanrun/gpu_health.h"
#include "status_to_python.h"

namespace nb = nanobind;

namespace fanrun::bindings {
namespace {

template <typename T>
nb::object OrNone(const std::optional<T>& value) {
  return value.has_value() ? nb::cast(*value) : nb::none();
}

nb::dict ReadingToPython(const GpuHealthReading& reading) {
  nb::dict out;
  out["nvml_index"] = reading.nvml_index;
  out["uuid"] = reading.uuid;
  // None where NVML does not support the reading on this GPU or driver.
  out["ecc_uncorrected_volatile"] = OrNone(reading.ecc_uncorrected_volatile);
  out["retired_pages_pending"] = OrNone(reading.retired_pages_pending);
  out["remapped_rows_pending"] = OrNone(reading.remapped_rows_pending);
  out["remapped_rows_failure"] = OrNone(reading.remapped_rows_failure);
  out["throttle_reasons"] = OrNone(reading.throttle_reasons);
  out["pcie_generation"] = OrNone(reading.pcie_generation);
  out["pcie_generation_max"] = OrNone(reading.pcie_generation_max);
  out["pcie_width"] = OrNone(reading.pcie_width);
  out["pcie_width_max"] = OrNone(reading.pcie_width_max);
  out["utilization_percent"] = OrNone(reading.utilization_percent);
  out["memory_used"] = OrNone(reading.memory_used);
  out["memory_total"] = OrNone(reading.memory_total);
  if (reading.compute_processes.has_value()) {
    nb::list processes;
    for (const GpuProcess& process : *reading.compute_processes) {
      nb::dict entry;
      entry["pid"] = process.pid;
      entry["used_memory"] = process.used_memory;
      processes.append(entry);
    }
    out["compute_processes"] = processes;
  } else {
    out["compute_processes"] = nb::none();
  }
  return out;
}

}  // namespace

void BindGpuHealth(nb::module_& m) {
  nb::class_<GpuHealthReader>(m, "GpuHealthReader",
                              "What the GPU health gate reads from NVML, with NVML kept open between readings.")
      .def_static(
          "open",
          [](const std::string& library) -> nb::typed<nb::tuple, std::optional<GpuHealthReader>, std::string> {
            auto [reader, why] = CallWithoutGil([&] {
              Result<std::unique_ptr<GpuHealthReader>> opened = GpuHealthReader::Open(library);
              if (!opened.ok()) return std::pair{std::unique_ptr<GpuHealthReader>(), opened.status().message()};
              return std::pair{std::move(opened).ValueOrDie(), std::string()};
            });
            if (reader == nullptr) return nb::make_tuple(nb::none(), why);
            return nb::make_tuple(nb::cast(reader.release(), nb::rv_policy::take_ownership), std::string());
          },
          nb::arg("nvml_library"),
          "(reader, \"\") or, where NVML cannot be used (no driver, a driver too old), (None, why).")
      .def_prop_ro("count", &GpuHealthReader::Count, "The GPUs the driver reported when the reader opened.")
      .def(
          "read",
          [](GpuHealthReader& reader, const std::vector<int>& nvml_indices) {
            Result<std::vector<GpuHealthReading>> readings =
                CallWithoutGil([&] { return reader.Read(nvml_indices); });
            nb::typed<nb::list, nb::dict> out;
            for (const GpuHealthReading& reading : ValueOrThrow(std::move(readings))) out.append(ReadingToPython(reading));
            return out;
          },
          nb::arg("nvml_indices"),
          "One dict per index, in order: nvml_index, uuid, ecc_uncorrected_volatile, retired_pages_pending,\n"
          "remapped_rows_pending, remapped_rows_failure, throttle_reasons (NVML's bits), pcie_generation(_max),\n"
          "pcie_width(_max), utilization_percent, memory_used, memory_total (bytes) and compute_processes\n"
          "(dicts of pid and used_memory); a reading NVML does not support is None.");
}

}  // namespace fanrun::bindings
