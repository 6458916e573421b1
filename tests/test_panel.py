"""The live panel: progress read back from the ranks' bars, stalled and slow ranks flagged, and
the panel drawn by real calls: in a pseudo-terminal (rendered by pyte), in a Jupyter cell (a
real kernel), and the stacks of a running call's ranks, from another thread and from a shell."""

from __future__ import annotations

import html.parser
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import nbformat
import pyte
import pytest
from nbclient import NotebookClient
from gpus import needs_gpus
from processes import processes_of_runs_under, wait_gone
from test_live_output import ROWS, rendered, run_in_terminal

from fanrun._display import progress_text
from fanrun._display.panel import Panel
from fanrun._display.panel_metrics import MetricFiles
from fanrun._display.panel_render import html_panel, text_rows
from fanrun._display.panel_view import PanelView


@pytest.fixture(autouse=True)
def default_display(monkeypatch):
    monkeypatch.delenv("FANRUN_DISPLAY", raising=False)  # the default: the panel in a notebook


def test_tqdm_lines_are_read_back_as_progress():
    bar = progress_text.parse("train:  45%|████▌     | 45/100 [00:01<00:01, 39.82it/s, loss=0.1]")
    assert (bar.n, bar.total, bar.description, bar.rate, bar.fraction) == (45, 100, "train", 39.82, 0.45)
    assert round(bar.seconds_left, 2) == round(55 / 39.82, 2)
    slow = progress_text.parse("  3%|▎         | 3/100 [00:07<03:55,  2.50s/it]")
    assert slow.rate == pytest.approx(0.4) and progress_text.format_rate(slow) == "2.5 s/it"
    counted = progress_text.parse("eval: 123it [00:01, 99.5it/s]")
    assert (counted.n, counted.total, counted.rate) == (123, None, 99.5)
    assert progress_text.parse("Epoch 3/10").fraction == 0.3
    assert progress_text.parse("Epoch 3/10", tqdm_only=True) is None
    assert progress_text.parse("loss 0.25") is None


def test_a_quiet_rank_is_flagged_and_a_slow_one_marked():
    panel = Panel(3, ["GPU 0", "GPU 1", "GPU 2"], started_at=0.0, stall_warning=300.0)
    panel.started(0.0)
    def bar(rank: int, rate: str, now: float) -> None:
        panel.progress(rank, f" 10%|#         | 10/100 [00:01<00:09, {rate}it/s]", now=now)

    bar(0, "10.0", 290.0)
    bar(1, "6.0", 290.0)
    assert panel.next_stall_in(100.0) == 200.0  # rank 2, quiet since 0
    assert panel.stalled_for(2, 299.0) is None and panel.stalled_for(2, 360.0) == 360.0
    assert panel.stragglers() == set()  # 6 is not under half the median, 8
    bar(1, "2.0", 295.0)
    assert panel.stragglers() == {1}
    rows = text_rows(panel, now=700.0)
    assert "no progress for 6 min" in rows[0] and "straggler" in rows[1] and "straggler" not in rows[0]
    page = html_panel(panel, now=700.0)
    assert page.count('class="fanrun-rank"') == 3 and page.count("fanrun-flag") == 4
    panel.rows[0].gpu = (87.0, 41234.0)
    assert text_rows(panel, now=700.0)[0].startswith("rank 0  GPU 0 (GPU 87% 41.2 GB)  running")
    assert '<div class="fanrun-gpu" style="color:#555">GPU 87% 41.2 GB</div>' in html_panel(panel, now=700.0)


def test_a_failed_rank_row_holds_its_traceback_and_markup_is_escaped():
    panel = Panel(2, ["CPU", "CPU"], started_at=0.0, stall_warning=None)
    panel.started(0.0)
    panel.partial(0, "waiting...", now=1.0)
    assert panel.rows[0].last_line == "waiting..." and panel.rows[0].active_at == 1.0 and not panel.logs
    panel.line(1, "<b>step</b> 3", now=1.0)
    panel.finish(False, 1, ["Traceback (most recent call last):", '  File "x.py", line 3, in f', "ValueError: bad <batch>"])
    assert [row.state for row in panel.rows] == ["stopped", "failed"]
    page = html_panel(panel, now=2.0)
    assert "&lt;b&gt;step&lt;/b&gt; 3" in page and "ValueError: bad &lt;batch&gt;" in page and "<b>" not in page
    assert 'data-rank="1" data-state="failed"' in page
    assert text_rows(panel, now=2.0)[-1] == "    ValueError: bad <batch>"


