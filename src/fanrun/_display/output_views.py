"""How the ranks' output shows on each kind of stream a caller has: a terminal, a Jupyter
cell, or a file or pipe.

Each view gets three things per (rank, stream): a line that ended, the start of a line not
ended yet (shown after a short wait), and the current text of a line being redrawn with '\\r'
(a progress bar). A bar stays one row however many ranks draw one: a terminal keeps the live
rows in a block below the ordinary lines and redraws it in place; a cell keeps them in one
display output updated in place; a file or pipe gets a bounded number of lines.
"""

from __future__ import annotations

import math
import os
import re
import shutil
import sys
import unicodedata
from typing import Protocol, TextIO

from .._core import Stream
from .terminal_text import printable

# (rank, the rank's stream): its lines go to the caller's stream of the same name.
Key = tuple[int, Stream]


class View(Protocol):
    def line(self, key: Key, whole: str, rest: str, now: float) -> None:
        """A line ended: `whole` is all of it, `rest` what came after its start given to partial()."""

    def partial(self, key: Key, piece: str, whole: str, now: float) -> None:
        """More of a line not ended yet: `piece` is new, `whole` is all of it so far."""

    def progress(self, key: Key, text: str, now: float) -> None:
        """The current text of a line redrawn with '\\r'; blank when the bar was erased."""

    # How long the ranks' output may wait before it is handed over, in one batch: a view that
    # shows it no more often than that needs no more wake-ups of the caller.
    gather_s: float

    def due_in(self, now: float) -> float | None:
        """Seconds until a redraw is due; None when nothing waits to be drawn."""

    def redraw(self, now: float) -> None:
        """Draws what is due."""

    def close(self) -> None:
        """Leaves the streams with every line ended."""

# Live rows in a terminal or a cell are redrawn at most this often.
REDRAW_EVERY_S = 0.1
# On a file or pipe, a bar is redrawn in place with '\r' at most this often, and goes on a
# line of its own (when other output came in between) at most this often.
PLAIN_REDRAW_EVERY_S = 1.0
PLAIN_NEW_LINE_EVERY_S = 5.0

# A colour (SGR), the one sequence of a rank's that a display passes on; captured, so that split()
# hands it back between the pieces of text around it.
_COLOUR_SPLIT = re.compile(r"(\x1b\[[0-9;]*m)")
_COLOUR_OR_CHARACTER = re.compile(r"\x1b\[[0-9;]*m|.", re.S)


def visible(text: str) -> str:
    """The text of a line with its colours, without any other control character or sequence
    (C0 but the tab, DEL, C1, and every escape sequence): a rank's own cursor movements would
    break the display's, and other sequences retitle the window or write the clipboard."""
    if text.isprintable():
        return text
    pieces = _COLOUR_SPLIT.split(text)
    return "".join(piece if index % 2 else printable(piece, keep="\t") for index, piece in enumerate(pieces))


def caller_surface(stream: Stream = Stream.STDOUT) -> str:
    """What the caller's stdout (or stderr) is: "notebook", "terminal" or "plain" (a file or a pipe)."""
    return _kind(_stream(stream))


def views_for_streams(labels: list[str]) -> dict[Stream, View]:
    """One view per stream of the caller's, sys.stdout and sys.stderr, shared where both are of
    one kind (so a terminal has one block, a cell one display); files and pipes share one only
    when both streams go to the same one (2>&1), where a line left open on one stream must be
    ended before the other writes."""
    kinds = {stream: _kind(_stream(stream)) for stream in Stream}
    if kinds[Stream.STDOUT] == kinds[Stream.STDERR] == "plain" and not _same_destination(sys.stdout, sys.stderr):
        return {stream: PlainView(labels) for stream in Stream}
    made: dict[str, View] = {}
    for kind in set(kinds.values()):
        if kind == "terminal":
            made[kind] = TerminalView(labels, block_stream=terminal_block_stream())
        elif kind == "notebook":
            made[kind] = NotebookView(labels)
        else:
            made[kind] = PlainView(labels)
    return {stream: made[kind] for stream, kind in kinds.items()}


def terminal_block_stream() -> Stream:
    """The caller's stream that a terminal's live block is drawn on: stderr where it is the
    terminal, so that stdout, redirected, gets lines alone."""
    return Stream.STDERR if caller_surface(Stream.STDERR) == "terminal" else Stream.STDOUT


