// fanrun._core: the engine's Python face. One Bind* call per area.
#include <nanobind/nanobind.h>

#include "status_to_python.h"

namespace nb = nanobind;

namespace fanrun::bindings {
void BindRunContract(nb::module_& m);
void BindSupervisor(nb::module_& m);
void BindAccelerators(nb::module_& m);
void BindGpuHealth(nb::module_& m);
void BindCheckpoint(nb::module_& m);
void BindCache(nb::module_& m);
void BindPrivateDir(nb::module_& m);
}  // namespace fanrun::bindings

NB_MODULE(_core, m) {
  m.doc() = "fanrun's C++ engine: process supervision, log multiplexing, accelerator detection, checkpoint I/O, the file cache, private directories";
  fanrun::bindings::BindErrors(m);
  fanrun::bindings::BindRunContract(m);  // first: the supervisor's signatures name its enums
  fanrun::bindings::BindSupervisor(m);
  fanrun::bindings::BindAccelerators(m);
  fanrun::bindings::BindGpuHealth(m);
  fanrun::bindings::BindCheckpoint(m);
  fanrun::bindings::BindCache(m);
  fanrun::bindings::BindPrivateDir(m);
}
