"""fanrun run: scripts, modules and native programs on the same engine."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

FANRUN = [sys.executable, "-m", "fanrun"]


def run(args, cwd=None, timeout=120):
    return subprocess.run(FANRUN + args, capture_output=True, text=True, cwd=cwd, timeout=timeout)


def test_script_runs_on_every_rank_with_its_arguments(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("import os, sys\nprint(os.environ['RANK'], os.environ['WORLD_SIZE'], sys.argv[1:], __name__)\n")
    done = run(["run", "-n", "3", str(script), "--lr", "0.1"])
    assert done.returncode == 0, done.stderr
    assert sorted(done.stdout.splitlines()) == [
        f"[rank{r}]: {r} 3 ['--lr', '0.1'] __main__" for r in range(3)
    ]


def test_console_script_and_module_mode(tmp_path):
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "job.py").write_text("import os\nprint('module rank', os.environ['RANK'])\n")
    fanrun_script = os.path.join(os.path.dirname(sys.executable), "fanrun")
    done = subprocess.run([fanrun_script, "run", "-n", "2", "-m", "pkg.job"], capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert done.returncode == 0, done.stderr
    assert sorted(done.stdout.splitlines()) == ["[rank0]: module rank 0", "[rank1]: module rank 1"]


def test_native_program_fans_out():
    done = run(["run", "-n", "2", "--no-python", "/bin/sh", "-c", "echo native $RANK of $WORLD_SIZE on $MASTER_ADDR"])
    assert done.returncode == 0, done.stderr
    assert sorted(done.stdout.splitlines()) == ["[rank0]: native 0 of 2 on 127.0.0.1", "[rank1]: native 1 of 2 on 127.0.0.1"]


def test_native_failure_exit_code_is_the_root_causes():
    done = run(["run", "-n", "2", "--no-python", "/bin/sh", "-c", 'if [ "$RANK" = 1 ]; then echo dying >&2; exit 7; fi; sleep 60'])
    assert done.returncode == 7
    assert "Rank 1 of 2" in done.stderr and "exited with code 7" in done.stderr
    assert "dying" in done.stderr


def test_script_exception_is_reported(tmp_path):
    script = tmp_path / "bad.py"
    script.write_text(textwrap.dedent(
        """
        import os, time
        if os.environ["RANK"] == "0":
            raise RuntimeError("script broke")
        time.sleep(60)
        """
    ))
    done = run(["run", "-n", "2", str(script)])
    assert done.returncode == 1
    assert "fanrun: a rank failed: RuntimeError: [rank 0] script broke" in done.stderr
    # The traceback once, with the script's own frames only (no runpy, no fanrun), and whole in the log.
    assert done.stderr.count("Traceback (most recent call last):") == 1
    traceback_text = done.stderr[done.stderr.index("Traceback (most recent call last):"):]
    assert f'File "{script}", line 4, in <module>' in traceback_text
    assert "runpy" not in done.stderr and "_rank/worker.py" not in done.stderr
    assert "[rank0]: Traceback" not in done.stderr
    log = done.stderr.rsplit("full log: ", 1)[1].strip()
    assert "RuntimeError: script broke" in Path(log).read_text()


def test_bad_arguments_are_reported_before_anything_starts():
    done = run(["run", "-n", "0", "--no-python", "true"])
    assert done.returncode == 1 and "-n must be at least 1" in done.stderr
    done = run(["run", "--no-python", "/nonexistent/program"])
    assert done.returncode == 1 and "Cannot run '/nonexistent/program': no such file" in done.stderr
    done = run(["run", "--accelerator-type", "GPU_8xH100", "--no-python", "true"])
    assert done.returncode == 1 and "asks for GPUs, but this machine has no GPU" in done.stderr


def test_version():
    from fanrun import __version__

    done = run(["--version"])
    assert done.returncode == 0 and done.stdout.strip() == f"fanrun {__version__}"


def test_torchrun_command_line_runs_as_it_is(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("import os\nprint(os.environ['RANK'], os.environ['WORLD_SIZE'])\n")
    for flags in (["--standalone", "--nproc_per_node=3"], ["--nnodes=1", "--nproc-per-node", "3", "--max_restarts=0"],
                  ["--rdzv-backend=c10d", "--rdzv-endpoint=localhost:0", "--nproc_per_node", "3", "--monitor-interval=1"]):
        done = run(["run", *flags, str(script)])
        assert done.returncode == 0, (flags, done.stderr)
        assert sorted(done.stdout.splitlines()) == [f"[rank{r}]: {r} 3" for r in range(3)], flags


def test_nproc_per_node_cpu_is_one_rank_per_core(tmp_path):
    done = run(["run", "--nproc-per-node=cpu", "--no-python", "/bin/sh", "-c", "echo $WORLD_SIZE"])
    assert done.returncode == 0, done.stderr
    assert len(done.stdout.splitlines()) == os.cpu_count()
    assert set(line.split(": ")[1] for line in done.stdout.splitlines()) == {str(os.cpu_count())}


def test_torchrun_flags_that_cannot_apply_name_what_to_do():
    cases = {
        ("--nnodes=2",): "--nnodes 2: fanrun run starts the ranks of this machine only",
        ("--master_port=29500",): "fanrun picks and holds a free port",
        ("--master-addr", "10.0.0.1"): "drop --master-addr",
        ("--max-restarts=-1",): "--max-restarts must be a whole number of restarts, 0 or more, not '-1'",
        ("--start-method=fork",): "every rank is a fresh interpreter (spawn)",
        ("--rdzv_endpoint=node7:29400",): "fanrun run's rendezvous is on 127.0.0.1",
        ("--log_dir=/tmp/logs",): "FANRUN_RUNS_DIR",
        ("--tee=3",): "kept whole in its log",
        ("--nproc-per-node=many",): "must be a number of ranks, or gpu, cpu or auto",
    }
    for flags, expected in cases.items():
        done = run(["run", *flags, "--no-python", "true"])
        assert done.returncode == 1 and expected in done.stderr, (flags, done.stderr)


def test_missing_script_is_an_error_before_any_rank_starts(tmp_path, runs_dir):
    before = set(os.listdir(runs_dir))
    done = run(["run", "-n", "2", "no_such_train.py"], cwd=tmp_path)
    assert done.returncode == 1
    assert "the script 'no_such_train.py' does not exist" in done.stderr
    assert set(os.listdir(runs_dir)) == before  # no run was made


def test_rank_killed_by_a_signal_exits_like_a_shell():
    """128 + the signal's number, as a shell reports a command a signal killed."""
    done = run(["run", "-n", "2", "--no-python", "/bin/sh", "-c", 'if [ "$RANK" = 1 ]; then kill -SEGV $$; fi; sleep 60'])
    assert done.returncode == 128 + 11, done.stderr
    assert "killed by SIGSEGV" in done.stderr


