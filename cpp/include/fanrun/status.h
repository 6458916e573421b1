// Status and Result<T>: errors as values inside the engine; nothing here throws.
#pragma once

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <variant>

namespace fanrun {

enum class StatusCode {
  kOk = 0,
  kInvalid,       // the caller asked for something that cannot be done
  kNotFound,      // a file or executable does not exist
  kIOError,       // a system call failed
  kInternal,      // an invariant of the engine did not hold
  kDataLoss,      // stored data is damaged: a checksum does not match, a file is short
  kUnsafePath,    // a file or directory fanrun would use is not its user's alone (private_dir.h)
};

namespace internal {
// Joins text and numbers without iostreams: std::ostringstream, built in this module
// before torch is imported, was seen to crash torch's own import (torch 2.11, CUDA 13).
inline void AppendTo(std::string& out, std::string_view text) { out.append(text); }
inline void AppendTo(std::string& out, char c) { out.push_back(c); }
template <typename T, typename = std::enable_if_t<std::is_arithmetic_v<T> && !std::is_same_v<T, char>>>
void AppendTo(std::string& out, T value) {
  if constexpr (std::is_floating_point_v<T>) {
    char buffer[32];
    std::snprintf(buffer, sizeof(buffer), "%g", static_cast<double>(value));
    out.append(buffer);
  } else {
    out.append(std::to_string(value));
  }
}

template <typename... Args>
std::string StrCat(const Args&... args) {
  std::string out;
  (AppendTo(out, args), ...);
  return out;
}
}  // namespace internal

class [[nodiscard]] Status {
 public:
  Status() = default;
  // errnum: the errno of the system call that failed, where one did (kIOError); 0 otherwise.
  Status(StatusCode code, std::string message, int errnum = 0)
      : code_(code), message_(std::move(message)), errnum_(errnum) {}

  static Status OK() { return Status(); }
  template <typename... Args>
  static Status Invalid(Args&&... args) {
    return Status(StatusCode::kInvalid, internal::StrCat(args...));
  }
  template <typename... Args>
  static Status NotFound(Args&&... args) {
    return Status(StatusCode::kNotFound, internal::StrCat(args...));
  }
  template <typename... Args>
  static Status Internal(Args&&... args) {
    return Status(StatusCode::kInternal, internal::StrCat(args...));
  }
  template <typename... Args>
  static Status DataLoss(Args&&... args) {
    return Status(StatusCode::kDataLoss, internal::StrCat(args...));
  }
  template <typename... Args>
  static Status IOError(Args&&... args) {
    return Status(StatusCode::kIOError, internal::StrCat(args...));
  }
  // Call with the errno captured right where the failure happened; the status keeps it.
  template <typename... Args>
  static Status IOErrorFromErrno(int errnum, Args&&... args) {
    return Status(StatusCode::kIOError, internal::StrCat(args..., ": ", ErrnoMessage(errnum)), errnum);
  }
  template <typename... Args>
  static Status UnsafePath(Args&&... args) {
    return Status(StatusCode::kUnsafePath, internal::StrCat(args...));
  }
  // "No such file or directory (errno 2)": how a message names the errno of a failure.
  static std::string ErrnoMessage(int errnum);

  bool ok() const { return code_ == StatusCode::kOk; }
  StatusCode code() const { return code_; }
  const std::string& message() const { return message_; }
  int errnum() const { return errnum_; }
  // The same failure, told with another message: its code and errno kept.
  Status WithMessage(std::string message) const { return Status(code_, std::move(message), errnum_); }
  std::string ToString() const;

 private:
  StatusCode code_ = StatusCode::kOk;
  std::string message_;
  int errnum_ = 0;
};

template <typename T>
class [[nodiscard]] Result {
 public:
  Result(T value) : storage_(std::move(value)) {}  // NOLINT: implicit like Arrow's
  Result(Status status) : storage_(std::move(status)) {  // NOLINT
    if (std::get<Status>(storage_).ok()) {
      storage_ = Status::Internal("Result constructed from an OK status without a value");
    }
  }

  bool ok() const { return std::holds_alternative<T>(storage_); }
  Status status() const { return ok() ? Status::OK() : std::get<Status>(storage_); }
  T& ValueOrDie() &;
  T&& ValueOrDie() &&;
  T& operator*() & { return ValueOrDie(); }
  T* operator->() { return &ValueOrDie(); }

 private:
  std::variant<Status, T> storage_;
};

// A broken invariant aborts: it is a bug in fanrun, not an error to report.
#define FANRUN_CHECK(condition)                                                     \
  do {                                                                              \
    if (!(condition)) {                                                             \
      std::fprintf(stderr, "fanrun: check failed at %s:%d: %s\n", __FILE__, __LINE__, \
                   #condition);                                                     \
      std::abort();                                                                 \
    }                                                                               \
  } while (false)

template <typename T>
T& Result<T>::ValueOrDie() & {
  FANRUN_CHECK(ok());
  return std::get<T>(storage_);
}

template <typename T>
T&& Result<T>::ValueOrDie() && {
  FANRUN_CHECK(ok());
  return std::get<T>(std::move(storage_));
}

#define FANRUN_CONCAT_IMPL(a, b) a##b
#define FANRUN_CONCAT(a, b) FANRUN_CONCAT_IMPL(a, b)

#define FANRUN_RETURN_NOT_OK(expr)        \
  do {                                    \
    ::fanrun::Status _st = (expr);        \
    if (!_st.ok()) return _st;            \
  } while (false)

#define FANRUN_ASSIGN_OR_RETURN_IMPL(tmp, lhs, rexpr) \
  auto tmp = (rexpr);                                 \
  if (!tmp.ok()) return tmp.status();                 \
  lhs = std::move(tmp).ValueOrDie()

#define FANRUN_ASSIGN_OR_RETURN(lhs, rexpr) \
  FANRUN_ASSIGN_OR_RETURN_IMPL(FANRUN_CONCAT(_result_, __LINE__), lhs, rexpr)

// Destructors never fail: they report and go on.
#define FANRUN_WARN_NOT_OK(expr, what)                                                   \
  do {                                                                                   \
    ::fanrun::Status _st = (expr);                                                       \
    if (!_st.ok()) std::fprintf(stderr, "fanrun: %s: %s\n", what, _st.message().c_str()); \
  } while (false)

}  // namespace fanrun
