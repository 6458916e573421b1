"""fanrun run: scripts, modules and native programs on the same engine."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

from processes import wait_gone

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


def test_run_help_shows_fanruns_flags_in_groups_and_hides_torchruns():
    done = run(["run", "--help"])
    assert done.returncode == 0, done.stderr
    for shown in ("--max-restarts N", "output:", "--display HOW", "--stall-warning SECONDS", "detached runs:",
                  "--detach", "--watch", "MLflow tracking:", "--tracking", "--experiment-name NAME", "--run-name NAME"):
        assert shown in done.stdout, shown
    for hidden in ("--rdzv", "--master-port", "--tee", "--log-dir"):
        assert hidden not in done.stdout, hidden


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
        ("--nnodes=2",): "--nnodes 2: fanrun run starts the ranks of one machine, or with --nodes M",
        ("--nodes=2",): "--nodes 2 runs on the nodes of a Slurm allocation, and this shell is in none",
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
    # Rank 0's first attempt may be abandoned before its script begins, when rank 1 fails first.
    lines = sorted(set(done.stdout.splitlines()) - {"[rank0]: attempt 0 0 2"})
    assert lines == ["[rank0]: attempt 1 1 2", "[rank1]: attempt 0 0 2", "[rank1]: attempt 1 1 2"], done.stdout
    assert len(done.stdout.splitlines()) in (3, 4), done.stdout
    assert done.stderr.count(", starting rank 1 again") + done.stderr.count("; starting every rank again") == 1
    assert "fanrun: attempt 1 of 3 failed (" in done.stderr, done.stderr
    # Every restart spent: the last attempt's failure is the run's.
    done = run(["run", "-n", "2", "--max_restarts=1", "flaky.py", "5"], cwd=tmp_path)
    assert done.returncode == 3, done.stderr
    assert done.stdout.count("[rank1]: attempt") == 2 and "attempt 1 of 2 failed" in done.stderr
    # No restart asked for: the first failure is the run's, as torchrun's default.
    done = run(["run", "-n", "2", "--max-restarts", "0", "flaky.py", "1"], cwd=tmp_path)
    assert done.returncode == 3, done.stderr
    assert sorted(done.stdout.splitlines()) == ["[rank0]: attempt 0 0 0", "[rank1]: attempt 0 0 0"]
    assert "starting every rank again" not in done.stderr and "called sys.exit(3)" in done.stderr


GATED = """
import os, sys, time
from pathlib import Path

while not Path(sys.argv[1]).exists():  # until the test has seen `fanrun run --detach` return
    time.sleep(0.02)
print("rank", os.environ["RANK"], "of", os.environ["WORLD_SIZE"], flush=True)
if len(sys.argv) > 2 and os.environ["RANK"] == "1":
    raise ValueError(sys.argv[2])