def test_a_running_panel_shows_the_latest_lines_and_an_ended_one_every_kept_line_collapsed():
    panel = Panel(1, ["CPU"], started_at=0.0, stall_warning=None)
    panel.started(0.0)
    for step in range(600):
        panel.line(0, f"step {step}", now=1.0)
    running = html_panel(panel, now=2.0)
    assert "<details" not in running  # redrawn every second, it would close under the reader
    assert running.count("[rank0]: step") == 6 and "[rank0]: step 594" in running and "[rank0]: step 599" in running
    panel.finish(True)
    ended = html_panel(panel, now=3.0)
    assert "fanrun-tail" not in ended and "Logs (last 500 of 600 lines)" in ended
    assert ended.count("[rank0]: step") == 500 and "[rank0]: step 100\n" in ended


def test_a_notebook_panel_with_points_to_plot_draws_once_a_second_and_plots_no_more_often(tmp_path):
    """The engine waits as long as due_in says: a view always due would spin the caller's loop."""
    view = PanelView(Panel(1, ["CPU"], started_at=0.0, stall_warning=None), "notebook", metrics=MetricFiles(tmp_path, 1))
    drawn, plotted = [], []
    view._draw_in_cell = drawn.append  # the cell's display: what would be sent, counted
    plot_draw = view._plot.draw
    view._plot.draw = lambda series, now: (plotted.append(now), plot_draw(series, now))
    view.started(0.0)
    now, waits = 0.0, 0
    with open(tmp_path / "rank_0.metrics.tsv", "a") as feed:
        while now < 30.0:
            feed.write(f"loss\t{int(now * 100)}\t{1 / (1 + now)}\n")
            feed.flush()
            view.line((0, 1), f"step {now}", "", now)
            view.redraw(now)
            wait = view.due_in(now)
            waits += wait == 0
            now += 0.02
    assert waits == 0
    assert 29 <= len(drawn) <= 31, drawn
    assert 3 <= len(plotted) <= 30, plotted
    assert view.panel.rows[0].metrics["loss"] < 0.2


PANEL_CALL = """
from fanrun import distributed

@distributed(num_accelerators={ranks}, accelerator_type="CPU", tracking=False, display="panel")
def train(fail_rank):
    import os
    import time
    from tqdm import tqdm

    rank = int(os.environ["RANK"])
    for step in tqdm(range(30), desc="train", mininterval=0.02):
        time.sleep(0.01 * (1 + rank % 3))
        if step % 10 == 0:
            print(f"rank {{rank}} step {{step}}", flush=True)
    if rank == fail_rank:
        raise ValueError(f"bad batch on {{rank}}")
    return rank

try:
    print("returned", train.distributed({fail_rank}))
except ValueError as error:
    print("raised", error)
"""


def test_eight_ranks_with_bars_are_one_panel_in_a_terminal(tmp_path):
    script = tmp_path / "panel.py"
    script.write_text(PANEL_CALL.format(ranks=8, fail_rank=-1))
    lines = rendered(run_in_terminal(script))
    rows = [line for line in lines if line.startswith("rank ")]
    assert len(rows) == 8, "\n".join(lines)
    for rank, row in enumerate(rows):
        assert row.startswith(f"rank {rank}  CPU  done") and "30/30 100%" in row, row
    assert not any("[rank" in line for line in lines), "\n".join(lines)  # no flood of lines
    # The panel's title is the run's id, which stays on the screen once the panel has ended.
    title = lines.index(rows[0]) - 1
    assert re.fullmatch(r"run train-\d{8}-\d{6}-[0-9a-f]{6}: 8 CPU processes", lines[title]), "\n".join(lines)
    assert os.path.isdir(os.path.join(os.environ["FANRUN_RUNS_DIR"], "records", lines[title].split()[1][:-1]))
    assert not any(line.startswith("fanrun: run ") for line in lines), "\n".join(lines)  # said once, in the panel
    assert len(lines) <= 8 + 5, "\n".join(lines)
    assert lines[-1] == "returned [0, 1, 2, 3, 4, 5, 6, 7]"


