// Cuts a byte stream into log lines and progress updates, whatever the chunking.
#pragma once

#include <cstddef>
#include <functional>
#include <string>
#include <string_view>

namespace fanrun {

enum class SegmentKind {
  kLine,      // ended by '\n' (or "\r\n"), or by the end of the stream
  kPartial,   // a piece of a line longer than the limit; the line goes on
  kProgress,  // the current text of a line being redrawn with '\r' (a progress bar)
};

class LineSplitter {
 public:
  using Sink = std::function<void(SegmentKind, std::string_view)>;

  explicit LineSplitter(size_t max_line_bytes) : max_line_bytes_(max_line_bytes) {}

  // Emits every complete line in `data`; then, if the pending text is a line being
  // redrawn with '\r', one kProgress with its current text (so a bar shows as it moves).
  void Feed(std::string_view data, const Sink& sink);
  // End of stream: what is pending becomes a last line.
  void Finish(const Sink& sink);

 private:
  void FlushLine(const Sink& sink);

  size_t max_line_bytes_;
  std::string pending_;
  bool after_carriage_return_ = false;  // the pending text follows a lone '\r'
  bool pending_cr_ = false;             // the last byte seen was '\r': "\r\n" or a redraw?
};

}  // namespace fanrun