"""


def runner_pid(run_id: str) -> int:
    from fanrun._launch import records

    return records.RunRecord.find(run_id).read_runner()["pid"]


def test_run_detach_goes_on_by_itself_and_attach_logs_and_list_show_it(tmp_path):
    (tmp_path / "gated.py").write_text(GATED)
    gate = tmp_path / "gate"
    done = run(["run", "-n", "2", "--detach", "gated.py", str(gate)], cwd=tmp_path)
    # The ranks wait for the gate: the command has returned while the run goes on.
    assert done.returncode == 0, done.stderr
    run_id = done.stdout.strip()
    assert done.stdout == run_id + "\n" and run_id.startswith("gated.py-"), done.stdout
    listed = [line.split()[:2] for line in run(["list"]).stdout.splitlines()]
    assert [run_id, "RUNNING"] in listed or [run_id, "QUEUED"] in listed, listed
    gate.touch()
    attached = run(["attach", run_id])
    assert attached.returncode == 0, attached.stderr
    assert sorted(line for line in attached.stdout.splitlines() if line.startswith("[rank")) == [
        "[rank0]: rank 0 of 2", "[rank1]: rank 1 of 2"]
    assert f"fanrun: run {run_id} FINISHED" in attached.stderr
    logs = run(["logs", run_id])
    assert "[rank1]: rank 1 of 2" in logs.stdout
    assert run(["logs", run_id, "--rank", "1"]).stdout == "rank 1 of 2\n"
    listed = run(["list", "--all"])
    assert [run_id, "FINISHED"] in [line.split()[:2] for line in listed.stdout.splitlines()], listed.stdout
    assert wait_gone([runner_pid(run_id)], timeout=10) == []


def test_run_detach_watch_follows_a_failing_run_to_its_reason(tmp_path):
    (tmp_path / "gated.py").write_text(GATED)
    (tmp_path / "gate").touch()
    done = run(["run", "-n", "2", "--detach", "--watch", "--max-restarts", "1", "gated.py", "gate", "rank one gave up"],
               cwd=tmp_path)
    assert done.returncode == 1, done.stderr
    run_id = done.stdout.splitlines()[0]
    assert "[rank0]: rank 0 of 2" in done.stdout
    # Its restart went on in the run's own process, and said so there.
    assert "attempt 1 of 2 failed (ValueError: [rank 1] rank one gave up)" in done.stdout + done.stderr
    reason = "FAILED: ValueError: [rank 1] rank one gave up"
    assert f"fanrun: run {run_id} {reason}" in done.stderr, done.stderr
    attached = run(["attach", run_id])
    assert attached.returncode == 1 and f"fanrun: run {run_id} {reason}" in attached.stderr, attached.stderr
    listed = run(["list", "--all"])
    assert [run_id, "FAILED"] in [line.split()[:2] for line in listed.stdout.splitlines()], listed.stdout
    assert wait_gone([runner_pid(run_id)], timeout=10) == []


def test_ctrl_c_stops_watching_a_detached_run_which_goes_on(tmp_path):
    (tmp_path / "gated.py").write_text(GATED)
    gate = tmp_path / "gate"
    watching = subprocess.Popen(FANRUN + ["run", "-n", "2", "--detach", "--watch", "gated.py", str(gate)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    try:
        run_id = watching.stdout.readline().strip()
        assert run_id, watching.stderr.read()
        watching.send_signal(signal.SIGINT)
        out, err = watching.communicate(timeout=60)
    finally:
        watching.kill()
        watching.wait()
    assert watching.returncode == 130, err
    assert f"fanrun: stopped watching; run {run_id} goes on" in err
    listed = [line.split()[:2] for line in run(["list"]).stdout.splitlines()]
    assert [run_id, "RUNNING"] in listed or [run_id, "QUEUED"] in listed, listed
    gate.touch()
    attached = run(["attach", run_id])
    assert attached.returncode == 0 and f"fanrun: run {run_id} FINISHED" in attached.stderr, attached.stderr
    assert "[rank1]: rank 1 of 2" in attached.stdout
    assert wait_gone([runner_pid(run_id)], timeout=10) == []


SAYS = "import os\nprint('said by rank', os.environ['RANK'], flush=True)\n"


def test_display_quiet_shows_no_rank_line_and_the_logs_keep_them(tmp_path, runs_dir):
    (tmp_path / "quiet_ranks.py").write_text(SAYS)
    before = set(os.listdir(runs_dir))
    done = run(["run", "-n", "2", "--display", "quiet", "quiet_ranks.py"], cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "" and "said by rank" not in done.stderr, (done.stdout, done.stderr)
    [made] = [name for name in set(os.listdir(runs_dir)) - before if "-quiet_ranks.py-" in name]
    for rank in (0, 1):
        assert (runs_dir / made / f"rank_{rank}.log").read_text() == f"said by rank {rank}\n"


def test_display_logs_labels_every_line_whatever_fanrun_display_says(tmp_path):
    (tmp_path / "says.py").write_text(SAYS)
    quiet_by_default = {**os.environ, "FANRUN_DISPLAY": "quiet"}
    for flags in (["--display", "logs"],
                  # A panel cannot be redrawn in a pipe: there it is the labelled lines.
                  ["--display", "panel", "--stall-warning", "30"]):
        done = subprocess.run(FANRUN + ["run", "-n", "2", *flags, "says.py"], capture_output=True, text=True,
                              cwd=tmp_path, timeout=120, env=quiet_by_default)
        assert done.returncode == 0, (flags, done.stderr)
        assert sorted(done.stdout.splitlines()) == ["[rank0]: said by rank 0", "[rank1]: said by rank 1"], flags


def test_flags_that_go_together_badly_are_refused_before_anything_starts(tmp_path, runs_dir):
    from fanrun._launch import records

    (tmp_path / "says.py").write_text(SAYS)
    cases = {
        ("--watch",): "--watch follows a detached run; without --detach",
        ("--detach", "--display", "panel"): "--display panel redraws its rows in this terminal, which a detached run "
                                            "does not have",
        ("--stall-warning", "30"): "--stall-warning flags a quiet rank in the live panel, and this run shows none",
        ("--detach", "--stall-warning", "30"): "the live panel, which a detached run does not show",
        ("--display", "fancy"): "--display must be 'panel', 'logs', 'quiet' or none (the panel in a notebook, logs "
                                "elsewhere), not 'fancy'",
        ("--display", "panel", "--stall-warning", "soon"): "--stall-warning must be a positive number of seconds, or "
                                                           "none to never flag a quiet rank, not 'soon'",
        ("--display", "panel", "--stall-warning", "-5"): "--stall-warning must be a positive number of seconds",
        ("--experiment-name", " "): "--experiment-name must be a name, not ' '",
        # The tests' environment has FANRUN_TRACKING=0 (conftest.py).
        ("--tracking",): "--tracking asks for an MLflow run, but FANRUN_TRACKING turns tracking off",
        ("--detach", "--run-name", "first"): "--run-name asks for an MLflow run, but FANRUN_TRACKING turns",
    }
    records_before = [record.id for record in records.all_records()]  # makes the records' directory, where missing
    before = set(os.listdir(runs_dir))
    for flags, expected in cases.items():
        done = run(["run", "-n", "2", *flags, "says.py"], cwd=tmp_path)
        assert done.returncode == 1 and expected in done.stderr, (flags, done.stderr)
        assert done.stdout == "", flags
    assert set(os.listdir(runs_dir)) == before and [record.id for record in records.all_records()] == records_before
    # A panel's stall warning of none: never flagged, and accepted.
    done = run(["run", "-n", "2", "--display", "panel", "--stall-warning", "none", "says.py"], cwd=tmp_path)
    assert done.returncode == 0, done.stderr
