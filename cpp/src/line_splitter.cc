// Cuts a byte stream into log lines and progress updates.
#include "fanrun/line_splitter.h"

namespace fanrun {

void LineSplitter::FlushLine(const Sink& sink) {
  sink(SegmentKind::kLine, pending_);
  pending_.clear();
  after_carriage_return_ = false;
}

void LineSplitter::Feed(std::string_view data, const Sink& sink) {
  for (char c : data) {
    if (pending_cr_) {
      pending_cr_ = false;
      if (c == '\n') {  // "\r\n" ends a line like '\n'
        FlushLine(sink);
        continue;
      }
      // A lone '\r': the line is redrawn from here on. Only the text standing at the
      // end of a chunk is shown, so fast redraws within one chunk cost nothing.
      pending_.clear();
      after_carriage_return_ = true;
    }
    if (c == '\n') {
      FlushLine(sink);
    } else if (c == '\r') {
      pending_cr_ = true;
    } else {
      pending_.push_back(c);
      if (pending_.size() >= max_line_bytes_) {
        sink(SegmentKind::kPartial, pending_);
        pending_.clear();
      }
    }
  }
  if (after_carriage_return_ && !pending_.empty()) sink(SegmentKind::kProgress, pending_);
}

void LineSplitter::Finish(const Sink& sink) {
  pending_cr_ = false;
  if (!pending_.empty()) FlushLine(sink);
}

}  // namespace fanrun
