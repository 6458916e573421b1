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
    case StatusCode::kUnsafePath: return "UnsafePathError";
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
      const Status& status = e.status();
      nb::module_ errors = nb::module_::import_("fanrun._errors");
      // A path in the message may hold bytes that are not UTF-8: shown escaped, not lost.
      nb::object message = nb::steal(PyUnicode_DecodeUTF8(status.message().data(),
                                                          static_cast<Py_ssize_t>(status.message().size()),
                                                          "backslashreplace"));
      if (status.code() == StatusCode::kIOError && status.errnum() != 0) {
        // As Python raises its own: a FileNotFoundError for ENOENT, with its errno, and an EngineOSError.
        nb::object error = errors.attr("engine_os_error")(status.errnum(), message);
        PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(error.ptr())), error.ptr());
        return;
      }
      PyErr_SetObject(errors.attr(ExceptionName(status.code())).ptr(), message.ptr());
    }
  });
}

}  // namespace fanrun::bindings