def _stream(stream: Stream) -> TextIO:
    # Looked up at every write: in Jupyter it is the cell's stream, not fd 1.
    return sys.stdout if stream is Stream.STDOUT else sys.stderr


# The caller's streams fanrun wrote on since they were last flushed. A flush of a Jupyter stream
# is a round trip to the kernel's IOPub thread: flushing both after every batch of the ranks'
# output cost the caller more than the panel itself.
_written: set[Stream] = set()


def out(stream: Stream) -> TextIO:
    """The caller's `stream`, to write on: flush_streams(written_only=True) flushes it."""
    _written.add(stream)
    return _stream(stream)


def _kind(stream: TextIO) -> str:
    if type(stream).__module__.startswith("ipykernel."):
        return "notebook"
    try:
        if stream.isatty() and os.environ.get("TERM") != "dumb":
            return "terminal"
    except (AttributeError, ValueError, OSError):
        pass
    return "plain"


def _same_destination(one: TextIO, other: TextIO) -> bool:
    try:
        a, b = os.fstat(one.fileno()), os.fstat(other.fileno())
    except (AttributeError, ValueError, OSError):  # no descriptor: pytest's capture, a StringIO
        return one is other
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def flush_streams(written_only: bool = False) -> None:
    """Flushes the caller's stdout and stderr; written_only: those fanrun wrote on since, and not
    a Jupyter cell's, which sends what it was given within its own flush interval."""
    streams = sorted(_written) if written_only else list(Stream)
    _written.clear()
    for which in streams:
        stream = _stream(which)
        if written_only and _kind(stream) == "notebook":
            continue
        try:
            stream.flush()
        except (OSError, ValueError):
            pass


class _StreamLines:
    """Lines on the caller's streams, and the one line that may be left open there: the
    start of a line still going on, or a bar redrawn in place with '\\r'."""

    def __init__(self, labels: list[str]) -> None:
        self._labels = labels
        self._open: tuple[Key, str] | None = None  # (key, "partial" | "bar")
        self._open_width = 0  # of the bar drawn, to blank what a shorter redraw leaves

    def is_open(self, key: Key, what: str) -> bool:
        return self._open == (key, what)

    def end_open(self) -> None:
        if self._open is not None:
            out(self._open[0][1]).write("\n")
            self._open = None

    def line(self, key: Key, whole: str, rest: str) -> None:
        stream = out(key[1])
        if self._open == (key, "partial"):
            stream.write(rest + "\n")
        elif self._open == (key, "bar"):
            stream.write("\r" + self._bar_text(key, whole) + "\n")
        else:
            self.end_open()
            stream.write(self._labels[key[0]] + whole + "\n")
        self._open = None

    def partial(self, key: Key, piece: str, whole: str) -> None:
        if self._open == (key, "partial"):
            out(key[1]).write(piece)
            return
        self.end_open()
        out(key[1]).write(self._labels[key[0]] + whole)
        self._open = (key, "partial")

    def bar(self, key: Key, text: str) -> None:
        if self._open == (key, "bar"):
            out(key[1]).write("\r" + self._bar_text(key, text))
            return
        self.end_open()
        self._open_width = 0
        out(key[1]).write(self._bar_text(key, text))
        self._open = (key, "bar")

    def _bar_text(self, key: Key, text: str) -> str:
        shown = self._labels[key[0]] + text
        width = len(shown)
        padding = " " * max(self._open_width - width, 0)
        self._open_width = width
        return shown + padding


class _PlainBar:
    def __init__(self) -> None:
        self.text = ""
        self.shown = False
        self.drawn_at = -math.inf  # last drawn at all
        self.line_at = -math.inf  # last drawn on a line of its own


