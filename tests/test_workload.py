"""Workload files of `fanrun submit` (_detached/workload.py): a `command:` string is a bash script, a
list is an argv; a launcher is refused; every bad value, YAML bomb or bad byte is a one-line error
that names the file and the line, before anything starts."""

from __future__ import annotations

import resource
import shlex
import subprocess
import sys

import pytest

import fanrun
from fanrun._launch import records
from processes import wait_gone


def submit(folder, text, *args, data: bytes | None = None, timeout=120):
    """`fanrun submit workload.yaml ARGS` in `folder`, as a user types it; at most 1 GiB of memory."""
    (folder / "workload.yaml").write_bytes(data if data is not None else text.encode())

    def limit_memory() -> None:  # a YAML bomb must fail the test, not the machine
        resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))

    return subprocess.run([sys.executable, "-m", "fanrun", "submit", "workload.yaml", *args], capture_output=True,
                          text=True, timeout=timeout, cwd=folder, preexec_fn=limit_memory)


def watched(folder, text):
    """The run of the workload, followed to its end: (its status, the submit's stderr)."""
    done = submit(folder, text, "--watch")
    run = fanrun.Run(done.stdout.splitlines()[0])
    status = run.wait()
    assert wait_gone([records.RunRecord.find(run.id).read_runner()["pid"]], timeout=30) == []
    return status, done.stderr


def test_a_command_is_a_bash_script_whose_every_line_runs(tmp_path):
    status, stderr = watched(tmp_path, "command: |\n  echo first-$RANK >> lines.txt\n"
                                       "  python -c 'import os; print(\"second-\" + os.environ[\"RANK\"])' >> lines.txt\n"
                                       "  python -c 'import sys; print(sys.executable)' > python.txt\n"
                                       "compute: {num_accelerators: 2}\n")
    assert status == "FINISHED", stderr
    assert sorted((tmp_path / "lines.txt").read_text().split()) == ["first-0", "first-1", "second-0", "second-1"]
    # `python` there is fanrun's own interpreter, as the script and function fields run it.
    assert (tmp_path / "python.txt").read_text().strip() == sys.executable


@pytest.mark.parametrize("script", ["true\n  exit 3\n  touch after.txt\n", "true\n  false | true\n  touch after.txt\n"])
def test_a_failing_line_or_pipe_fails_the_run_and_stops_the_script(tmp_path, script):
    status, stderr = watched(tmp_path, f"command: |\n  {script}compute: {{num_accelerators: 1}}\n")
    assert status == "FAILED", stderr
    assert not (tmp_path / "after.txt").exists()


def test_dry_run_shows_the_command_exactly_as_it_runs(tmp_path):
    script = "echo 'a b' > out.txt\nfalse"
    done = submit(tmp_path, "command: |\n  echo 'a b' > out.txt\n  false\ncompute: {num_accelerators: 1}\n", "--dry-run")
    assert done.returncode == 0, done.stderr
    shown = done.stdout.split("would run ", 1)[1].split(" on 1 CPU process", 1)[0]
    assert shlex.split(shown) == ["bash", "-e", "-o", "pipefail", "-c", script + "\n"]


def test_a_command_list_is_an_argv_exactly(tmp_path):
    status, stderr = watched(tmp_path, "command: [python, -c, \"import sys; open('argv.txt', 'w').write(repr(sys.argv[1:]))\","
                                       " 'a b', '$HOME', '>/dev/null']\ncompute: {num_accelerators: 1}\n")
    assert status == "FINISHED", stderr
    assert (tmp_path / "argv.txt").read_text() == repr(["a b", "$HOME", ">/dev/null"])


