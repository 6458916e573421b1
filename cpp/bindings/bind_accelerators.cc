// Python access to GPU detection.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

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

}  // namespace

void BindAccelerators(nb::module_& m) {
  // Every GPU of the machine, the driver version, and why there are none when there are none.
  m.def(
      "detect_gpus",
      [](const std::string& library) {
        GpuInventory inventory;
        {
          nb::gil_scoped_release release;
          inventory = DetectGpus(library);
        }
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
}

}  // namespace fanrun::bindings
