// Cuts a byte stream into log lines and progress updates, whatever the chunking.
#pragma once

#include <cstddef>
#include <deque>
#include <functional>
#include <string>
#include <string_view>

#include "fanrun/run_contract.h"

namespace fanrun {

// Progress bars drawn below the current line (tqdm's `position=N`, nested bars) go down
// with '\n' and come back with a cursor-up escape ("\x1b[A", "\x1b[3A"). Once a stream has
// moved the cursor up, a row that '\n' ends while blank or being redrawn is kept back, so
// that the next cursor-up takes it back instead of every redraw leaving a line; kept rows
// come out before the next line, at ShowHeld, or at the end.
class LineSplitter {
 public:
  using Sink = std::function<void(SegmentKind, std::string_view)>;

  explicit LineSplitter(size_t max_line_bytes) : max_line_bytes_(max_line_bytes) {}

  // Emits every complete line in `data`; then, if the pending text is a line being
  // redrawn with '\r', one kProgress with its current text (so a bar shows as it moves).
  void Feed(std::string_view data, const Sink& sink);
  // True when the splitter holds text that no segment has shown: a line without its
  // newline yet, or a row kept back.
  bool HoldsUnshown() const;
  // Shows what it holds, for a stream that has kept it long enough: the rows kept back as
  // lines, then the pending text as kProgress if it is being redrawn, else as kPartial.
  void ShowHeld(const Sink& sink);
  // End of stream: what is pending becomes a last line.
  void Finish(const Sink& sink);

 private:
  void Step(char c, const Sink& sink);
  // Returns false when `c` cannot belong to the escape sequence begun: it was given up.
  bool ContinueEscape(char c, const Sink& sink);
  void Append(std::string_view text, const Sink& sink);
  void StartRedraw();
  void EndRow(const Sink& sink);
  void CursorUp(size_t rows, const Sink& sink);
  void ShowProgress(const Sink& sink);
  void EmitKeptRows(const Sink& sink);
  void FlushLine(const Sink& sink);

  size_t max_line_bytes_;
  std::string pending_;                 // the text of the current row
  bool after_carriage_return_ = false;  // the pending text follows a lone '\r'
  bool pending_cr_ = false;             // the last byte seen was '\r': "\r\n" or a redraw?
  bool shown_ = false;                  // the pending text went out as kProgress already
  bool row_started_ = false;            // a kPartial of the current row went out
  bool cursor_moved_ = false;           // the stream has moved the cursor up at least once
  std::string escape_;                  // an escape sequence begun, not yet complete
  std::deque<std::string> kept_;        // rows ended by '\n' that a cursor-up may take back
};

}  // namespace fanrun