def test_a_failed_rank_turns_its_row_red_with_its_traceback_and_still_raises(tmp_path):
    script = tmp_path / "panel.py"
    script.write_text(PANEL_CALL.format(ranks=2, fail_rank=1))
    lines = rendered(run_in_terminal(script))
    failed = next(i for i, line in enumerate(lines) if line.startswith("rank 1  CPU  failed"))
    assert "    ValueError: bad batch on 1" in lines[failed + 1: failed + 9], "\n".join(lines)
    assert lines[-1] == "raised [rank 1] bad batch on 1", lines[-1]


GPU_CALL = """
from fanrun import distributed

@distributed(num_accelerators=1, tracking=False, display="panel")
def busy():
    import torch
    from tqdm import tqdm

    x = torch.randn(8192, 8192, device="cuda")
    for _ in tqdm(range(60), desc="matmul", mininterval=0.05):
        for _ in range(20):
            x = torch.tanh(x @ x)
        torch.cuda.synchronize()
    return round(torch.cuda.max_memory_allocated() / 1e9, 1)

print("returned", busy.distributed())
"""


@needs_gpus(1)
def test_a_gpu_rank_row_shows_its_gpu_utilisation_and_memory(tmp_path):
    script = tmp_path / "gpu.py"
    script.write_text(GPU_CALL)
    frames = b"".join(chunk for _, chunk in run_in_terminal(script)).decode(errors="replace")
    busy = [int(m) for m in re.findall(r"rank 0  GPU 0 \(GPU (\d+)% [0-9.]+ GB\)  running", frames)]
    assert busy and max(busy) >= 50, frames[-3000:]


def test_at_80_columns_the_panel_keeps_its_stacks_command_whole(tmp_path):
    """In a terminal of 80 columns, every state of the screen is read as it stands: the running
    panel's hint, wrapped to the width, shows `fanrun stacks RUN` whole on one row, with a run
    that exists (a row cut at the width left half the run's name)."""
    script = tmp_path / "panel.py"
    script.write_text(PANEL_CALL.format(ranks=2, fail_rank=-1))
    screen = pyte.Screen(80, ROWS)
    stream = pyte.ByteStream(screen)
    commands = set()
    for _, chunk in run_in_terminal(script, columns=80):
        stream.feed(chunk)
        commands |= {m.group(1) for row in screen.display for m in re.finditer(r"fanrun stacks ([\w.-]+)", row)}
    records = os.path.join(os.environ["FANRUN_RUNS_DIR"], "records")
    assert commands and all(os.path.isdir(os.path.join(records, run)) for run in commands), commands
    assert "returned [0, 1]" in [row.rstrip() for row in screen.display], screen.display


def test_a_progress_line_of_any_length_is_read_in_time_linear_in_its_tail():
    """tqdm's forms read back from the end of a line, and lines that only look like them, long:
    regular expressions tried at every place of a line had not read these in 60 s."""
    bar = "train:  45%|####5     | 45/100 [00:01<00:01, 39.82it/s]"
    assert progress_text.parse("x" * 1_000_000 + bar).n == 45
    lookalikes = ["x" * 10_000_000, "1%|" * 1_000_000, "1/" * 1_000_000, "1a [" * 1_000_000 + "]", "9" * 10_000_000,
                  ":" * 1_000_000 + "%|1|", "1" * 100_000 + "%|" + " " * 100_000 + "|"]
    started = time.process_time()
    for text in lookalikes * 10:
        progress_text.parse(text)
    assert time.process_time() - started < 2.0  # well under a millisecond each, here


STALLING = """
from fanrun import distributed

@distributed(num_accelerators=2, accelerator_type="CPU", tracking=False, display="panel", stall_warning=1)
def train():
    import os, time
    rank = int(os.environ["RANK"])
    for step in range(50):
        if rank == 0:
            print(f"step {step}", flush=True)
        time.sleep(0.06)
    return rank

print("returned", train.distributed())
"""