@pytest.mark.parametrize(("command", "line", "instead"), [
    ("torchrun --nproc_per_node 2 job.py --steps 3", 1, "command: python job.py --steps 3"),
    ("[torchrun, --nproc-per-node=2, --standalone, -m, job, --steps, '3']", 1, "command: python -m job --steps 3"),
    ("python -m torch.distributed.run --nproc_per_node=2 job.py", 1, "command: python job.py"),
    ("|\n  pip --version\n  OMP_NUM_THREADS=2 exec torchrun --nproc_per_node 2 job.py", 1,
     "its line 2 runs torchrun: torchrun starts its own ranks"),
    ("accelerate launch --num_processes 2 job.py", 1, "write the script's own command"),
    ("\"cd . && deepspeed job.py\"", 1, "its line 1 runs deepspeed: deepspeed starts its own ranks"),
    ("deepspeed --num_gpus 2 job.py", 1, "write the script's own command"),
])
def test_a_launcher_command_is_refused_with_what_to_write_instead(tmp_path, command, line, instead):
    before = {record.id for record in records.all_records()}
    done = submit(tmp_path, f"command: {command}\ncompute: {{num_accelerators: 2}}\n")
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith(f"fanrun: workload.yaml:{line}: command: ") and instead in done.stderr, done.stderr
    assert "starts its own ranks" in done.stderr
    assert {record.id for record in records.all_records()} == before


WORLD = """\
import os
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
total = torch.ones(1)
dist.all_reduce(total)
with open(f"world_{os.environ['RANK']}.txt", "w") as out:
    out.write(f"{dist.get_world_size()} {int(total.item())}")
dist.destroy_process_group()
"""


def test_the_command_a_launcher_refusal_suggests_runs_one_world_of_the_workloads_ranks(tmp_path):
    (tmp_path / "job.py").write_text(WORLD)
    refused = submit(tmp_path, "command: torchrun --nproc_per_node 2 job.py\ncompute: {num_accelerators: 2}\n")
    suggested = refused.stderr.split("`command: ", 1)[1].split("`", 1)[0]
    status, stderr = watched(tmp_path, f"command: {suggested}\ncompute: {{num_accelerators: 2}}\n")
    assert status == "FINISHED", stderr
    # One world of two ranks, not two worlds of two: each rank saw both in its all_reduce.
    assert sorted(path.name for path in tmp_path.glob("world_*.txt")) == ["world_0.txt", "world_1.txt"]
    assert {path.read_text() for path in tmp_path.glob("world_*.txt")} == {"2 2"}


BILLION_LAUGHS = """\
a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]
b: &b [*a,*a,*a,*a,*a,*a,*a,*a,*a]
c: &c [*b,*b,*b,*b,*b,*b,*b,*b,*b]
d: &d [*c,*c,*c,*c,*c,*c,*c,*c,*c]
e: &e [*d,*d,*d,*d,*d,*d,*d,*d,*d]
f: &f [*e,*e,*e,*e,*e,*e,*e,*e,*e]
g: &g [*f,*f,*f,*f,*f,*f,*f,*f,*f]
h: &h [*g,*g,*g,*g,*g,*g,*g,*g,*g]
command: echo [*h,*h,*h,*h,*h,*h,*h,*h,*h]
"""


