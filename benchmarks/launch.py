"""Benchmark: launch wall time and failure latency of fanrun, mp.spawn, torchrun and notebook_launcher;
and what MLflow tracking, fanrun's default, adds to them."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import os
import platform
import resource
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from importlib import metadata
from pathlib import Path

# Only the standard library above: mp.spawn's children re-import this file, and
# anything heavy here would be charged to mp.spawn.

# "fanrun" is the launcher alone (tracking=False), which the peers are compared with; "tracked"
# is fanrun as users get it by default, every call an MLflow run (where mlflow is installed).
# The warm-up's tracked call starts the process's tracking agent, which the timed calls share,
# as a script's or a notebook's later calls do (benchmarks/tracking_cost.py times a first call).
# "warm" is fanrun untracked with warm=True: its ranks are the spares the call before left
# (backends/local/spares.py), each given the time to finish its imports, as between two notebook cells.
# "kept" is fanrun untracked with keep_alive=True: its ranks are the processes of the same
# function's call before, still alive.
FANRUN = ("fanrun", "tracked", "warm", "kept")
PEERS = ("mp.spawn", "torchrun", "notebook_launcher")
LAUNCHERS = (*FANRUN, *PEERS)
# The launchers fanrun must not be slower than; notebook_launcher is shown for reference.
GOAL_PEERS = ("mp.spawn", "torchrun")
# A warm call against notebook_launcher, which forks the caller: at most this many times its time,
# on GPUs and on CPU processes.
WARM_GOAL = {"gpu": 1.0, "cpu": 2.0}
# A call on kept ranks, on GPUs: at most this many seconds, and this many times notebook_launcher's.
KEPT_GOAL_S = 1.0
KEPT_GOAL_RATIO = 0.5
NOISE = 0.05  # a ratio up to 1 + NOISE still counts as "no slower"
FAILURE_GOAL_S = 0.5
# What tracking may add to a call: 5 % or this much, whichever is larger.
TRACKING_GOAL_S = 0.2
# What tracking may add to the failure latency: a failing call waits for nothing of MLflow.
TRACKING_FAILURE_GOAL_S = 0.05
# Long enough that only the launcher stopping them ends the ranks that did not fail.
SLEEP_S = 30.0
# A call still running after this long is hung: its processes are killed and it counts as an
# error, instead of stalling the whole run (notebook_launcher's forked ranks can deadlock).
CALL_TIMEOUT_S = 60.0
# How long processes may outlive their call (a launcher's own SIGTERM grace) before they
# count as left over.
LEFTOVER_WAIT_S = 10.0
# Every launcher can run 2 ranks (notebook_launcher runs 1 in the caller), so warm-up uses 2
# (1 where no more is measured: a machine with one GPU).
WARMUP_RANKS = 2
MARKER_VAR = "FANRUN_BENCH_MARKER"
INJECTED = "failure injected by the benchmark"

# torchrun runs a script file: this one loads the benchmark by path and calls one of its
# rank functions.
TORCHRUN_WORKER = """\
import importlib.util
import sys

spec = importlib.util.spec_from_file_location("fanrun_launch_benchmark", {path!r})
module = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = module  # dataclasses look their module up while the file runs
spec.loader.exec_module(module)
getattr(module, sys.argv[1])(sys.argv[2])
"""


# ---------------------------------------------------------------- what the ranks run


def allreduce(directory: str) -> tuple[float, str]:
    """One rank's work: join the group, all-reduce rank + 1, leave. The value is also
    saved to a file, because only fanrun hands return values back."""
    import torch
    import torch.distributed as dist

    world_size = int(os.environ["WORLD_SIZE"])
    use_nccl = torch.cuda.is_available() and torch.cuda.device_count() >= world_size
    if use_nccl:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    backend = "nccl" if use_nccl else "gloo"
    dist.init_process_group(backend)
    tensor = torch.tensor([dist.get_rank() + 1.0], device="cuda" if use_nccl else "cpu")
    dist.all_reduce(tensor)
    total = tensor.item()
    dist.destroy_process_group()
    Path(directory, f"rank{os.environ['RANK']}.json").write_text(json.dumps([total, backend]))
    return total, backend


def fail_or_sleep(directory: str) -> None:
    """The last rank raises once every rank is up, noting the time first; the others sleep."""
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    Path(directory, f"up{rank}").touch()
    if rank != world_size - 1:
        time.sleep(SLEEP_S)
        return
    # Waiting for the others makes the figure the time to stop running ranks, not starting ones.
    deadline = time.monotonic() + SLEEP_S
    while len(list(Path(directory).glob("up*"))) < world_size and time.monotonic() < deadline:
        time.sleep(0.01)
    Path(directory, "raised_at").write_text(repr(time.time()))
    raise RuntimeError(INJECTED)


def spawn_entry(index: int, fn: Callable[[str], object], directory: str) -> None:
    """mp.spawn passes only the process index: the rank sets its own RANK, as users' code must."""
    os.environ["RANK"] = os.environ["LOCAL_RANK"] = str(index)
    fn(directory)


