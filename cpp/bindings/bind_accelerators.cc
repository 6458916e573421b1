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

}  // namespace

void BindAccelerators(nb::module_& m) {
  // The GPUs this process may use (CUDA_VISIBLE_DEVICES applied), the driver version,
  // and why there are none when there are none.
  m.def(
      "detect_gpus",
      [](const std::string& library, bool visible_is_set, const std::string& visible) {
        GpuInventory inventory;
        {
          nb::gil_scoped_release release;
          inventory = DetectGpus(library);
        }
        nb::dict out;
        out["gpus"] = GpusToPython(ApplyVisibleDevices(inventory.gpus, visible_is_set, visible));
        out["all_gpus"] = GpusToPython(inventory.gpus);
        out["driver_version"] = inventory.driver_version;
        out["note"] = inventory.note;
        return out;
      },
      nb::arg("nvml_library"), nb::arg("visible_is_set"), nb::arg("visible"));
}

}  // namespace fanrun::bindings
