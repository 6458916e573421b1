// What fanrun's HTTP client checks on the wire: the URL it puts into a request (it comes from a
// listing, so from the server) and the head of each answer (from the server too).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "fanrun/status.h"

namespace fanrun::internal {

// True for http:// and https:// URLs, whatever the case of the scheme.
bool IsHttpUrl(std::string_view url);

// The URL to request for `url`, an http(s) URL with a host: every byte of its path and query
// that RFC 3986 does not allow there is percent-encoded ("sp ace.bin" -> "sp%20ace.bin",
// UTF-8 bytes, a '%' that starts no escape), escapes already there are kept, and the fragment,
// which is never sent, is dropped. A control character anywhere (CR, LF, NUL, DEL...) could
// end the request line early or add a header: it is an error that names the URL.
Result<std::string> RequestUrl(std::string_view url);

// Text from the network as a message may show it: control characters and bytes past 0x7e as
// \xNN, so that a CR or an escape sequence in a URL does not reach a terminal or a log as such.
std::string Printable(std::string_view text);

// The head of one answer, fed the lines libcurl hands over (each with its line end). A status
// line starts a new head: an interim answer (100 Continue) or a redirect came before it.
class ResponseHead {
 public:
  // An error for a head that frames its body in a way that cannot be trusted: a
  // Content-Length that is not one plain number ("3xyz", "3, 6"), given twice, continued on a
  // folded line, or given together with Transfer-Encoding; a status line that is not HTTP.
  Status AddLine(std::string_view line);

  bool complete() const { return complete_; }
  int status() const { return status_; }
  const std::string& reason() const { return reason_; }  // empty over HTTP/2
  int64_t content_length() const { return content_length_; }  // -1: not given
  bool has_location() const { return has_location_; }

 private:
  Status AddField(std::string_view line);

  bool started_ = false;
  bool complete_ = false;
  int status_ = 0;
  std::string reason_;
  int64_t content_length_ = -1;
  bool transfer_encoding_ = false;
  bool has_location_ = false;
  bool last_was_content_length_ = false;
};

}  // namespace fanrun::internal
