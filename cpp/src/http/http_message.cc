// Percent-encoding of request URLs and the checks of an answer's head.
#include "http/http_message_internal.h"

#include <algorithm>
#include <cctype>

namespace fanrun::internal {
namespace {

bool IsControl(unsigned char c) { return c < 0x20 || c == 0x7f; }

bool IsHexDigit(char c) { return std::isxdigit(static_cast<unsigned char>(c)) != 0; }

// RFC 3986's pchar and '/' '?': unreserved, sub-delims, ':' and '@'. '%' is handled apart.
bool AllowedInPathOrQuery(unsigned char c) {
  if (std::isalnum(c) != 0) return true;
  switch (c) {
    case '-': case '.': case '_': case '~':                                        // unreserved
    case '!': case '$': case '&': case '\'': case '(': case ')': case '*': case '+':
    case ',': case ';': case '=':                                                  // sub-delims
    case ':': case '@': case '/': case '?':
      return true;
    default:
      return false;
  }
}

char HexDigit(unsigned value) { return "0123456789ABCDEF"[value & 0xf]; }

bool EqualsIgnoringCase(std::string_view a, std::string_view b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    if (std::tolower(static_cast<unsigned char>(a[i])) != std::tolower(static_cast<unsigned char>(b[i]))) return false;
  }
  return true;
}

bool IsSpace(char c) { return c == ' ' || c == '\t'; }

std::string_view TrimSpace(std::string_view text) {
  while (!text.empty() && IsSpace(text.front())) text.remove_prefix(1);
  while (!text.empty() && IsSpace(text.back())) text.remove_suffix(1);
  return text;
}

// Content-Length = 1*DIGIT (RFC 9110 8.6); 18 digits at most, so that it fits in an int64_t.
bool ParseLength(std::string_view text, int64_t* out) {
  if (text.empty() || text.size() > 18) return false;
  int64_t value = 0;
  for (char c : text) {
    if (c < '0' || c > '9') return false;
    value = value * 10 + (c - '0');
  }
  *out = value;
  return true;
}

}  // namespace

bool IsHttpUrl(std::string_view url) {
  for (std::string_view scheme : {std::string_view("http://"), std::string_view("https://")}) {
    if (url.size() > scheme.size() && EqualsIgnoringCase(url.substr(0, scheme.size()), scheme)) return true;
  }
  return false;
}

std::string Printable(std::string_view text) {
  std::string out;
  out.reserve(text.size());
  for (char c : text) {
    const auto byte = static_cast<unsigned char>(c);
    if (IsControl(byte)) {
      out += "\\x";
      out += "0123456789abcdef"[byte >> 4u];
      out += "0123456789abcdef"[byte & 0xfu];
    } else {
      out += c;
    }
  }
  return out;
}

Result<std::string> RequestUrl(std::string_view url) {
  for (size_t i = 0; i < url.size(); ++i) {
    const auto byte = static_cast<unsigned char>(url[i]);
    if (IsControl(byte)) {
      return Status::Invalid("The URL '", Printable(url), "' holds a control character (byte ", i,
                             "), which would end or extend the request's line: it is not fetched");
    }
  }
  if (!IsHttpUrl(url)) return Status::Invalid("'", url, "' is not an http:// or https:// URL");
  const size_t authority_start = url.find("://") + 3;
  const size_t authority_end = std::min(url.find_first_of("/?#", authority_start), url.size());
  if (authority_end == authority_start) return Status::Invalid("The URL '", url, "' names no host");
  std::string out(url.substr(0, authority_end));
  const std::string_view rest = url.substr(authority_end, url.find('#', authority_end) - authority_end);
  if (rest.empty() || rest.front() != '/') out += '/';
  for (size_t i = 0; i < rest.size(); ++i) {
    const auto byte = static_cast<unsigned char>(rest[i]);
    if (AllowedInPathOrQuery(byte) ||
        (byte == '%' && i + 2 < rest.size() && IsHexDigit(rest[i + 1]) && IsHexDigit(rest[i + 2]))) {
      out += rest[i];
    } else {
      out += '%';
      out += HexDigit(byte >> 4u);
      out += HexDigit(byte);
    }
  }
  return out;
}

Status ResponseHead::AddLine(std::string_view line) {
  if (!line.empty() && line.back() == '\n') line.remove_suffix(1);
  if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
  if (line.substr(0, 5) == "HTTP/") {
    *this = ResponseHead();
    started_ = true;
    // "HTTP/1.1 404 Not Found", "HTTP/2 200 "
    const size_t space = line.find(' ');
    if (space == std::string_view::npos || line.size() < space + 4 || !std::isdigit(static_cast<unsigned char>(line[space + 1])) ||
        !std::isdigit(static_cast<unsigned char>(line[space + 2])) || !std::isdigit(static_cast<unsigned char>(line[space + 3])) ||
        (line.size() > space + 4 && line[space + 4] != ' ')) {
      return Status::IOError("starts with '", Printable(line), "', which is not an HTTP status line");
    }
    status_ = (line[space + 1] - '0') * 100 + (line[space + 2] - '0') * 10 + (line[space + 3] - '0');
    if (line.size() > space + 5) reason_ = std::string(TrimSpace(line.substr(space + 5)));
    return Status::OK();
  }
  if (!started_) return Status::IOError("does not start with an HTTP status line but with '", Printable(line), "'");
  if (complete_) return Status::OK();  // the trailer of a chunked body: nothing in it frames the body
  if (line.empty()) {
    complete_ = true;
    if (transfer_encoding_ && content_length_ >= 0) {
      return Status::IOError("gives both Content-Length and Transfer-Encoding, so its end is ambiguous");
    }
    return Status::OK();
  }
  if (IsSpace(line.front())) {
    // An obsolete folded line continues the field before it.
    if (last_was_content_length_) return Status::IOError("continues its Content-Length on a folded line");
    return Status::OK();
  }
  return AddField(line);
}

Status ResponseHead::AddField(std::string_view line) {
  const size_t colon = line.find(':');
  if (colon == std::string_view::npos) {
    last_was_content_length_ = false;
    return Status::OK();  // not a field; nothing that frames the body
  }
  const std::string_view name = line.substr(0, colon);
  const std::string_view trimmed_name = TrimSpace(name);
  const std::string_view value = TrimSpace(line.substr(colon + 1));
  const bool is_length = EqualsIgnoringCase(trimmed_name, "content-length");
  const bool is_encoding = EqualsIgnoringCase(trimmed_name, "transfer-encoding");
  if ((is_length || is_encoding) && trimmed_name.size() != name.size()) {
    return Status::IOError("has white space around the name of its '", Printable(trimmed_name), "' field");
  }
  last_was_content_length_ = is_length;
  if (is_length) {
    if (content_length_ >= 0) {
      return Status::IOError("gives Content-Length twice ('", content_length_, "' and '", Printable(value), "')");
    }
    if (!ParseLength(value, &content_length_)) {
      content_length_ = -1;
      return Status::IOError("gives a Content-Length of '", Printable(value), "', which is not one number of bytes");
    }
  } else if (is_encoding) {
    transfer_encoding_ = true;
  } else if (EqualsIgnoringCase(name, "location")) {
    has_location_ = true;
  }
  return Status::OK();
}

}  // namespace fanrun::internal
