// Cuts a byte stream into log lines and progress updates.
#include "fanrun/line_splitter.h"

#include <algorithm>

namespace fanrun {
namespace {

// More rows than any bar display goes down and comes back: beyond it, the oldest comes out.
constexpr size_t kMaxKeptRows = 16;
// Longer "escape sequences" are text that merely starts with ESC.
constexpr size_t kMaxEscapeBytes = 32;

}  // namespace

void LineSplitter::Feed(std::string_view data, const Sink& sink) {
  for (char c : data) Step(c, sink);
  // Only the text standing at the end of a chunk is shown, so fast redraws within one
  // chunk cost nothing.
  if (after_carriage_return_ && !pending_.empty() && !shown_) ShowProgress(sink);
}

void LineSplitter::Step(char c, const Sink& sink) {
  if (!escape_.empty() && ContinueEscape(c, sink)) return;
  if (pending_cr_) {
    pending_cr_ = false;
    if (c == '\n') {  // "\r\n" ends a line like '\n'
      EndRow(sink);
      return;
    }
    StartRedraw();  // a lone '\r': the line is redrawn from here on
  }
  switch (c) {
    case '\n': EndRow(sink); break;
    case '\r': pending_cr_ = true; break;
    case '\x1b': escape_.push_back(c); break;
    default: Append(std::string_view(&c, 1), sink);
  }
}

bool LineSplitter::ContinueEscape(char c, const Sink& sink) {
  const bool is_csi = escape_.size() > 1;  // "\x1b[" seen
  // A CSI sequence: parameter and intermediate bytes, then one final byte (ECMA-48).
  const bool fits = is_csi ? (c >= 0x20 && c <= 0x7e) : c == '[';
  if (!fits) {  // not a sequence we read: the bytes are text
    Append(escape_, sink);
    escape_.clear();
    return false;
  }
  escape_.push_back(c);
  if (!is_csi) return true;
  if (c >= 0x40) {  // the final byte
    const std::string_view parameters = std::string_view(escape_).substr(2, escape_.size() - 3);
    const bool digits = std::all_of(parameters.begin(), parameters.end(), [](char d) { return d >= '0' && d <= '9'; });
    if (c == 'A' && digits && parameters.size() <= 4) {
      size_t rows = 0;
      for (char d : parameters) rows = rows * 10 + static_cast<size_t>(d - '0');
      escape_.clear();
      CursorUp(std::max<size_t>(rows, 1), sink);
    } else {  // colours and the rest stay in the text; the caller decides what to show
      Append(escape_, sink);
      escape_.clear();
    }
  } else if (escape_.size() >= kMaxEscapeBytes) {
    Append(escape_, sink);
    escape_.clear();
  }
  return true;
}

void LineSplitter::Append(std::string_view text, const Sink& sink) {
  pending_.append(text);
  shown_ = false;
  if (pending_.size() >= max_line_bytes_) {
    EmitKeptRows(sink);
    sink(SegmentKind::kPartial, pending_);
    pending_.clear();
    row_started_ = true;
    // A row this long is no bar, whatever began it: its rest goes on as a line's pieces, not as
    // redraws that each show the text after the last piece (a display would see a new line there).
    after_carriage_return_ = false;
  }
}

void LineSplitter::StartRedraw() {
  pending_.clear();
  after_carriage_return_ = true;
  shown_ = false;
}

void LineSplitter::EndRow(const Sink& sink) {
  const bool blank = pending_.empty() && !row_started_;
  if (cursor_moved_ && (blank || after_carriage_return_)) {
    if (kept_.size() == kMaxKeptRows) {
      sink(SegmentKind::kLine, kept_.front());
      kept_.pop_front();
    }
    kept_.push_back(std::move(pending_));
    pending_.clear();
    after_carriage_return_ = false;
    shown_ = false;
    return;
  }
  EmitKeptRows(sink);
  FlushLine(sink);
}

void LineSplitter::CursorUp(size_t rows, const Sink& sink) {
  cursor_moved_ = true;
  for (size_t i = 0; i < std::min(rows, kept_.size() + 1); ++i) {
    // The row left behind was drawn: what it shows is the latest state of the bar.
    if (!pending_.empty() && !shown_) ShowProgress(sink);
    if (kept_.empty()) {
      pending_.clear();  // a row already sent: whatever comes next redraws it
    } else {
      pending_ = std::move(kept_.back());
      kept_.pop_back();
    }
    after_carriage_return_ = true;
    shown_ = true;
    row_started_ = false;
  }
}

void LineSplitter::ShowProgress(const Sink& sink) {
  sink(SegmentKind::kProgress, pending_);
  shown_ = true;
}

void LineSplitter::EmitKeptRows(const Sink& sink) {
  for (const auto& row : kept_) sink(SegmentKind::kLine, row);
  kept_.clear();
}

void LineSplitter::FlushLine(const Sink& sink) {
  sink(SegmentKind::kLine, pending_);
  pending_.clear();
  after_carriage_return_ = false;
  shown_ = false;
  row_started_ = false;
}

bool LineSplitter::HoldsUnshown() const { return !kept_.empty() || (!pending_.empty() && !shown_); }

void LineSplitter::ShowHeld(const Sink& sink) {
  EmitKeptRows(sink);
  if (pending_.empty() || shown_) return;
  if (after_carriage_return_ || pending_cr_) {  // "text\r": the line is about to be redrawn
    ShowProgress(sink);
    return;
  }
  sink(SegmentKind::kPartial, pending_);
  pending_.clear();
  row_started_ = true;
}

void LineSplitter::Finish(const Sink& sink) {
  pending_.append(escape_);
  escape_.clear();
  pending_cr_ = false;
  EmitKeptRows(sink);
  // A line whose start went out as kPartial is ended, even with nothing more to add.
  if (!pending_.empty() || row_started_) FlushLine(sink);
}

}  // namespace fanrun
