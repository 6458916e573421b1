// Status helpers that need more than the header.
#include "fanrun/status.h"

#include <cstring>

namespace fanrun {

std::string Status::ErrnoMessage(int errnum) {
  char buffer[256];
  // GNU strerror_r may return a static string instead of filling the buffer.
  const char* text = strerror_r(errnum, buffer, sizeof(buffer));
  return internal::StrCat(text, " (errno ", errnum, ")");
}

std::string Status::ToString() const {
  switch (code_) {
    case StatusCode::kOk: return "OK";
    case StatusCode::kInvalid: return "Invalid: " + message_;
    case StatusCode::kNotFound: return "Not found: " + message_;
    case StatusCode::kIOError: return "IO error: " + message_;
    case StatusCode::kInternal: return "Internal: " + message_;
    case StatusCode::kDataLoss: return "Data loss: " + message_;
    case StatusCode::kUnsafePath: return "Unsafe path: " + message_;
  }
  return message_;
}

}  // namespace fanrun
