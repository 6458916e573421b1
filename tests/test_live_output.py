"""Progress bars and lines without a newline, as the caller sees them: in a terminal (a
pseudo-terminal rendered by pyte), through a pipe, and in a Jupyter cell (a real kernel)."""

from __future__ import annotations

import asyncio
import fcntl
import os
import pty
import re
import select
import signal
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

import long_lines
import nbformat
import pyte
import pytest
from nbclient import NotebookClient

COLUMNS, ROWS = 150, 50
# The line every call says as it starts, in every display but a panel (which has it as its title).
STARTED = re.compile(r"fanrun: run ([\w.-]+-\d{8}-\d{6}-[0-9a-f]{6}) started: [^;]+; fanrun stacks \1 shows every rank's stack")

# Every rank draws a 40-step tqdm bar on stderr, then redraws a line with print(end="\r")
# on stdout, with a line before and after each.
BARS = """
from fanrun import distributed

@distributed(num_accelerators={ranks}, accelerator_type="CPU")
def train():
    import os
    import time
    from tqdm import tqdm

    rank = int(os.environ["RANK"])
    print(f"starting {{rank}}", flush=True)
    for _ in tqdm(range(40), desc="epoch"):
        time.sleep(0.03)
    for step in range(1, 31):
        print(f"step {{step}}/30", end="\\r", flush=True)
        time.sleep(0.02)
    print()
    print(f"done {{rank}}")
    return rank

print("returned", train.distributed())
"""

WAITING = """
from fanrun import distributed

@distributed(num_accelerators=1, accelerator_type="CPU")
def wait():
    import time

    print("start", flush=True)
    print("waiting...", end="", flush=True)
    time.sleep(5)
    print(" done")

wait.distributed()
"""

FINAL_BAR = re.compile(r"\[rank(\d)\]: epoch: 100%\|█{10}\| 40/40 .*")


def bar_rows(lines: list[str]) -> list[str]:
    """The rows that show a state of a tqdm bar or of the redrawn step counter."""
    return [line for line in lines if "%|" in line or "step " in line]


def expect_one_final_row_per_bar(lines: list[str], ranks: int) -> None:
    rows = bar_rows(lines)
    finals = sorted(int(m.group(1)) for row in rows if (m := FINAL_BAR.fullmatch(row)))
    assert finals == list(range(ranks)), "\n".join(lines)
    steps = sorted(row for row in rows if "step " in row)
    assert steps == sorted(f"[rank{rank}]: step 30/30" for rank in range(ranks)), "\n".join(lines)
    assert len(rows) == 2 * ranks, "\n".join(lines)


def run_in_terminal(script: Path, timeout: float = 240, columns: int = COLUMNS) -> list[tuple[float, bytes]]:
    """Runs `script` with its stdout and stderr on a pseudo-terminal of `columns` x ROWS;
    returns what it wrote there, chunk by chunk, with the time each chunk came."""
    pid, master = pty.fork()
    if pid == 0:  # the child: its stdio is the terminal
        os.environ["TERM"] = "xterm"
        os.execv(sys.executable, [sys.executable, str(script)])
    fcntl.ioctl(master, termios.TIOCSWINSZ, struct.pack("HHHH", ROWS, columns, 0, 0))
    chunks: list[tuple[float, bytes]] = []
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            if not select.select([master], [], [], deadline - time.monotonic())[0]:
                continue
            try:
                chunk = os.read(master, 65536)
            except OSError:  # EIO: the child closed its side
                break
            if not chunk:
                break
            chunks.append((time.monotonic(), chunk))
        else:
            os.kill(pid, signal.SIGKILL)
    finally:
        _, status = os.waitpid(pid, 0)
        os.close(master)
    assert os.waitstatus_to_exitcode(status) == 0, b"".join(c for _, c in chunks).decode(errors="replace")
    return chunks


def rendered(chunks: list[tuple[float, bytes]], columns: int = COLUMNS) -> list[str]:
    """Every line a terminal shows after those writes: those scrolled off the top, then the screen."""
    screen = pyte.HistoryScreen(columns, ROWS, history=10_000)
    pyte.ByteStream(screen).feed(b"".join(chunk for _, chunk in chunks))
    scrolled = ["".join(char.data for char in row.values()).rstrip() for row in screen.history.top]
    lines = scrolled + [row.rstrip() for row in screen.display]
    while lines and not lines[-1]:
        lines.pop()
    return lines


