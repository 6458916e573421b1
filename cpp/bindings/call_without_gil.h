// CallWithoutGil: how a binding runs an engine call that may block (I/O, waits, child processes).
#pragma once

#include <nanobind/nanobind.h>

#include <type_traits>
#include <utility>

#include "fanrun/status.h"
#include "status_to_python.h"

namespace fanrun::bindings {
namespace detail {

template <typename T>
struct IsResult : std::false_type {};
template <typename T>
struct IsResult<Result<T>> : std::true_type {};

}  // namespace detail

// Runs `call` with the GIL released, so that the caller's other threads run meanwhile, and
// hands back what it returned with the GIL held again: a Result's value, nothing for a
// Status, any other value as it is. An exception that Python code run by the call left set
// on this thread (a signal handler's KeyboardInterrupt, while the call asked whether to stop)
// is raised first; then a failed status, through the one translator (status_to_python.h).
// `call` takes the GIL itself before it touches a Python object.
template <typename Call>
auto CallWithoutGil(Call&& call) {
  using Outcome = std::invoke_result_t<Call>;
  auto raise_python_error = [] {
    if (PyErr_Occurred() != nullptr) throw nanobind::python_error();
  };
  if constexpr (std::is_void_v<Outcome>) {
    {
      nanobind::gil_scoped_release release;
      std::forward<Call>(call)();
    }
    raise_python_error();
  } else {
    Outcome outcome = [&] {
      nanobind::gil_scoped_release release;
      return std::forward<Call>(call)();
    }();
    raise_python_error();
    if constexpr (std::is_same_v<Outcome, Status>) {
      ThrowIfError(outcome);
    } else if constexpr (detail::IsResult<Outcome>::value) {
      return ValueOrThrow(std::move(outcome));
    } else {
      return outcome;
    }
  }
}

}  // namespace fanrun::bindings