@pytest.mark.parametrize(("text", "data", "message"), [
    # Every line of the error is the one line: file, line, field, problem.
    (BILLION_LAUGHS, None, "workload.yaml:2: aliases (*a) are not accepted in a workload file"),
    ("command: echo hi\nargs: &loop [*loop]\n", None, "workload.yaml:2: aliases (*loop) are not accepted"),
    ("command: echo hi\n1: one\n", None, "workload.yaml:2: 1: a key must be a string"),
    ("command: echo hi\nenv_variables:\n  7: seven\n", None, "workload.yaml:3: env_variables.7: a key must be a string"),
    ("command: echo hi\ncommand: echo again\n", None, "workload.yaml:2: command: given twice"),
    (None, b"command: echo hi\nexperiment_name: caf\xc3\xa9\nmlflow_run_name: bad \xff\n",
     "workload.yaml:3: not UTF-8 text (byte 0xff)"),
    ("command: echo hi\nargs: [unclosed\n", None, "workload.yaml:3: not valid YAML: "),
    ("command: echo hi\ntimeout_minutes: .inf\n", None,
     "workload.yaml:2: timeout_minutes: must be a finite number of minutes above 0, at most 525600; "
     "leave it out for no timeout, not inf"),
    ("command: echo hi\ntimeout_minutes: .nan\n", None, "workload.yaml:2: timeout_minutes: must be a finite number"),
    ("command: echo hi\nmax_retries: 1.5\n", None, "workload.yaml:2: max_retries: must be a whole number"),
    ("command: echo hi\nexperiment_name: [a]\n", None, "workload.yaml:2: experiment_name: must be a non-empty string"),
    ("command: [python, 3]\n", None, "workload.yaml:1: command[1]: must be a string, not 3"),
    ("command: []\n", None, "workload.yaml:1: command: is empty"),
    ("command: {a: b}\n", None, "workload.yaml:1: command: must be a shell command (a string) or an argv (a list"),
    ("command: \"echo 'unclosed\"\n", None, "workload.yaml:1: command: is not a bash script bash can run: "),
    ("command: \"echo a\\0b\"\n", None, "workload.yaml:1: command: holds a NUL character"),
    ("function: job:train\nkwargs: {1: 2}\n", None, "workload.yaml:2: kwargs.1: a key must be a string"),
    ("script: job.py\nargs: [ok, {a: b}]\n", None, "workload.yaml:2: args[1]: must be a string or a number"),
    ("script: \"job.py\\0\"\n", None, "workload.yaml:1: script: holds a NUL character"),
    ("function: broken:main\n", None, "workload.yaml:1: function: importing 'broken' raised ZeroDivisionError: division"),
    ("script: \"no\\nwhere.py\"\n", None, "workload.yaml:1: script: "),
    ("command: echo hi\nenv_variables:\n  A=B: x\n", None,
     "workload.yaml:3: env_variables.A=B: a variable's name cannot hold '='"),
    ("command: echo hi\nenv_variables:\n  A: \"x\\0y\"\n", None, "workload.yaml:3: env_variables.A: holds a NUL character"),
    ("command: echo hi\nenv_variables:\n  A: [x]\n", None, "workload.yaml:3: env_variables.A: must be a string or a number"),
    ("command: echo hi\nenv_variables:\n  A: 'ok'\n  B: true\n", None,
     "workload.yaml:4: env_variables.B: must be a string or a number, not True; write it in quotes"),
    ("command: echo hi\ncompute: {nodes: 2, backend: k8s}\n", None,
     "workload.yaml:2: compute.backend: must be one of ray, slurm, not 'k8s'"),
    ("command: echo hi\ncompute: {nodes: 2, slurm: {partition: gpu}}\n", None,
     "workload.yaml:2: compute.slurm: gives srun's options, and this workload does not run on Slurm"),
    ("command: echo hi\ncompute: {nodes: 2, backend: slurm, slurm: {ntasks: 3}}\n", None,
     "workload.yaml:2: compute.slurm: slurm={'ntasks': ...}: fanrun sets --ntasks itself"),
])
@pytest.mark.parametrize("dry_run", [True, False])
def test_a_bad_workload_is_a_one_line_error_naming_file_and_line(tmp_path, text, data, message, dry_run):
    (tmp_path / "job.py").write_text("def train():\n    return 1\n")
    (tmp_path / "broken.py").write_text("1 / 0\n")
    before = {record.id for record in records.all_records()}
    done = submit(tmp_path, text, *(["--dry-run"] if dry_run else []), data=data, timeout=60)
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith(f"fanrun: {message}") and done.stderr.count("\n") == 1, done.stderr
    assert {record.id for record in records.all_records()} == before


@pytest.mark.parametrize(("override", "message"), [
    ("args=[unclosed", "--override 'args=[unclosed': not valid YAML: "),
    ("args=&a [*a]", "--override 'args=&a [*a]': aliases (*a) are not accepted"),
    ("env_variables.A=B=c", None),  # the value is "B=c": fine
    ("env_variables.A=\"\\0\"", "--override env_variables.A: holds a NUL character"),
    ("timeout_minutes=.inf", "--override timeout_minutes: must be a finite number of minutes above 0"),
])
def test_a_bad_override_is_a_one_line_error(tmp_path, override, message):
    done = submit(tmp_path, "command: echo hi\ncompute: {num_accelerators: 1}\n", "--dry-run", "--override", override)
    if message is None:
        assert done.returncode == 0, done.stderr
        return
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith(f"fanrun: {message}") and done.stderr.count("\n") == 1, done.stderr
