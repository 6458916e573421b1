"""Rank output: live in the caller's sys.stdout/sys.stderr, labelled, progress bars kept readable, logs on disk."""

from __future__ import annotations

import os
import re
from pathlib import Path

from fanrun import distributed


@distributed(num_accelerators=2)
def chatty():
    import os
    import sys

    rank = os.environ["RANK"]
    print(f"hello from {rank}")
    print(f"warning from {rank}", file=sys.stderr)
    return os.environ["FANRUN_RUN_DIR"]


def test_lines_are_labelled_and_go_to_the_right_stream(capsys):
    run_dir = chatty.distributed()[0]
    out, err = capsys.readouterr()
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
    assert out == "[rank0]: done\n"
    # Each state drawn over the last, and the final one closed by a newline.
    assert re.fullmatch(r"(\[rank0\]: step 1/3)?(\r\[rank0\]: step [23]/3)*\r\[rank0\]: step 3/3\n", err) or \
        re.fullmatch(r"\[rank0\]: step 1/3(\r\[rank0\]: step [23]/3)+\n", err), repr(err)
    assert err.count("\n") == 1


def test_partial_long_and_binary_output_is_kept(capsys):
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
    assert "".join(line.removeprefix("[rank0]: ") for line in lines if "x" * 100 in line) == "x" * 200_000
    assert "[rank0]: bin:\ufffd\ufffd\x00end" in lines
    assert lines[-1] == "[rank0]: no newline at the end"
    with open(os.path.join(run_dir, "rank_0.log"), "rb") as f:
        assert f.read() == b"x" * 200_000 + b"\nbin:\xff\xfe\x00end\nno newline at the end"


def test_a_quiet_call_wakes_its_caller_rarely_and_its_log_keeps_every_line(monkeypatch, capsys):
    from fanrun._launch.output import OutputMux

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