@pytest.mark.parametrize("ranks", [2, 8])
def test_each_bar_is_one_row_in_a_terminal(tmp_path, ranks):
    """In a terminal every rank's bar redraws in place: what stays on the screen (and in its
    scroll-back) is one row per bar, its last state, and the ordinary lines."""
    script = tmp_path / "bars.py"
    script.write_text(BARS.format(ranks=ranks))
    lines = rendered(run_in_terminal(script))
    expect_one_final_row_per_bar(lines, ranks)
    for rank in range(ranks):
        assert f"[rank{rank}]: starting {rank}" in lines and f"[rank{rank}]: done {rank}" in lines
    assert lines[-1] == f"returned {list(range(ranks))}"


@pytest.mark.parametrize("ranks", [2, 8])
def test_bars_through_a_pipe_take_a_bounded_number_of_lines(tmp_path, ranks):
    """Through a pipe (a log file) a bar takes at most a few lines: its first state, its last,
    and one more every few seconds when other output breaks its line; never one per redraw."""
    script = tmp_path / "bars.py"
    script.write_text(BARS.format(ranks=ranks))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, timeout=240)
    assert done.returncode == 0, done.stderr.decode(errors="replace")
    out, err = done.stdout.decode(), done.stderr.decode()
    # What a terminal would show of each line once its '\r' redraws are done.
    shown = [line.rsplit("\r", 1)[-1].rstrip() for line in (out + err).splitlines()]
    assert len(bar_rows(shown)) <= 3 * 2 * ranks, err
    finals = sorted(int(m.group(1)) for line in shown if (m := FINAL_BAR.fullmatch(line)))
    assert finals == list(range(ranks)), err
    assert sorted(line for line in shown if "step 30/30" in line) == [f"[rank{r}]: step 30/30" for r in range(ranks)]


def first_arrival(chunks: list[tuple[float, bytes]], text: str) -> float:
    seen = b""
    for at, chunk in chunks:
        seen += chunk
        if text.encode() in seen:
            return at
    raise AssertionError(f"{text!r} never came: {seen!r}")


def test_a_line_without_newline_shows_in_a_terminal_while_the_rank_waits(tmp_path):
    """In a terminal, the start of the line shows in the live block while the rank sleeps;
    once the line ends, it stands as one line."""
    script = tmp_path / "waiting.py"
    script.write_text(WAITING)
    chunks = run_in_terminal(script)
    assert first_arrival(chunks, "[rank0]: waiting...") - first_arrival(chunks, "[rank0]: start") < 0.5
    lines = rendered(chunks)
    assert STARTED.fullmatch(lines[0]) and lines[1:] == ["[rank0]: start", "[rank0]: waiting... done"], lines


def test_a_line_without_newline_shows_through_a_pipe_while_the_rank_waits(tmp_path):
    """print("waiting...", end="") reaches the caller while the rank sleeps, not at its exit;
    the rest of the line, when it comes, completes it."""
    script = tmp_path / "waiting.py"
    script.write_text(WAITING)
    caller = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE)
    arrivals: dict[str, float] = {}
    output = b""
    try:
        while "waiting" not in arrivals:
            assert select.select([caller.stdout], [], [], 30)[0], output
            chunk = os.read(caller.stdout.fileno(), 65536)
            assert chunk, output
            output += chunk
            for name, text in (("start", b"[rank0]: start\n"), ("waiting", b"[rank0]: waiting...")):
                if text in output:
                    arrivals.setdefault(name, time.monotonic())
        rest, _ = caller.communicate(timeout=60)
    finally:
        caller.kill()
        caller.wait()
    assert arrivals["waiting"] - arrivals["start"] < 0.5
    assert (output + rest).decode() == "[rank0]: start\n[rank0]: waiting... done\n"