FLAKY = """
import os, sys
print("attempt", os.environ["TORCHELASTIC_RESTART_COUNT"], os.environ["FANRUN_RESTART_COUNT"],
      os.environ["TORCHELASTIC_MAX_RESTARTS"], flush=True)
if os.environ["RANK"] == "1" and int(os.environ["FANRUN_RESTART_COUNT"]) < int(sys.argv[1]):
    sys.exit(3)
"""


def test_max_restarts_starts_every_rank_again_as_torchrun_does(tmp_path):
    (tmp_path / "flaky.py").write_text(FLAKY)
    done = run(["run", "-n", "2", "--max-restarts", "2", "flaky.py", "1"], cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert sorted(done.stdout.splitlines()) == ["[rank0]: attempt 0 0 2", "[rank0]: attempt 1 1 2",
                                                "[rank1]: attempt 0 0 2", "[rank1]: attempt 1 1 2"]
    assert done.stderr.count("; starting every rank again") == 1, done.stderr
    # Every restart spent: the last attempt's failure is the run's.
    done = run(["run", "-n", "2", "--max_restarts=1", "flaky.py", "5"], cwd=tmp_path)
    assert done.returncode == 3, done.stderr
    assert done.stdout.count("[rank1]: attempt") == 2 and "attempt 1 of 2 failed" in done.stderr