class PlainView:
    """A file or a pipe: no cursor to move. A bar redraws in place with '\\r' while nothing
    else is written; once other output has broken its line, it takes a new line at most
    every PLAIN_NEW_LINE_EVERY_S, and its last line (its 100 %) always shows."""

    gather_s = 0.0  # each line as it comes

    def __init__(self, labels: list[str]) -> None:
        self._lines = _StreamLines(labels)
        self._bars: dict[Key, _PlainBar] = {}

    def line(self, key: Key, whole: str, rest: str, now: float) -> None:
        bar = self._bars.pop(key, None)
        self._lines.line(key, whole or (bar.text if bar else ""), rest)

    def partial(self, key: Key, piece: str, whole: str, now: float) -> None:
        self._lines.partial(key, piece, whole)

    def progress(self, key: Key, text: str, now: float) -> None:
        if not text.strip():  # the bar was erased
            self._bars.pop(key, None)
            return
        bar = self._bars.setdefault(key, _PlainBar())
        bar.text, bar.shown = text, False
        if self._ready_in(key, bar, now) == 0:
            self._draw(key, bar, now)

    def due_in(self, now: float) -> float | None:
        waits = [self._ready_in(key, bar, now) for key, bar in self._bars.items() if not bar.shown]
        return min(waits, default=None)

    def redraw(self, now: float) -> None:
        for key, bar in sorted(self._bars.items()):
            if not bar.shown and self._ready_in(key, bar, now) == 0:
                self._draw(key, bar, now)

    def close(self) -> None:
        self._bars.clear()
        self._lines.end_open()

    def _ready_in(self, key: Key, bar: _PlainBar, now: float) -> float:
        if self._lines.is_open(key, "bar"):
            return max(0.0, bar.drawn_at + PLAIN_REDRAW_EVERY_S - now)
        return max(0.0, bar.line_at + PLAIN_NEW_LINE_EVERY_S - now)

    def _draw(self, key: Key, bar: _PlainBar, now: float) -> None:
        if not self._lines.is_open(key, "bar"):
            bar.line_at = now
        self._lines.bar(key, bar.text)
        bar.drawn_at, bar.shown = now, True


class TerminalView:
    """A terminal: ordinary lines scroll as usual, and below them a block of live rows, one
    per rank and stream with a bar or a line not ended yet, redrawn in place with cursor
    movements. A bar's last line joins the ordinary lines above the block."""

    gather_s = 0.0  # each line as it comes

    def __init__(self, labels: list[str], block_stream: Stream) -> None:
        self._labels = labels
        self._block_stream = block_stream
        self._live: dict[Key, str] = {}
        self._rows = 0  # rows of the block on the screen now; the cursor ends its last one
        self._dirty = False
        self._drawn_at = -math.inf

    def line(self, key: Key, whole: str, rest: str, now: float) -> None:
        last = self._live.pop(key, "")
        self._erase()
        out(key[1]).write(self._labels[key[0]] + (whole or last) + "\n")
        self._dirty = bool(self._live)

    def partial(self, key: Key, piece: str, whole: str, now: float) -> None:
        self._live[key] = whole
        self._dirty = True

    def progress(self, key: Key, text: str, now: float) -> None:
        if text.strip():
            self._live[key] = text
        elif self._live.pop(key, None) is None:
            return
        self._dirty = True

    def due_in(self, now: float) -> float | None:
        if not self._dirty:
            return None
        if self._rows == 0:  # the block is off the screen: back at once
            return 0.0
        return max(0.0, self._drawn_at + REDRAW_EVERY_S - now)

    def redraw(self, now: float) -> None:
        if self.due_in(now) == 0:
            self._draw(now)

    def close(self) -> None:
        self._erase()
        for key, text in sorted(self._live.items()):  # what never ended stays, as it stood
            out(key[1]).write(self._labels[key[0]] + text + "\n")
        self._live.clear()
        self._dirty = False

    def _draw(self, now: float) -> None:
        flush_streams()  # the lines written since the last draw go above the block
        lines = [self._labels[key[0]] + text for key, text in sorted(self._live.items())]
        self._rows = draw_block(out(self._block_stream), lines, self._rows)
        self._dirty = False
        self._drawn_at = now

    def _erase(self) -> None:
        if self._rows:
            block = out(self._block_stream)
            block.write(block_home(self._rows) + "\x1b[J")
            block.flush()
            self._rows = 0


def draw_block(stream: TextIO, lines: list[str], rows_now: int) -> int:
    """Draws `lines` as a terminal's live block, over the `rows_now` rows the block has on the
    screen, each fitted to a row and as many as the screen holds; returns the rows it has now.
    The cursor ends on its last row."""
    columns, height = _terminal_size(stream)
    lines = [fit(line, columns - 1) for line in lines]
    room = max(height - 1, 1)
    if len(lines) > room:
        lines = lines[: room - 1] + [f"... and {len(lines) - room + 1} more"]
    stream.write(block_home(rows_now) + "".join(line + "\x1b[K\n" for line in lines).removesuffix("\n") + "\x1b[J")
    stream.flush()
    return len(lines)