def test_a_rank_quiet_past_stall_warning_is_flagged_while_it_runs(tmp_path):
    script = tmp_path / "stalling.py"
    script.write_text(STALLING)
    frames = b"".join(chunk for _, chunk in run_in_terminal(script)).decode(errors="replace")
    assert re.search(r"rank 1  CPU  running  [^\n]*no progress for [0-9] s", frames), frames[-3000:]
    assert not re.search(r"rank 0  CPU  running  [^\n]*no progress", frames), frames[-3000:]
    assert rendered([(0.0, frames.encode())])[-1] == "returned [0, 1]"


INTERRUPTED = """
import os, signal, sys, threading, time
from fanrun import distributed

folder = sys.argv[1]

@distributed(num_accelerators=2, accelerator_type="CPU", tracking=False, display="panel")
def wait(folder):
    import os, time
    open(os.path.join(folder, "ready" + os.environ["RANK"]), "w").close()
    time.sleep(120)

def interrupt():
    # Ctrl+C, once both ranks run: SIGINT to this process, as a terminal sends it.
    while not all(os.path.exists(os.path.join(folder, f"ready{r}")) for r in range(2)):
        time.sleep(0.05)
    os.kill(os.getpid(), signal.SIGINT)

threading.Thread(target=interrupt, daemon=True).start()
try:
    wait.distributed(folder)
except KeyboardInterrupt:
    print("interrupted")
"""


def test_an_interrupted_call_leaves_its_rows_stopped(tmp_path):
    script = tmp_path / "interrupted.py"
    script.write_text(f"import sys; sys.argv[1:] = [{str(tmp_path)!r}]\n" + INTERRUPTED)  # run_in_terminal passes none
    lines = rendered(run_in_terminal(script))
    rows = [line for line in lines if line.startswith("rank ")]
    assert [row.split()[3] for row in rows] == ["stopped", "stopped"], "\n".join(lines)
    assert lines[-1] == "interrupted"
    assert processes_of_runs_under(os.environ["FANRUN_RUNS_DIR"]) == []


STACKS = """
import os, subprocess, sys, threading, time
import fanrun
from fanrun import distributed

folder = sys.argv[1]

@distributed(num_accelerators=2, accelerator_type="CPU", tracking=False, display="quiet")
def wait_for_go(folder):
    import os, time
    open(os.path.join(folder, "ready" + os.environ["RANK"]), "w").close()
    while not os.path.exists(os.path.join(folder, "go")):
        time.sleep(0.05)
    return int(os.environ["RANK"])

def look():
    # From another thread while the call runs in the main one; the ranks go on afterwards.
    try:
        deadline = time.monotonic() + 120
        while not all(os.path.exists(os.path.join(folder, f"ready{r}")) for r in range(2)):
            assert time.monotonic() < deadline, "the ranks never started"
            time.sleep(0.05)
        stacks = fanrun.stacks()
        print(stacks, flush=True)
        shell = subprocess.run([sys.executable, "-m", "fanrun", "stacks", stacks.run_id], capture_output=True, text=True)
        print("CLI", shell.returncode, shell.stdout, shell.stderr, flush=True)
    finally:
        open(os.path.join(folder, "go"), "w").close()

threading.Thread(target=look, daemon=True).start()
print("returned", wait_for_go.distributed(folder))
"""


