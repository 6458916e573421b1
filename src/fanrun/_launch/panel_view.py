"""The live panel as an output view (output_views.View): every rank's output goes into the panel
instead of onto the caller's streams, and the panel is redrawn in place: in a Jupyter cell as
one display output updated through its display id (HTML, with the rows as text beside it), in a
terminal as a block of rows moved over with cursor movements. A rank's lines stay in the panel's
logs and in the run's log files."""

from __future__ import annotations

import math

from .output_views import Key, _fit, _stream, _terminal_size, flush_streams
from .panel import Panel
from .panel_render import html_panel, text_rows

# At most this often: the panel costs the caller little however fast the ranks print.
REDRAW_EVERY_S = 0.5


class PanelView:
    def __init__(self, panel: Panel, surface: str, block_stream: int = 2) -> None:
        self.panel = panel
        self._surface = surface  # "notebook" or "terminal"
        self._block_stream = block_stream  # a terminal's stream the block is drawn on
        self._dirty = True
        self._drawn_at = -math.inf
        self._handle = None  # the cell's display
        self._rows = 0  # the terminal block's rows on the screen now
        self._finished = False

    # ------------------------------------------------------------ View

    def line(self, key: Key, whole: str, rest: str, now: float) -> None:
        self.panel.line(key[0], key[1], whole, now)
        self._dirty = True

    def partial(self, key: Key, piece: str, whole: str, now: float) -> None:
        pass  # shown once the line ends

    def progress(self, key: Key, text: str, now: float) -> None:
        self.panel.progress(key[0], text, now)
        self._dirty = True

    def due_in(self, now: float) -> float | None:
        waits = []
        if self._dirty:
            waits.append(max(0.0, self._drawn_at + REDRAW_EVERY_S - now))
        stall = self.panel.next_stall_in(now)
        if stall is not None:
            waits.append(max(stall, self._drawn_at + REDRAW_EVERY_S - now, 0.0))
        # A stalled rank's "no progress for N min" grows: redrawn each minute.
        if any(self.panel.stalled_for(rank, now) is not None for rank in range(len(self.panel.rows))):
            waits.append(max(0.0, self._drawn_at + 60.0 - now))
        return min(waits, default=None)

    def redraw(self, now: float) -> None:
        due = self.due_in(now)
        if due is not None and due == 0:
            self._draw(now)

    def close(self) -> None:
        pass  # finish() draws the last state, once the call's outcome is known

    # ------------------------------------------------------------ the call's end

    def started(self, now: float) -> None:
        self.panel.started(now)
        self._draw(now)

    def exited(self, rank: int, exit_code: int, signal: int, now: float) -> None:
        self.panel.exited(rank, exit_code, signal)
        self._dirty = True

    def finish(self, failed_rank: int | None, failure: list[str], now: float) -> None:
        if self._finished:
            return
        self._finished = True
        self.panel.finish(failed_rank, failure)
        if self._surface == "terminal":
            self._erase()
            stream = _stream(self._block_stream)
            stream.write("".join(row + "\n" for row in text_rows(self.panel, now, colour=True)))
            stream.flush()
        else:
            self._draw(now)

    # ------------------------------------------------------------ drawing

    def _draw(self, now: float) -> None:
        if self._surface == "notebook":
            self._draw_in_cell(now)
        else:
            self._draw_in_terminal(now)
        self._dirty = False
        self._drawn_at = now

    def _bundle(self, now: float) -> dict[str, str]:
        rows = text_rows(self.panel, now)
        logs = [f"[rank{rank}]: {text}" for rank, text in self.panel.logs]
        return {"text/html": html_panel(self.panel, now), "text/plain": "\n".join(rows + logs)}

    def _draw_in_cell(self, now: float) -> None:
        if self._handle is None:
            from IPython.display import display

            flush_streams()  # what the caller printed before the call stays above the panel
            self._handle = display(self._bundle(now), raw=True, display_id=True)
        else:
            self._handle.update(self._bundle(now), raw=True)

    def _draw_in_terminal(self, now: float) -> None:
        block = _stream(self._block_stream)
        columns, lines = _terminal_size(block)
        rows = [_fit(row, columns - 1) for row in text_rows(self.panel, now, colour=True)]
        room = max(lines - 1, 1)
        if len(rows) > room:
            rows = rows[: room - 1] + [f"... and {len(rows) - room + 1} more"]
        block.write(self._home() + "".join(row + "\x1b[K\n" for row in rows).removesuffix("\n") + "\x1b[J")
        block.flush()
        self._rows = len(rows)

    def _erase(self) -> None:
        if self._rows:
            block = _stream(self._block_stream)
            block.write(self._home() + "\x1b[J")
            block.flush()
            self._rows = 0

    def _home(self) -> str:
        if self._rows == 0:
            return ""
        return "\r" + (f"\x1b[{self._rows - 1}A" if self._rows > 1 else "")


class QuietView:
    """display="quiet": nothing on the caller's streams; the run's logs keep every line."""

    def line(self, key: Key, whole: str, rest: str, now: float) -> None:
        pass

    def partial(self, key: Key, piece: str, whole: str, now: float) -> None:
        pass

    def progress(self, key: Key, text: str, now: float) -> None:
        pass

    def due_in(self, now: float) -> float | None:
        return None

    def redraw(self, now: float) -> None:
        pass

    def close(self) -> None:
        pass
