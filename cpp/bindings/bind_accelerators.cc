// Python access to GPU detection.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include "call_without_gil.h"
#include "fanrun/accelerators.h"

namespace nb = nanobind;

namespace fanrun::bindings {
namespace {

nb::list GpusToPython(const std::vector<GpuInfo>& gpus) {
  nb::list out;
  for (const auto& gpu : gpus) {
    nb::dict entry;
    entry["nvml_index"] = gpu.nvml_index;
    entry["name"] = gpu.name;
    entry["uuid"] = gpu.uuid;
    entry["memory_total"] = gpu.memory_total;
    out.append(entry);
  }
  return out;
}

std::vector<GpuInfo> GpusFromPython(const nb::list& gpus) {
  std::vector<GpuInfo> out;
  for (nb::handle item : gpus) {
    nb::dict entry = nb::cast<nb::dict>(item);
    GpuInfo gpu;
    gpu.nvml_index = nb::cast<int>(entry["nvml_index"]);
    gpu.name = nb::cast<std::string>(entry["name"]);
    gpu.uuid = nb::cast<std::string>(entry["uuid"]);
    gpu.memory_total = nb::cast<uint64_t>(entry["memory_total"]);
    out.push_back(gpu);
  }
  return out;
}

nb::list SamplesToPython(const std::vector<GpuSample>& samples) {
  nb::list out;
  for (const auto& sample : samples) {
    nb::dict entry;
    entry["nvml_index"] = sample.nvml_index;
    // None where NVML could not read the field, so one silent GPU does not hide the rest.
    entry["utilization_percent"] = sample.has_utilization ? nb::cast(sample.utilization_percent) : nb::none();
    entry["memory_used"] = sample.has_memory ? nb::cast(sample.memory_used) : nb::none();
    entry["memory_total"] = sample.has_memory ? nb::cast(sample.memory_total) : nb::none();
    out.append(entry);
  }
  return out;
}

}  // namespace

void BindAccelerators(nb::module_& m) {
  // Every GPU of the machine, the driver version, and why there are none when there are none.
  m.def(
      "detect_gpus",
      [](const std::string& library) {
        const GpuInventory inventory = CallWithoutGil([&] { return DetectGpus(library); });
        nb::dict out;
        out["gpus"] = GpusToPython(inventory.gpus);
        out["driver_version"] = inventory.driver_version;
        out["note"] = inventory.note;
        return out;
      },
      nb::arg("nvml_library"));
  // The GPUs, in CUDA's order, that CUDA_VISIBLE_DEVICES=`visible` leaves to a process.
  m.def(
      "apply_visible_devices",
      [](const nb::list& gpus, const std::string& visible) {
        return GpusToPython(ApplyVisibleDevices(GpusFromPython(gpus), true, visible));
      },
      nb::arg("gpus"), nb::arg("visible"));
  // Utilisation and memory of GPUs for system metrics, with NVML kept open between samples.
  nb::class_<GpuSampler>(m, "GpuSampler")
      // (sampler, "") or, where NVML cannot be used (no driver: the usual case on a CPU
      // machine, not an error), (None, why).
      .def_static(
          "open",
          [](const std::string& library) {
            auto [sampler, why] = CallWithoutGil([&] {
              Result<std::unique_ptr<GpuSampler>> opened = GpuSampler::Open(library);
              if (!opened.ok()) return std::pair{std::unique_ptr<GpuSampler>(), opened.status().message()};
              return std::pair{std::move(opened).ValueOrDie(), std::string()};
            });
            if (sampler == nullptr) return nb::make_tuple(nb::none(), why);
            return nb::make_tuple(nb::cast(sampler.release(), nb::rv_policy::take_ownership), std::string());
          },
          nb::arg("nvml_library"))
      .def(
          "sample",
          [](GpuSampler& sampler, const std::vector<int>& nvml_indices) {
            return SamplesToPython(CallWithoutGil([&] { return sampler.Sample(nvml_indices); }));
          },
          nb::arg("nvml_indices"));
}

}  // namespace fanrun::bindings