def run_cells(sources: list[str], tmp_path: Path) -> list:
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(source) for source in sources])
    NotebookClient(notebook, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    return notebook.cells


def stream_text(cell) -> str:
    return "".join(o.get("text", "") for o in cell.outputs if o.output_type == "stream")


def test_bars_in_a_notebook_cell_are_one_display_updated_in_place(tmp_path):
    """In a Jupyter cell the bars live in a display output, one row per bar, updated in place
    (no widgets), one display per block of bars that overlap in time; the cell's text holds
    the ordinary lines only."""
    cells = run_cells([BARS.format(ranks=2), BARS.format(ranks=8)], tmp_path)
    for cell, ranks in zip(cells, (2, 8)):
        # The tqdm bars and the step counters are two blocks, or one where they overlapped.
        displays = [o for o in cell.outputs if o.output_type == "display_data"]
        assert 1 <= len(displays) <= 2, cell.outputs
        rows = [row for display in displays for row in display.data["text/plain"].splitlines()]
        assert bar_rows(rows) == rows, rows
        expect_one_final_row_per_bar(rows, ranks)
        text = stream_text(cell)
        assert bar_rows(text.splitlines()) == [] and "\r" not in text, text
        for rank in range(ranks):
            assert f"[rank{rank}]: starting {rank}\n" in text and f"[rank{rank}]: done {rank}\n" in text


def test_a_line_without_newline_shows_in_a_notebook_cell_while_the_rank_waits(tmp_path):
    """The same in a Jupyter cell: the start of the line is in the cell within half a second."""
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(WAITING)])
    client = NotebookClient(notebook, timeout=120, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}})
    cell = notebook.cells[0]

    async def scenario() -> dict[str, float]:
        arrivals: dict[str, float] = {}
        async with client.async_setup_kernel():
            running = asyncio.ensure_future(client.async_execute_cell(cell, 0))
            deadline = time.monotonic() + 60
            while "waiting" not in arrivals:
                assert time.monotonic() < deadline and not running.done(), cell.outputs
                text = stream_text(cell)
                if "[rank0]: start\n" in text:
                    arrivals.setdefault("start", time.monotonic())
                if "[rank0]: waiting..." in text:
                    arrivals.setdefault("waiting", time.monotonic())
                await asyncio.sleep(0.01)
            await asyncio.wait_for(running, 60)
        return arrivals

    arrivals = asyncio.run(scenario())
    assert arrivals["waiting"] - arrivals["start"] < 0.5
    started, _, rest = stream_text(cell).partition("\n")
    assert STARTED.fullmatch(started) and rest == "[rank0]: start\n[rank0]: waiting... done\n", stream_text(cell)


@pytest.mark.parametrize("display", ["logs", "panel"])
def test_a_line_of_100_mb_without_newline_passes_a_terminal_in_seconds(tmp_path, display):
    """Redrawn 1 MiB lines and 100 MB with no newline, in a terminal: the panel read each redraw
    in time quadratic in its length (a 64 KiB line never returned)."""
    script = tmp_path / "long_lines.py"
    script.write_text(long_lines.caller(display))
    chunks = run_in_terminal(script, timeout=300)
    shown = b"".join(chunk for _, chunk in chunks).decode(errors="replace")
    long_lines.check_cost(shown)
    assert len(shown) < 5_000_000, len(shown)
    assert rendered(chunks)[-2] == "returned"


@pytest.mark.parametrize("display", ["logs", "panel"])
def test_a_line_of_100_mb_without_newline_passes_a_notebook_cell_in_seconds(tmp_path, display):
    cell = run_cells([long_lines.caller(display)], tmp_path)[0]
    text = stream_text(cell)
    long_lines.check_cost(text)
    assert "returned\n" in text
    shown = sum(len(o.get("text", "")) + sum(len(str(v)) for v in o.get("data", {}).values()) for o in cell.outputs)
    assert shown < 5_000_000, shown


@pytest.mark.parametrize("display", ["logs", "panel"])
def test_no_control_sequence_of_a_rank_reaches_a_terminal(tmp_path, display):
    """What a rank prints, its traceback in the panel's row included, reaches the terminal
    without its control sequences: fanrun's own are the only ones there, and none is C1 or OSC."""
    script = tmp_path / "hostile.py"
    script.write_text(long_lines.hostile_caller(display))
    shown = b"".join(chunk for _, chunk in run_in_terminal(script)).decode()
    between = re.findall(r"<<(.*?)>>", shown, re.S)
    assert between and set(between) == {long_lines.SAFE[2:-2]}, between
    assert not [c for c in shown if 0x7f <= ord(c) <= 0x9f] and "\x1b]" not in shown and "\x1bP" not in shown
    if display == "panel":
        assert f"ValueError: {long_lines.SAFE}" in shown, shown[-3000:]


def test_no_control_sequence_of_a_rank_reaches_a_notebook_panel(tmp_path):
    cell = run_cells([long_lines.hostile_caller("panel")], tmp_path)[0]
    panels = [o for o in cell.outputs if o.output_type == "display_data"]
    assert len(panels) == 1, cell.outputs
    page, rows = panels[0].data["text/html"], panels[0].data["text/plain"]
    assert long_lines.controls_in(page + rows + stream_text(cell)) == [], (page, rows)
    assert f"ValueError: {long_lines.SAFE.replace('<', '&lt;').replace('>', '&gt;')}" in page, page
    assert f"[rank0]: {long_lines.SAFE}" in rows, rows
