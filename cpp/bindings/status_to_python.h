// The one place where engine Status values become Python exceptions.
#pragma once

#include <nanobind/nanobind.h>

#include "fanrun/status.h"

namespace fanrun::bindings {

// Carries a failed Status out of a binding; the translator registered by
// BindErrors turns it into the fanrun exception for its code.
class StatusError : public std::exception {
 public:
  explicit StatusError(Status status) : status_(std::move(status)) {}
  const char* what() const noexcept override { return status_.message().c_str(); }
  const Status& status() const { return status_; }

 private:
  Status status_;
};

inline void ThrowIfError(const Status& status) {
  if (!status.ok()) throw StatusError(status);
}

template <typename T>
T ValueOrThrow(Result<T> result) {
  ThrowIfError(result.status());
  return std::move(result).ValueOrDie();
}

void BindErrors(nanobind::module_& m);

}  // namespace fanrun::bindings