def test_stacks_of_a_running_call_from_another_thread_and_from_a_shell(tmp_path):
    script = tmp_path / "stacks.py"
    script.write_text(STACKS)
    done = subprocess.run([sys.executable, str(script), str(tmp_path)], capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    api, _, cli = done.stdout.partition("CLI ")
    for text in (api, cli):
        for rank in range(2):
            section = text.split(f"--- rank {rank} of run ")[1].split("--- rank")[0]
            assert "(most recent call first)" in section and "wait_for_go" in section, done.stdout
            # Asked on the rank's FIFO, which names the threads, rather than dumped on a signal.
            assert "[MainThread] (most recent call first)" in section, done.stdout
    assert cli.startswith("0 ") and done.stdout.rstrip().endswith("returned [0, 1]"), done.stdout
    assert processes_of_runs_under(os.environ["FANRUN_RUNS_DIR"]) == []


def test_stacks_without_a_running_call_or_of_no_such_run_is_a_clear_error():
    import fanrun

    with pytest.raises(fanrun.StacksError, match="No fanrun call is running in this process"):
        fanrun.stacks()
    with pytest.raises(fanrun.StacksError, match="no run none-20261201-000000-000000 in "):
        fanrun.stacks("none-20261201-000000-000000")
    with pytest.raises(fanrun.StacksError, match="'20261201-000000-0-none' is not a run id"):
        fanrun.stacks("20261201-000000-0-none")
    shell = subprocess.run([sys.executable, "-m", "fanrun", "stacks", "none-20261201-000000-000000"], capture_output=True,
                           text=True)
    assert shell.returncode == 2 and "no run none-20261201-000000-000000 in " in shell.stderr


# In a notebook, without display=: the default. Each rank logs its loss, untracked (tracking=False).
NOTEBOOK_CALL = """
from fanrun import distributed

@distributed(num_accelerators=2, accelerator_type="CPU", tracking=False)
def train():
    import os
    import time
    import mlflow
    from tqdm import tqdm

    rank = int(os.environ["RANK"])
    for step in tqdm(range(40), desc="train", mininterval=0.02):
        time.sleep(0.05)
        mlflow.log_metric("loss", (1 + rank) / (step + 1), step=step)
        if step % 10 == 0:
            print(f"rank {rank} step {step}", flush=True)
    return rank

print("returned", train.distributed())
"""


@pytest.fixture(scope="module")
def notebook_run(tmp_path_factory):
    """NOTEBOOK_CALL run once in a real kernel, without FANRUN_DISPLAY: the default display."""
    folder = tmp_path_factory.mktemp("notebook")
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(NOTEBOOK_CALL)])
    with pytest.MonkeyPatch.context() as patch:
        patch.delenv("FANRUN_DISPLAY", raising=False)
        NotebookClient(notebook, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(folder)}}).execute()
    return notebook, folder


def test_a_notebook_cell_shows_one_panel_updated_in_place(notebook_run):
    notebook, _ = notebook_run
    outputs = notebook.cells[0].outputs
    panels = [o for o in outputs if o.output_type == "display_data" and "fanrun-panel" in o.data.get("text/html", "")]
    assert len(panels) == 1, outputs
    page = panels[0].data["text/html"]
    assert page.count('class="fanrun-rank"') == 2, page
    for rank in range(2):
        assert f'data-rank="{rank}" data-state="done" data-fraction="1.0000"' in page, page
    assert "rank 1 step 30" in page  # the logs, under the panel
    assert page.count('class="fanrun-plot"') == 1 and "data:image/png;base64," in page
    assert "loss=0.025" in page and "loss=0.05" in page  # each rank's last value: 1/40, 2/40
    streams = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    assert "[rank" not in streams and "returned [0, 1]" in streams, streams


