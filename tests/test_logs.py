"""Rank output: live in the caller's sys.stdout/sys.stderr, labelled, progress bars kept readable, logs on disk."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import long_lines
import pytest

from fanrun import distributed


@distributed(num_accelerators=2)
def chatty():
    import os
    import sys

    rank = os.environ["RANK"]
    print(f"hello from {rank}")
    print(f"warning from {rank}", file=sys.stderr)
    return os.environ["FANRUN_RUN_DIR"]


def after_the_start_line(err: str) -> str:
    """The call's stderr after the one line it says as it starts (the run's id)."""
    first, _, rest = err.partition("\n")
    assert re.fullmatch(r"fanrun: run \S+-\d{8}-\d{6}-[0-9a-f]{6} started: .*; fanrun stacks \S+ shows every rank's stack",
                        first), err
    return rest


def test_lines_are_labelled_and_go_to_the_right_stream(capsys):
    run_dir = chatty.distributed()[0]
    out, err = capsys.readouterr()
    err = after_the_start_line(err)
    assert sorted(out.splitlines()) == ["[rank0]: hello from 0", "[rank1]: hello from 1"]
    assert sorted(err.splitlines()) == ["[rank0]: warning from 0", "[rank1]: warning from 1"]
    log = Path(run_dir, "rank_1.log").read_text()
    assert "hello from 1\n" in log and "warning from 1\n" in log


def test_progress_bar_redraws_in_place(capsys):
    @distributed(num_accelerators=1)
    def progress():
        import sys
        import time

        for i in range(1, 4):
            sys.stderr.write(f"\rstep {i}/3")
            sys.stderr.flush()
            time.sleep(0.2)  # separate writes, as a real bar makes them
        sys.stderr.write("\n")
        print("done")

    progress.distributed()
    out, err = capsys.readouterr()
    err = after_the_start_line(err)
    assert out == "[rank0]: done\n"
    # Each state drawn over the last, and the final one closed by a newline.
    assert re.fullmatch(r"(\[rank0\]: step 1/3)?(\r\[rank0\]: step [23]/3)*\r\[rank0\]: step 3/3\n", err) or \
        re.fullmatch(r"\[rank0\]: step 1/3(\r\[rank0\]: step [23]/3)+\n", err), repr(err)
    assert err.count("\n") == 1


def test_partial_long_and_binary_output_is_shown_bounded_and_kept_whole(capsys):
    @distributed(num_accelerators=1)
    def odd_output():
        import os
        import sys

        os.write(1, b"x" * 200_000 + b"\n")
        os.write(1, b"bin:\xff\xfe\x00end\n")
        sys.stdout.write("no newline at the end")
        return os.environ["FANRUN_RUN_DIR"]

    run_dir = odd_output.distributed()[0]
    out, _ = capsys.readouterr()
    lines = out.splitlines()
    # The display shows a line's first 64 KiB, and the log keeps it whole.
    assert "[rank0]: " + "x" * 65536 + long_lines.left_out_note(200_000 - 65536) in lines
    assert "[rank0]: bin:\ufffd\ufffd\\x00end" in lines  # the NUL, a control character, shown as text
    assert lines[-1] == "[rank0]: no newline at the end"
    with open(os.path.join(run_dir, "rank_0.log"), "rb") as f:
        assert f.read() == b"x" * 200_000 + b"\nbin:\xff\xfe\x00end\nno newline at the end"


def test_a_quiet_call_wakes_its_caller_rarely_and_its_log_keeps_every_line(monkeypatch, capsys):
    from fanrun._display.output import OutputMux

    wakes = []
    flush = OutputMux.flush
    monkeypatch.setattr(OutputMux, "flush", lambda mux: (wakes.append(1), flush(mux))[1])

    @distributed(num_accelerators=1, display="quiet")
    def chatter():
        import os
        import time

        for line in range(300):  # over 1.5 s at least
            print(f"line {line}", flush=True)
            time.sleep(0.005)
        return os.environ["FANRUN_RUN_DIR"]

    run_dir = chatter.distributed()[0]
    assert capsys.readouterr().out == ""
    # The engine gathers the lines for a second before it hands them over: a wake-up per line
    # would be 300.
    assert 1 <= len(wakes) <= 10, len(wakes)
    assert Path(run_dir, "rank_0.log").read_text() == "".join(f"line {line}\n" for line in range(300))


@pytest.mark.parametrize("display", ["logs", "quiet", "panel"])
def test_a_line_of_100_mb_without_newline_passes_a_pipe_in_seconds_and_shows_cut(tmp_path, display):
    """A rank's line of any length costs its caller little time and memory, whatever the display
    (a panel asked for on a pipe shows logs): the display shows its first 64 KiB and says how much
    more the rank's log holds."""
    script = tmp_path / "long_lines.py"
    script.write_text(long_lines.caller(display))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    long_lines.check_cost(done.stdout)
    shown = done.stdout.splitlines()
    assert shown[-2:-1] == ["returned"], done.stdout[-3000:]
    if display == "quiet":
        assert len(shown) == 2, done.stdout[-3000:]
        return
    assert len(done.stdout) < 1_000_000  # two calls' lines, of 64 KiB at most each, and not 100 MB
    assert "[rank0]: " + "a" * 65536 in shown  # 64 KiB: shown whole
    huge = "[rank0]: " + "x" * long_lines.SHOWN + long_lines.left_out_note(long_lines.HUGE - long_lines.SHOWN)
    assert huge in shown, done.stdout[-3000:]


def test_no_control_sequence_of_a_rank_reaches_a_pipe(tmp_path):
    """Escape sequences (7-bit and C1), C0 and DEL in what a rank prints, in a line, a line shown
    before its end and a line redrawn: none is written on the caller's streams."""
    script = tmp_path / "hostile.py"
    script.write_text(long_lines.hostile_caller("logs"))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.endswith("raised\n"), done.stderr[-3000:]
    out, err = done.stdout, done.stderr
    assert long_lines.controls_in(out + err) == [], (out, err)
    assert f"[rank0]: {long_lines.SAFE}\n" in out and f"[rank0]: {long_lines.SAFE}\n" in err
    assert f"[rank0]: start {long_lines.SAFE} end\n" in out
    assert f"2/3 {long_lines.SAFE}" in out
