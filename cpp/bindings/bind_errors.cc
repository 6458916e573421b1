// Maps engine status codes to fanrun's Python exceptions (defined in fanrun/_errors.py).
#include "status_to_python.h"

namespace nb = nanobind;

namespace fanrun::bindings {
namespace {

const char* ExceptionName(StatusCode code) {
  switch (code) {
    case StatusCode::kInvalid: return "EngineInvalidArgument";
    case StatusCode::kNotFound: return "ExecutableNotFoundError";
    case StatusCode::kIOError: return "EngineOSError";
    case StatusCode::kDataLoss: return "CheckpointCorruptError";
    default: return "EngineError";
  }
}

}  // namespace

void BindErrors(nb::module_& m) {
  (void)m;
  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const StatusError& e) {
      nb::object errors = nb::module_::import_("fanrun._errors");
      nb::object type = errors.attr(ExceptionName(e.status().code()));
      PyErr_SetString(type.ptr(), e.status().message().c_str());
    }
  });
}

}  // namespace fanrun::bindings