# ---------------------------------------------------------------- the launchers, as users call them


class NotApplicable(Exception):
    """The launcher cannot run this case at all."""


class Hung(Exception):
    """The call did not end by itself within CALL_TIMEOUT_S."""


def run_fanrun(n: int, fn: Callable[[str], object], directory: str, *, tracking: bool = True, warm: bool = False) -> list:
    from fanrun import distributed

    return distributed(num_accelerators=n, tracking=tracking, warm=warm)(fn).distributed(directory)


_KEPT: dict[tuple[int, str], object] = {}


def run_fanrun_kept(n: int, fn: Callable[[str], object], directory: str) -> list:
    """One function per N and rank function, as a notebook calls the same function again."""
    from fanrun import distributed

    if (n, fn.__name__) not in _KEPT:
        _KEPT[n, fn.__name__] = distributed(num_accelerators=n, tracking=False, keep_alive=True)(fn)
    return _KEPT[n, fn.__name__].distributed(directory)


def run_spawn(n: int, fn: Callable[[str], object], directory: str) -> None:
    import torch.multiprocessing as mp

    with environment(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE=str(n)):
        mp.spawn(spawn_entry, args=(fn, directory), nprocs=n)


def run_torchrun(n: int, fn: Callable[[str], object], directory: str, *, worker: Path) -> None:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}"]
    subprocess.run([*command, str(worker), fn.__name__, directory], check=True)


def run_notebook_launcher(n: int, fn: Callable[[str], object], directory: str) -> None:
    if n == 1:
        raise NotApplicable(
            "with num_processes=1 it calls the function in the caller's own process: nothing is launched"
        )
    try:
        from accelerate import notebook_launcher
    except ImportError as error:
        raise NotApplicable(f"accelerate is not installed ({error})") from None
    notebook_launcher(fn, (directory,), num_processes=n, use_port=str(free_port()))


@contextlib.contextmanager
def environment(**values: str) -> Iterator[None]:
    saved = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# ---------------------------------------------------------------- one measurement


def measure_launch(launch: Callable, n: int, directory: str) -> tuple[float, set[str]]:
    """Seconds for one call; the ranks' sums are checked after the clock stops."""
    start = time.perf_counter()
    returned = launch(n, allreduce, directory)
    elapsed = time.perf_counter() - start
    values = returned if returned is not None else read_results(directory, n)
    return elapsed, check_sums(values, n)


def read_results(directory: str, n: int) -> list[tuple[float, str]]:
    try:
        return [tuple(json.loads(Path(directory, f"rank{rank}.json").read_text())) for rank in range(n)]
    except FileNotFoundError as error:
        raise RuntimeError(f"a rank saved no result: {error.filename}") from None


def check_sums(values: list, n: int) -> set[str]:
    """The backends the ranks used, once every rank's sum is right."""
    expected = n * (n + 1) / 2
    totals = [total for total, _ in values]
    if len(totals) != n or any(total != expected for total in totals):
        raise RuntimeError(f"wrong all-reduce result: {totals}, expected {n} x {expected:g}")
    return {backend for _, backend in values}


def measure_failure(launch: Callable, n: int, directory: str) -> tuple[float, set[str]]:
    """Seconds from the raise in the last rank to the caller catching the launcher's error."""
    try:
        launch(n, fail_or_sleep, directory)
    except Exception as error:
        caught = time.time()
        # fanrun promises the rank's own exception; the peers wrap it in theirs.
        if getattr(launch, "func", launch) is run_fanrun and not (type(error) is RuntimeError and INJECTED in str(error)):
            got = f"{type(error).__name__}: {error}"
            raise RuntimeError(f"expected the rank's RuntimeError, got {got}") from error
    else:
        raise RuntimeError("the call returned although a rank raised")
    return caught - float(Path(directory, "raised_at").read_text()), set()