def test_eight_ranks_with_bars_are_one_panel_in_a_notebook_cell(tmp_path):
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(
        PANEL_CALL.format(ranks=8, fail_rank=-1).replace(', display="panel"', ""))])
    NotebookClient(notebook, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    outputs = notebook.cells[0].outputs
    panels = [o for o in outputs if o.output_type == "display_data"]
    assert len(panels) == 1 and "fanrun-panel" in panels[0].data["text/html"], outputs
    page = panels[0].data["text/html"]
    for rank in range(8):
        assert f'data-rank="{rank}" data-state="done" data-fraction="1.0000"' in page, page
    # Its title is the run's id, a person's to type into `fanrun stacks`, `logs`, `attach`: said once, there.
    assert re.search(r'<div class="fanrun-title"[^>]*>run train-\d{8}-\d{6}-[0-9a-f]{6}: 8 CPU processes</div>', page), page
    printed = "".join(o.get("text", "") for o in outputs if o.output_type == "stream" and o.name == "stdout")
    assert printed == "returned [0, 1, 2, 3, 4, 5, 6, 7]\n", printed
    # Nothing of the ranks on stderr: only, where 8 ranks outnumber the cores, the one line that says so.
    warned = [o.get("text", "") for o in outputs if o.output_type == "stream" and o.name == "stderr"]
    assert all(text.startswith("fanrun: 8 CPU processes share the") for text in warned), warned


class _Dom(html.parser.HTMLParser):
    """The elements a browser ended up with, as (tag, attributes)."""

    def __init__(self) -> None:
        super().__init__()
        self.elements: list[tuple[str, dict[str, str]]] = []

    def handle_starttag(self, tag, attrs):
        self.elements.append((tag, {name: value or "" for name, value in attrs}))

    def with_class(self, name: str) -> list[dict[str, str]]:
        return [attrs for _, attrs in self.elements if name in attrs.get("class", "").split()]


def chromium(profile: Path, *arguments: str) -> subprocess.CompletedProcess:
    binary = shutil.which("chromium")
    assert binary, "Chromium is not installed: `make test-python` installs Debian's chromium"
    done = subprocess.run([binary, "--headless", "--no-sandbox", "--disable-gpu", f"--user-data-dir={profile}",
                           *arguments], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def test_the_exported_notebook_in_a_browser_shows_the_panel_and_its_plot(notebook_run):
    from nbconvert import HTMLExporter

    notebook, folder = notebook_run
    page = folder / "panel.html"
    page.write_text(HTMLExporter().from_notebook_node(notebook)[0])
    profile = folder / "chromium-profile"
    dom = _Dom()
    dom.feed(chromium(profile, "--dump-dom", page.as_uri()).stdout)
    assert len(dom.with_class("fanrun-panel")) == 1
    rows = dom.with_class("fanrun-rank")
    assert [(r["data-rank"], r["data-state"]) for r in rows] == [("0", "done"), ("1", "done")], rows
    bars = [attrs for tag, attrs in dom.elements if tag == "progress"]
    assert [float(b["value"]) / float(b["max"]) for b in bars] == [1.0, 1.0], bars
    plots = dom.with_class("fanrun-plot")
    assert len(plots) == 1 and plots[0]["src"].startswith("data:image/png;base64,")
    shot = folder / "panel.png"
    chromium(profile, "--window-size=1000,820", f"--screenshot={shot}", page.as_uri())
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 10_000
    if os.environ.get("FANRUN_SCREENSHOT"):  # where README's screenshot is refreshed from
        shutil.copyfile(shot, os.environ["FANRUN_SCREENSHOT"])
    assert wait_gone(_processes_with(str(profile)), timeout=10) == []


def _processes_with(text: str) -> list[int]:
    """Live processes whose command line holds `text` (the browser's and its helpers')."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as file:
                    if text.encode() in file.read():
                        found.append(int(entry))
            except OSError:
                pass
    return found


def test_eight_ranks_in_tmux_are_one_panel_on_its_screen(tmp_path):
    script = tmp_path / "panel.py"
    script.write_text(PANEL_CALL.format(ranks=8, fail_rank=-1))
    socket = str(tmp_path / "tmux.sock")
    tmux = ["tmux", "-S", socket]
    command = f"{sys.executable} {script}; tmux -S {socket} wait-for -S call-ended"
    subprocess.run([*tmux, "new-session", "-d", "-x", "150", "-y", "40", command], check=True, env={**os.environ, "TERM": "xterm"})
    try:
        subprocess.run([*tmux, "set-option", "-g", "remain-on-exit", "on"], check=True)
        subprocess.run([*tmux, "wait-for", "call-ended"], check=True, timeout=240)
        screen = subprocess.run([*tmux, "capture-pane", "-p", "-S", "-"], check=True, capture_output=True,
                                text=True).stdout.rstrip("\n").splitlines()
    finally:
        subprocess.run([*tmux, "kill-server"], capture_output=True)
    # tmux's own line, once the pane that remain-on-exit keeps has ended, is not the call's.
    lines = [line.rstrip() for line in screen if line.strip() and not line.startswith("Pane is dead")]
    rows = [line for line in lines if line.startswith("rank ")]
    assert [row[:len(f"rank {r}  CPU  done")] for r, row in enumerate(rows)] == \
        [f"rank {r}  CPU  done" for r in range(8)], "\n".join(lines)
    assert all("30/30 100%" in row for row in rows), "\n".join(lines)
    assert not any("[rank" in line for line in lines) and len(lines) <= 8 + 5, "\n".join(lines)
    assert re.fullmatch(r"run train-\S+: 8 CPU processes", lines[lines.index(rows[0]) - 1]), "\n".join(lines)  # its title
    assert lines[-1] == "returned [0, 1, 2, 3, 4, 5, 6, 7]"
    # kill-server returns before the server has exited.
    assert wait_gone(_processes_with(socket), timeout=10) == []