def block_home(rows: int) -> str:
    """Back to the first column of the first row of a block of `rows` rows the cursor ends."""
    if rows == 0:
        return ""
    return "\r" + (f"\x1b[{rows - 1}A" if rows > 1 else "")


def terminal_columns(stream: TextIO) -> int:
    return _terminal_size(stream)[0]


def _terminal_size(stream: TextIO) -> tuple[int, int]:
    try:
        size = os.get_terminal_size(stream.fileno())
    except (AttributeError, ValueError, OSError):
        size = shutil.get_terminal_size()
    # A pseudo-terminal nobody sized says 0 x 0.
    return (size.columns or 80, size.lines or 24)


def fit(text: str, width: int) -> str:
    """The start of `text` that fits in `width` columns, colours kept and reset after."""
    parts: list[str] = []
    used = 0
    coloured = False
    for match in _COLOUR_OR_CHARACTER.finditer(text):
        token = match.group()
        if len(token) > 1:
            parts.append(token)
            coloured = True
            continue
        if unicodedata.category(token) == "Cc":
            continue  # controls move the cursor or nothing
        cells = 0 if unicodedata.combining(token) else 2 if unicodedata.east_asian_width(token) in "WF" else 1
        if used + cells > width:
            break
        parts.append(token)
        used += cells
    return "".join(parts) + ("\x1b[0m" if coloured else "")


class NotebookView:
    """A Jupyter cell: lines go to the cell's streams, and the bars live in one display
    output, one row per rank and stream, updated in place through IPython's display
    handles (no widgets). A bar's last line stays in its row; when a rank starts a new bar
    over a finished one, or every bar has finished, the display is left as it stands and
    the next bar opens a new one below."""

    gather_s = 0.0  # each line as it comes

    def __init__(self, labels: list[str]) -> None:
        self._labels = labels
        self._lines = _StreamLines(labels)
        self._rows: dict[Key, tuple[str, bool]] = {}  # key -> (text, finished)
        self._handle = None
        self._dirty = False
        self._drawn_at = -math.inf

    def line(self, key: Key, whole: str, rest: str, now: float) -> None:
        row = self._rows.get(key)
        if row is None or row[1]:
            self._lines.line(key, whole, rest)
            return
        self._rows[key] = (whole or row[0], True)
        self._dirty = True
        if all(finished for _, finished in self._rows.values()):
            self._leave_display(keep_live=False, now=now)

    def partial(self, key: Key, piece: str, whole: str, now: float) -> None:
        self._lines.partial(key, piece, whole)

    def progress(self, key: Key, text: str, now: float) -> None:
        row = self._rows.get(key)
        if not text.strip():  # the bar was erased
            if row is not None and not row[1]:
                del self._rows[key]
                self._dirty = True
            return
        if row is not None and row[1]:
            self._leave_display(keep_live=True, now=now)
        self._rows[key] = (text, False)
        self._dirty = True
        if self._handle is None:
            self._open_display(now)

    def due_in(self, now: float) -> float | None:
        if not self._dirty or self._handle is None:
            return None
        return max(0.0, self._drawn_at + REDRAW_EVERY_S - now)

    def redraw(self, now: float) -> None:
        if self.due_in(now) == 0:
            self._update(now)

    def close(self) -> None:
        if self._handle is not None and self._dirty:
            self._update(0.0)
        self._lines.end_open()

    def _bundle(self) -> dict[str, str]:
        rows = [self._labels[key[0]] + text for key, (text, _) in sorted(self._rows.items())]
        return {"text/plain": "\n".join(rows)}

    def _open_display(self, now: float) -> None:
        from IPython.display import display

        # What was written so far goes above the display. A line left open there would go
        # on below it: it is ended now, and shown again whole, labelled, once it ends.
        self._lines.end_open()
        flush_streams()
        self._handle = display(self._bundle(), raw=True, display_id=True)
        self._dirty = False
        self._drawn_at = now

    def _update(self, now: float) -> None:
        self._handle.update(self._bundle(), raw=True)
        self._dirty = False
        self._drawn_at = now

    def _leave_display(self, keep_live: bool, now: float) -> None:
        """The display keeps the finished bars; live ones move to the next display."""
        live = {key: row for key, row in self._rows.items() if not row[1]}
        self._rows = {key: row for key, row in self._rows.items() if row[1]}
        self._update(now)
        self._handle = None
        self._rows = live if keep_live else {}
        if self._rows:
            self._open_display(now)