# ---------------------------------------------------------------- processes a measurement leaves


def started_processes(marker: bytes) -> dict[int, str]:
    """Live processes this benchmark started, directly or not: pid -> command line. A process
    counts when its environment has the marker (every launcher passes the caller's environment
    on, orphans included) or when it descends from this one (forked children keep the
    environment this process started with, which lacks the marker)."""
    parents, marked, commands = {}, set(), {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(entry.path, "stat").read_text()
            env = Path(entry.path, "environ").read_bytes()
            command = Path(entry.path, "cmdline").read_bytes()
        except OSError:  # gone meanwhile, or another user's
            continue
        state, ppid = stat.rsplit(")", 1)[1].split()[:2]
        if state == "Z":  # exited, merely not reaped yet
            continue
        pid = int(entry.name)
        parents[pid] = int(ppid)
        commands[pid] = command.replace(b"\0", b" ").decode(errors="replace").strip()
        if marker in env.split(b"\0"):
            marked.add(pid)
    me = os.getpid()
    started = {pid for pid in parents if pid in marked or descends(pid, me, parents)}
    return {pid: commands[pid] for pid in started - {me}}


def lasting_processes() -> set[int]:
    """Processes that live as long as this one by design, not leftovers of a measurement: fanrun's
    tracking agent, started by the first tracked call and serving every later one; the spare
    ranks a warm call leaves for the next one and the ranks a kept call keeps, with their keepers;
    and the zygote the spares are forked from."""
    lasting = set()
    agent_connection = sys.modules.get("fanrun._tracking.agent_connection")
    pid = agent_connection.agent_pid() if agent_connection is not None else None
    if pid is not None:
        lasting.add(pid)
    for spare in spare_pids():
        lasting.add(spare)
        with contextlib.suppress(OSError, IndexError, ValueError):
            lasting.add(int(Path(f"/proc/{spare}/stat").read_text().rsplit(")", 1)[1].split()[1]))
    spares = sys.modules.get("fanrun.backends.local.spares")
    zygote = spares.POOL.zygote_pid() if spares is not None else None
    if zygote is not None:
        lasting.add(zygote)
    return lasting


def spare_pids() -> list[int]:
    spares = sys.modules.get("fanrun.backends.local.spares")
    return spares.POOL.pids() + spares.kept_pids() if spares is not None else []


def wait_for_spares(limit_s: float = 120.0) -> None:
    """Until the spares a warm call left have done their imports, as they have between two
    notebook cells; what they cost the machine is then not charged to the next measurement."""
    spares = sys.modules.get("fanrun.backends.local.spares")
    if spares is not None:
        spares.POOL.wait_ready(limit_s)


def descends(pid: int, ancestor: int, parents: dict[int, int]) -> bool:
    while pid in parents:
        pid = parents[pid]
        if pid == ancestor:
            return True
    return False


def kill(pids: set[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


# ---------------------------------------------------------------- the session


@dataclasses.dataclass
class Cell:
    """The samples of one launcher at one N, or why there are none."""

    samples: list[float] = dataclasses.field(default_factory=list)
    problem: str | None = None  # "n/a: <reason>" or "error: <type>: <message>"
    backends: set[str] = dataclasses.field(default_factory=set)

    @property
    def median(self) -> float | None:
        return statistics.median(self.samples) if self.samples and not self.problem else None


class Session:
    """Runs measurements one at a time, with launcher output in a log and nothing left behind."""

    def __init__(self, workdir: Path, log_path: Path, peers: list[str]) -> None:
        self.workdir = workdir
        self.log_path = log_path
        self.notes: list[str] = []
        token = uuid.uuid4().hex
        self.marker = f"{MARKER_VAR}={token}".encode()
        # Set before any launcher starts, so that every process they start inherits it.
        os.environ[MARKER_VAR] = token
        # fanrun tracks each call in MLflow where mlflow is installed, by default in its own store
        # under $XDG_DATA_HOME: the same default, in the temporary directory, keeps that cost in
        # the figures and the runs out of the user's store. Tracking is on or off per launcher.
        for name in ("MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME", "MLFLOW_EXPERIMENT_ID", "MLFLOW_RUN_ID", "FANRUN_TRACKING"):
            os.environ.pop(name, None)
        os.environ["XDG_DATA_HOME"] = str(workdir / "data")
        # mp.spawn starts multiprocessing's resource tracker, which lives as long as this
        # process by design; starting it now keeps it out of the leftovers.
        from multiprocessing import resource_tracker

        resource_tracker.ensure_running()
        self.baseline = set(started_processes(self.marker))
        worker = workdir / "torchrun_worker.py"
        worker.write_text(TORCHRUN_WORKER.format(path=str(Path(__file__).resolve())))
        self.launchers = {
            "fanrun": functools.partial(run_fanrun, tracking=False),
            "tracked": run_fanrun,
            "warm": functools.partial(run_fanrun, tracking=False, warm=True),
            "kept": run_fanrun_kept,
            "mp.spawn": run_spawn,
            "torchrun": functools.partial(run_torchrun, worker=worker),
            "notebook_launcher": run_notebook_launcher,
        }
        self.launchers = {name: run for name, run in self.launchers.items() if name in FANRUN or name in peers}

    def attempt(self, label: str, measure: Callable[[str], object]) -> object:
        """Runs one measurement in a fresh directory; returns its value or the exception."""
        directory = tempfile.mkdtemp(dir=self.workdir)
        # Each measurement starts from the same environment: launchers leave variables behind
        # (notebook_launcher's TORCHELASTIC_SIGNALS_TO_HANDLE; TORCHINDUCTOR_CACHE_DIR after a
        # hang), which would make the next warm call replace its spares.
        environment_before = dict(os.environ)
        # Killing a hung call's processes makes every launcher return, with an error.
        hung = threading.Event()
        watchdog = threading.Timer(CALL_TIMEOUT_S, self.kill_hung, args=(hung,))
        watchdog.start()
        try:
            with self.output_to_log(label):
                outcome = measure(directory)
        except Exception as error:
            outcome = error
        finally:
            watchdog.cancel()
            watchdog.join()
            self.clear_leftovers(label)
            os.environ.clear()
            os.environ.update(environment_before)
            wait_for_spares()
        if hung.is_set():
            return Hung(f"no result after {CALL_TIMEOUT_S:g} s; its processes were killed")
        return outcome

    def kill_hung(self, hung: threading.Event) -> None:
        hung.set()
        kill(self.leftovers())

    def leftovers(self) -> set[int]:
        return set(started_processes(self.marker)) - self.baseline - lasting_processes()

    @contextlib.contextmanager
    def output_to_log(self, label: str) -> Iterator[None]:
        """Launchers and ranks print a lot (tracebacks above all); it goes to the log, at the
        level of file descriptors so that child processes' output goes there too."""
        sys.stdout.flush()
        sys.stderr.flush()
        saved = os.dup(1), os.dup(2)
        with open(self.log_path, "a") as log:
            log.write(f"\n===== {label}\n")
            log.flush()
            os.dup2(log.fileno(), 1)
            os.dup2(log.fileno(), 2)
            try:
                yield
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os.dup2(saved[0], 1)
                os.dup2(saved[1], 2)
                os.close(saved[0])
                os.close(saved[1])

    def clear_leftovers(self, label: str) -> None:
        """Waits for the measurement's processes to end; kills and reports any that do not."""
        # Telling the pool's processes from leftovers waits for a fill still under way (a zygote
        # importing, after a warm call): that wait is not a leftover's.
        spare_pids()
        returned = time.monotonic()
        left = self.wait_for_exit()
        if not left:
            outlived = time.monotonic() - returned
            if outlived > 0.5:
                self.notes.append(f"{label}: its processes outlived the call by {outlived:.1f} s")
            return
        commands = started_processes(self.marker)
        described = "; ".join(f"pid {pid}: {commands.get(pid, '?')[:120]}" for pid in sorted(left))
        self.notes.append(
            f"{label}: {len(left)} process(es) still running {LEFTOVER_WAIT_S:g} s after the call, "
            f"killed: {described}"
        )
        kill(left)
        self.wait_for_exit()

    def wait_for_exit(self) -> set[int]:
        """The processes still running after at most LEFTOVER_WAIT_S."""
        deadline = time.monotonic() + LEFTOVER_WAIT_S
        left = self.leftovers()
        while left and time.monotonic() < deadline:
            time.sleep(0.05)
            left = self.leftovers()
        return left


# ---------------------------------------------------------------- the schedule


def warm_up(session: Session, ranks: int) -> None:
    """One untimed call per launcher, so that the first timed one finds the page cache and
    the .pyc files warm, and the caller's own imports done."""
    for name, launch in session.launchers.items():
        label = f"warm-up {name} N={ranks}"
        outcome = session.attempt(label, functools.partial(measure_launch, launch, ranks))
        progress(f"{label}: {'failed' if isinstance(outcome, Exception) else 'done'}")


def measure_all(session: Session, kind: str, measure: Callable, ranks: list[int], repeat: int) -> dict:
    """`repeat` rounds for each N. The launchers take turns within a round, so that drift in
    the machine's load spreads over all of them instead of landing on one."""
    cells = {(n, name): Cell() for n in ranks for name in LAUNCHERS}
    for (n, name), cell in cells.items():
        if name not in session.launchers:
            cell.problem = "n/a: left out by --peers"
    for n in ranks:
        for name in ("warm", "kept") if kind == "launch" else ():
            # Spares are started for as many ranks as the call before had, and ranks are kept by
            # the function at this N: the first such call at a new N starts its ranks, as a
            # process's first call does.
            label = f"warm-up {name} N={n}"
            outcome = session.attempt(label, functools.partial(measure, session.launchers[name], n))
            progress(f"{label}: {'failed' if isinstance(outcome, Exception) else 'done'}")
        for index in range(repeat):
            for name, launch in session.launchers.items():
                cell = cells[n, name]
                if cell.problem:
                    continue  # errors repeat; retrying only costs time
                label = f"{kind} {name} N={n} #{index + 1}"
                record(cell, session.attempt(label, functools.partial(measure, launch, n)), label)
    return cells


def record(cell: Cell, outcome: object, label: str) -> None:
    if isinstance(outcome, NotApplicable):
        cell.problem = f"n/a: {outcome}"
    elif isinstance(outcome, Exception):
        message = str(outcome).strip().splitlines()
        cell.problem = f"error: {type(outcome).__name__}: {message[0][:300] if message else ''}"
    else:
        seconds, backends = outcome
        cell.samples.append(seconds)
        cell.backends |= backends
    progress(f"{label}: {cell.problem or f'{cell.samples[-1]:.3f} s'}")


def progress(text: str) -> None:
    """To stderr: stdout holds the report alone."""
    print(text, file=sys.stderr, flush=True)


# ---------------------------------------------------------------- the report


def machine() -> dict[str, str]:
    return {
        "cpu": cpu_model(),
        "cores": f"{os.cpu_count()} ({len(os.sched_getaffinity(0))} usable by this process)",
        "os": platform.platform(),
        "python": platform.python_version(),
        "torch": package_version("torch"),
        "accelerate": package_version("accelerate"),
        "fanrun": package_version("fanrun"),
        "mlflow": package_version("mlflow"),
        "gpus": gpu_names(),
    }


def machine_busy_s() -> float:
    """CPU seconds every process on the machine has used since boot, from /proc/stat."""
    ticks = [int(value) for value in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    user, nice, system, _idle, _iowait, irq, softirq = ticks[:7]
    return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")


def own_busy_s() -> float:
    """CPU seconds of this process and of the processes it has waited for (every rank and
    launcher, since each launcher waits for what it starts)."""
    usages = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return sum(usage.ru_utime + usage.ru_stime for usage in usages)


def other_work(machine_start: float, own_start: float, seconds: float) -> str:
    """Other work on the machine slows every figure down; this says how much there was."""
    other = max(0.0, machine_busy_s() - machine_start - (own_busy_s() - own_start))
    share = other / (seconds * (os.cpu_count() or 1))
    return f"{other:.0f} CPU seconds used by other processes during the run ({share:.0%} of the machine)"


def cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def package_version(name: str) -> str:
    """The installed version; mlflow may be installed as mlflow-skinny."""
    for distribution in (name, f"{name}-skinny") if name == "mlflow" else (name,):
        try:
            return metadata.version(distribution)
        except metadata.PackageNotFoundError:
            continue
    return "not installed"


def gpu_names() -> str:
    """From nvidia-smi, not torch.cuda: CUDA started in this process would break the fork
    that notebook_launcher relies on."""
    query = ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"]
    try:
        listed = subprocess.run(query, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return "none"
    names = [line.strip() for line in listed.stdout.splitlines() if line.strip()]
    return ", ".join(f"{names.count(name)} x {name}" for name in dict.fromkeys(names)) or "none"


def table(title: str, cells: dict[tuple[int, str], Cell], ranks: list[int]) -> str:
    # Only the launch measurement joins a process group, so only it has a backend to show.
    with_backend = any(cell.backends for cell in cells.values())
    header = ["N", *LAUNCHERS, *(f"fanrun/{peer}" for peer in PEERS), *(f"warm/{peer}" for peer in PEERS),
              *(f"kept/{peer}" for peer in PEERS), "tracked/fanrun",
              *(["backend"] if with_backend else [])]
    rows, footnotes = [], []
    for n in ranks:
        row = [str(n)]
        for name in LAUNCHERS:
            cell = cells[n, name]
            if cell.problem:
                footnotes.append(f"[{len(footnotes) + 1}] {name}, N={n}: {cell.problem}")
                short = "n/a" if cell.problem.startswith("n/a") else ": ".join(cell.problem.split(": ")[:2])
                row.append(f"{short} [{len(footnotes)}]")
            else:
                row.append(f"{cell.median:.3f} ({min(cell.samples):.3f})")
        row += [format_ratio(ratio(cells, n, peer)) for peer in PEERS]
        row += [format_ratio(ratio(cells, n, peer, mine="warm")) for peer in PEERS]
        row += [format_ratio(ratio(cells, n, peer, mine="kept")) for peer in PEERS]
        cost = tracking_cost(cells, n)
        row.append("-" if cost is None else f"{(cost[0] + cost[1]) / cost[1]:.2f}x" if cost[1] else "-")
        if with_backend:
            row.append(",".join(sorted(set().union(*(cells[n, name].backends for name in LAUNCHERS)))) or "-")
        rows.append(row)
    widths = [max(len(line[i]) for line in [header, *rows]) for i in range(len(header))]
    lines = [title, *("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in [header, *rows])]
    lines.insert(2, "  ".join("-" * w for w in widths))
    return "\n".join(lines + footnotes)


def ratio(cells: dict[tuple[int, str], Cell], n: int, peer: str, mine: str = "fanrun") -> float | None:
    mine, theirs = cells[n, mine].median, cells[n, peer].median
    return mine / theirs if mine is not None and theirs else None


def format_ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def goals(launch: dict, failure: dict, ranks: list[int], failure_ranks: list[int]) -> str:
    lines = [
        "Goals (rule: fanrun is no slower than a peer at N when median(fanrun) / median(peer) "
        f"<= {1 + NOISE:.2f}, i.e. 1.00 within {NOISE:.0%} noise):"
    ]
    for peer in GOAL_PEERS:
        ratios = {n: ratio(launch, n, peer) for n in ranks}
        goal = f"launch wall time no slower than {peer} for every N"
        lines.append(verdict(goal, ratios, lambda r: r <= 1 + NOISE, format_ratio))
    kind = "cpu" if gpu_names() == "none" else "gpu"
    ratios = {n: ratio(launch, n, "notebook_launcher", mine="warm") for n in ranks if n > 1}
    goal = f"warm launch wall time at most {WARM_GOAL[kind]:g}x notebook_launcher's on {kind.upper()}s for every N > 1"
    if ratios:
        lines.append(verdict(goal, ratios, lambda r: r <= WARM_GOAL[kind], format_ratio))
    else:
        lines.append(f"  fanrun {goal}: not measured (notebook_launcher runs N=1 in the caller itself)")
    if kind == "gpu":
        seconds = {n: launch[n, "kept"].median for n in ranks}
        goal = f"launch wall time on kept ranks (keep_alive=True) at most {KEPT_GOAL_S:g} s"
        lines.append(verdict(goal, seconds, lambda s: s <= KEPT_GOAL_S, lambda s: f"{s:.3f} s"))
        ratios = {n: ratio(launch, n, "notebook_launcher", mine="kept") for n in ranks if n > 1}
        goal = f"launch wall time on kept ranks at most {KEPT_GOAL_RATIO:g}x notebook_launcher's for every N > 1"
        if ratios:
            lines.append(verdict(goal, ratios, lambda r: r <= KEPT_GOAL_RATIO, format_ratio))
    latencies = {n: failure[n, "fanrun"].median for n in failure_ranks}
    goal = f"failure latency (median) under {FAILURE_GOAL_S} s"
    lines.append(verdict(goal, latencies, lambda s: s < FAILURE_GOAL_S, lambda s: f"{s:.3f} s"))
    costs = {n: tracking_cost(launch, n) for n in ranks}
    goal = f"launch wall time with tracking (the default) within {NOISE:.0%} or {TRACKING_GOAL_S} s of without, for every N"
    lines.append(verdict(goal, costs, lambda c: c[0] <= max(NOISE * c[1], TRACKING_GOAL_S), lambda c: f"{c[0]:+.3f} s"))
    costs = {n: tracking_cost(failure, n) for n in failure_ranks}
    goal = f"failure latency with tracking (the default) within {TRACKING_FAILURE_GOAL_S} s of without, for every N"
    lines.append(verdict(goal, costs, lambda c: c[0] <= TRACKING_FAILURE_GOAL_S, lambda c: f"{c[0]:+.3f} s"))
    return "\n".join(lines)


def tracking_cost(cells: dict[tuple[int, str], Cell], n: int) -> tuple[float, float] | None:
    """(seconds tracking added, seconds without it) at N, from the medians."""
    tracked, untracked = cells[n, "tracked"].median, cells[n, "fanrun"].median
    return None if tracked is None or untracked is None else (tracked - untracked, untracked)


def verdict(goal: str, values: dict[int, float | None], ok: Callable, show: Callable) -> str:
    shown = ", ".join(f"N={n}: {'missing' if v is None else show(v)}" for n, v in values.items())
    if any(v is None for v in values.values()):
        state = "UNKNOWN (a measurement is missing)"
    elif all(ok(v) for v in values.values()):
        state = "holds"
    else:
        state = "NOT MET"
    return f"  fanrun {goal}: {state} ({shown})"


def as_json(cells: dict[tuple[int, str], Cell]) -> list[dict]:
    return [
        {
            "n": n,
            "launcher": name,
            "samples": cell.samples,
            "median": cell.median,
            "problem": cell.problem,
            "backends": sorted(cell.backends),
        }
        for (n, name), cell in cells.items()
    ]


# ---------------------------------------------------------------- main


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4], help="N for the launch wall time")
    parser.add_argument("--failure-ranks", type=int, nargs="+", default=[2], help="N for the failure latency")
    parser.add_argument("--repeat", type=int, default=3, help="timed runs per launcher and N")
    parser.add_argument("--json", type=Path, help="also write every sample to this file")
    parser.add_argument("--peers", nargs="+", choices=PEERS, default=list(PEERS), help="the peers to measure (default: all)")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, one round: that every path still runs (its figures mean nothing)")
    args = parser.parse_args()
    if args.smoke:
        args.ranks, args.failure_ranks, args.repeat = [2], [2], 1
    if args.repeat < 1 or min(args.ranks + args.failure_ranks) < 1:
        parser.error("--repeat and every N must be at least 1")
    return args


def main() -> None:
    args = parse_args()
    info = machine()
    print("Machine", *(f"  {key:<11}{value}" for key, value in info.items()), sep="\n", flush=True)
    descriptor, log_name = tempfile.mkstemp(prefix="fanrun-launch-bench-", suffix=".log")
    os.close(descriptor)  # reopened for each measurement
    started, machine_start, own_start = time.monotonic(), machine_busy_s(), own_busy_s()
    with tempfile.TemporaryDirectory(prefix="fanrun-launch-bench-") as workdir:
        session = Session(Path(workdir), Path(log_name), args.peers)
        warm_up(session, min(WARMUP_RANKS, max(args.ranks)))
        launch = measure_all(session, "launch", measure_launch, args.ranks, args.repeat)
        failure = measure_all(session, "failure", measure_failure, args.failure_ranks, args.repeat)
        import fanrun

        fanrun.cooldown()  # the last warm call's spares, and the kept ranks
    print()
    print(table(f"Launch wall time in seconds, median (min) of {args.repeat}", launch, args.ranks))
    print()
    title = "Failure latency in seconds, from the raise in the last rank to the caller"
    print(table(f"{title}, median (min) of {args.repeat}", failure, args.failure_ranks))
    print()
    print(goals(launch, failure, args.ranks, args.failure_ranks))
    print()
    print("Leftover processes:", *(session.notes or ["none; every process ended with its call"]), sep="\n  ")
    seconds = time.monotonic() - started
    print(f"Total {seconds:.0f} s; {other_work(machine_start, own_start, seconds)}.")
    print(f"What the launchers and ranks printed: {log_name}")
    if args.json:
        report = {
            "machine": info,
            "repeat": args.repeat,
            "launch": as_json(launch),
            "failure": as_json(failure),
            "leftovers": session.notes,
        }
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
