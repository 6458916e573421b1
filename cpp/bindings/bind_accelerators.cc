// Python access to GPU detection.
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <optional>

#include "call_without_gil.h"
#include "fanrun/accelerators.h"

namespace nb = nanobind;

namespace fanrun::bindings {
namespace {

using DictList = nb::typed<nb::list, nb::dict>;

DictList GpusToPython(const std::vector<GpuInfo>& gpus) {
  DictList out;
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

std::vector<GpuInfo> GpusFromPython(const DictList& gpus) {
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

DictList SamplesToPython(const std::vector<GpuSample>& samples) {
  DictList out;
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
  m.def(
      "detect_gpus",
      [](const std::string& library) {
        const GpuInventory inventory = CallWithoutGil([&] { return DetectGpus(library); });
        nb::typed<nb::dict, nb::str, nb::object> out;
        out["gpus"] = GpusToPython(inventory.gpus);
        out["driver_version"] = inventory.driver_version;
        out["note"] = inventory.note;
        return out;
      },
      nb::arg("nvml_library"),
      "Every GPU of the machine (gpus: one dict each, as apply_visible_devices takes them), the driver's\n"
      "version (driver_version), and why there are none when there are none (note).");
  m.def(
      "apply_visible_devices",
      [](const DictList& gpus, const std::string& visible) {
        return GpusToPython(ApplyVisibleDevices(GpusFromPython(gpus), true, visible));
      },
      nb::arg("gpus"), nb::arg("visible"),
      "The GPUs, in CUDA's order, that CUDA_VISIBLE_DEVICES=`visible` leaves to a process; a GPU is\n"
      "a dict of nvml_index, name, uuid and memory_total (bytes).");
  nb::class_<GpuSampler>(m, "GpuSampler",
                         "Utilisation and memory of GPUs for system metrics, with NVML kept open between samples.")
      .def_static(
          "open",
          [](const std::string& library) -> nb::typed<nb::tuple, std::optional<GpuSampler>, std::string> {
            auto [sampler, why] = CallWithoutGil([&] {
              Result<std::unique_ptr<GpuSampler>> opened = GpuSampler::Open(library);
              if (!opened.ok()) return std::pair{std::unique_ptr<GpuSampler>(), opened.status().message()};
              return std::pair{std::move(opened).ValueOrDie(), std::string()};
            });
            if (sampler == nullptr) return nb::make_tuple(nb::none(), why);
            return nb::make_tuple(nb::cast(sampler.release(), nb::rv_policy::take_ownership), std::string());
          },
          nb::arg("nvml_library"),
          "(sampler, \"\") or, where NVML cannot be used (no driver: the usual case on a CPU machine, not\n"
          "an error; a driver too old), (None, why).")
      .def(
          "sample",
          [](GpuSampler& sampler, const std::vector<int>& nvml_indices) {
            return SamplesToPython(CallWithoutGil([&] { return sampler.Sample(nvml_indices); }));
          },
          nb::arg("nvml_indices"),
          "One dict per index, in order: nvml_index, utilization_percent, memory_used and memory_total\n"
          "(bytes); a field NVML could not read is None, so that one silent GPU does not hide the rest.");
}

}  // namespace fanrun::bindings
