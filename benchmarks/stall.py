"""Stalls: how soon fanrun names a planted hang, what watching for one costs a training loop, and
what torch alone does with the same hang, from one run on the same machine.

(a) Detection latency: from the moment a rank begins to hang (it notes time.time()) to the moment
    fanrun's verdict is shown (on_stall gets the report as it is printed), at the default stall
    timeout (the larger of 60 s and 10 step times) unless --stall-timeout says otherwise. The hangs:
    the last rank sleeps in its Dataset's __getitem__ (it is in DataLoader.__next__), and the last
    rank skips a collective and waits in a function of its own. With one rank: the slow Dataset,
    and on CUDA a hang between two streams (a side stream spins in torch.cuda._sleep, the main
    stream waits on its event, the step's all_reduce is queued behind it, then .item()).
(b) The cost of watching: the same DDP loop (gloo on CPUs, NCCL on CUDA) with on_stall=None (not
    watched: no progress record, no flight recorder) and with the default; rank 0's steps/s after
    a warm-up, alternating, median of --repeat.
(d) What watching adds to a step, apart from the step: one process (a gloo group of one) runs a
    DDP step of a tiny model with a DataLoader batch, an optimizer step and a Python all_reduce,
    with fanrun's progress record and torch's flight recorder on and off (separate processes,
    alternating); and what one ask for the flight recorder's collectives costs the rank, which a
    watched call of several ranks makes every few seconds.
(c) torch alone on the same hangs: fanrun with on_stall=None, so that only torch acts, and a
    process-group timeout of --torch-timeout seconds given to init_process_group: the time until
    torch's own error reaches the caller (--torch-timeout 0: none given, so torch waits its default,
    30 min for gloo, 10 min for NCCL's watchdog), what torch said, and whether its flight recorder
    left a dump (TORCH_NCCL_DEBUG_INFO_TEMP_FILE) at its default settings. Printed beside it: the
    timeouts torch waits by default. With one rank, only the CUDA streams' hang has a collective waiting.

    python benchmarks/stall.py [--ranks 2] [--device cpu|cuda] [--stall-timeout S] [--torch-timeout 20]
                               [--repeat 5] [--steps 300] [--parts latency cost overhead torch] [--smoke]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

# Goals: the verdict within this long after the stall timeout (the evidence's gathering), and
# watching costs at most this share of the steps/s.
LATENCY_GOAL_S = 5.0
COST_GOAL = 0.01
AT_STEP = 5  # the step at which the last rank hangs, once steps have been timed
PLANT_MARK = "planted"


class Stop(Exception):
    """Raised by on_stall once the planted hang's report has come: the call stops at once."""


class Reports:
    """on_stall: the first report once the hang is planted (in `marks`), and when it came. One
    before it (a quiet start-up longer than a short --stall-timeout) lets the call go on."""

    def __init__(self, marks: Path) -> None:
        self.marks = marks
        self.report = None
        self.at = 0.0

    def __call__(self, report) -> None:
        if not (self.marks / PLANT_MARK).exists():
            return
        self.report, self.at = report, time.time()
        raise Stop


def planted(case: str, marks: str, hang_s: float, device: str, pg_timeout_s: float | None, steps: int) -> None:
    """One rank of a short training loop (DDP, a DataLoader, the mean loss all-reduced and logged
    each step); the last rank hangs at AT_STEP as `case` says."""
    import datetime

    import torch
    import torch.distributed as dist

    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    on_gpu = device == "cuda"
    if on_gpu:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    timeout = {"timeout": datetime.timedelta(seconds=pg_timeout_s)} if pg_timeout_s else {}
    dist.init_process_group("nccl" if on_gpu else "gloo", **timeout)
    where = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if on_gpu else torch.device("cpu")
    hangs = case if rank == world_size - 1 else ""
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(64, 64).to(where),
                                                      device_ids=[where.index] if on_gpu else None)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = torch.utils.data.DataLoader(Samples(hangs == "data", marks, hang_s), batch_size=8)
    for step, batch in enumerate(loader):
        loss = model(batch.to(where)).square().mean()
        mean = loss.detach().clone()
        if step == AT_STEP and hangs == "skipped":
            mark(marks)
            wait_in_own_function(hang_s)  # then skips this step's all_reduce
        elif step == AT_STEP and hangs == "streams":
            mark(marks)
            streams_wait(hang_s, where)
            dist.all_reduce(mean)  # queued behind the wait: torch's NCCL watchdog times this one
        else:
            dist.all_reduce(mean)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        mean.item()  # logged: on CUDA, where the host waits for the step
        if step == steps:
            break
    dist.destroy_process_group()


class Samples:
    """Random inputs; the AT_STEP-th batch's first sample takes `hang_s` to come, where `slow`."""

    def __init__(self, slow: bool, marks: str, hang_s: float) -> None:
        self.slow, self.marks, self.hang_s = slow, marks, hang_s

    def __len__(self) -> int:
        return 1 << 20

    def __getitem__(self, index: int):
        import torch

        if self.slow and index == AT_STEP * 8:
            mark(self.marks)
            time.sleep(self.hang_s)
        return torch.randn(64)


def mark(marks: str) -> None:
    Path(marks, PLANT_MARK).write_text(repr(time.time()))


def wait_in_own_function(hang_s: float) -> None:
    import threading

    threading.Event().wait(hang_s)


def streams_wait(hang_s: float, where) -> None:
    """A side stream spins for `hang_s` and records an event, and the main stream waits on it: what
    the step queues after this waits too, and the host with it at the step's .item()."""
    import torch

    side, done = torch.cuda.Stream(where), torch.cuda.Event()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(10_000_000)  # the GPU's spin rate, in cycles per millisecond
    end.record()
    end.synchronize()
    cycles_per_ms = 10_000_000 / start.elapsed_time(end)
    with torch.cuda.stream(side):
        torch.cuda._sleep(int(hang_s * 1000 * cycles_per_ms))
        done.record(side)
    torch.cuda.current_stream(where).wait_event(done)


def cases_for(ranks: int, device: str) -> list[tuple[str, str]]:
    last = ranks - 1
    cases = [("data", f"rank {last} sleeps in its Dataset")]
    if ranks > 1:
        cases.append(("skipped", f"rank {last} skips a collective"))
    elif device == "cuda":
        cases.append(("streams", "rank 0 waits on a spinning side stream"))
    return cases


def decorator_arguments(ranks: int, device: str) -> dict:
    return {"num_accelerators": ranks, "accelerator_type": None if device == "cuda" else "CPU", "tracking": False,
            "display": "quiet"}


def planted_at(marks: Path) -> float | None:
    path = marks / PLANT_MARK
    return float(path.read_text()) if path.exists() else None


def detection(case: str, args, marks: Path) -> dict:
    """(a): the planted hang under fanrun's watch; the seconds from the hang to the verdict."""
    from fanrun import distributed

    reports = Reports(marks)
    # Long enough to be reported; a call that never reports it ends by the call's timeout.
    hang_s = (args.stall_timeout or 60.0) * 2 + 60
    function = distributed(**decorator_arguments(args.ranks, args.device), stall_timeout=args.stall_timeout,
                           on_stall=reports, timeout=hang_s + 120)(planted)
    try:
        function.distributed(case, str(marks), hang_s, args.device, None, AT_STEP + 10)
    except Stop:
        pass
    except Exception as error:
        return {"error": f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"}
    began = planted_at(marks)
    if reports.report is None or began is None:
        return {"error": "no report came"}
    report = reports.report
    return {"latency": reports.at - began, "threshold": report.threshold_s, "sentence": report.sentence,
            "cause": report.verdict.cause, "culprits": report.culprits}


def torch_alone(case: str, args, marks: Path) -> dict:
    """(c): the planted hang with fanrun not watching: the seconds until torch's error reaches the caller."""
    from fanrun import distributed

    hang_s = (args.torch_timeout or torch_default_timeout(args.device)) + 120
    function = distributed(**decorator_arguments(args.ranks, args.device), on_stall=None,
                           timeout=hang_s + 60)(planted)
    dumps_before = set(flight_recorder_dumps())
    try:
        function.distributed(case, str(marks), hang_s, args.device, args.torch_timeout or None, AT_STEP + 10)
    except Exception as error:
        began = planted_at(marks)
        lines = str(error).splitlines() or [""]
        # torch's own words where its watchdog spoke, else the error's first line
        said = next((line.strip() for line in lines if "Watchdog caught" in line or "Timed out" in line), lines[0])
        dumps = sorted(set(flight_recorder_dumps()) - dumps_before)
        return {"latency": time.time() - began if began else None, "error": f"{type(error).__name__}: {said[:240]}",
                "dump": ", ".join(f"{path} ({os.path.getsize(path)} bytes)" for path in dumps) or "none"}
    return {"latency": None, "error": "the call ended well: torch raised nothing", "dump": "none"}


def flight_recorder_dumps() -> list[str]:
    """The files torch's flight recorder dumps into on a watchdog's timeout, by its default prefix."""
    prefix = os.environ.get("TORCH_NCCL_DEBUG_INFO_TEMP_FILE") or os.environ.get("TORCH_FR_DUMP_TEMP_FILE") \
        or "/tmp/nccl_trace_rank_"
    folder = os.path.dirname(prefix) or "."
    return [os.path.join(folder, name) for name in os.listdir(folder) if name.startswith(os.path.basename(prefix))]


def steps_per_second(steps: int, warmup: int, device: str) -> float:
    """(b): rank 0's steps/s of a DDP loop fed by a DataLoader, the mean loss all-reduced each step."""
    import torch
    import torch.distributed as dist

    on_gpu = device == "cuda"
    if on_gpu:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if on_gpu else "gloo")
    where = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if on_gpu else torch.device("cpu")
    width, batch = (1024, 64) if on_gpu else (256, 32)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(width, 4 * width), torch.nn.GELU(), torch.nn.Linear(4 * width, width))
    model = torch.nn.parallel.DistributedDataParallel(model.to(where), device_ids=[where.index] if on_gpu else None)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    data = torch.utils.data.TensorDataset(torch.randn((steps + warmup) * batch, width))
    loader = torch.utils.data.DataLoader(data, batch_size=batch)
    started = 0.0
    for step, (inputs,) in enumerate(loader):
        if step == warmup:
            if on_gpu:
                torch.cuda.synchronize()
            dist.barrier()
            started = time.perf_counter()
        loss = model(inputs.to(where, non_blocking=True)).square().mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        mean = loss.detach()
        dist.all_reduce(mean)
    if on_gpu:
        torch.cuda.synchronize()
    rate = steps / (time.perf_counter() - started)
    dist.destroy_process_group()
    return rate


# (d): one process, one rank of a gloo group of one, a DDP step of a tiny model (a DataLoader batch,
# the backward's all-reduce, an optimizer step, a Python all_reduce), so that what fanrun's
# observation adds to each step stands out from the step itself; then the cost of one ask for the
# flight recorder's collectives, which a watched call of several ranks makes every few seconds.
OVERHEAD_RANK = """
import os, sys, tempfile, time
watched, steps, port = sys.argv[1] == "watched", int(sys.argv[2]), sys.argv[3]
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, TORCH_FR_BUFFER_SIZE="256" if watched else "0")
if watched:
    from fanrun._rank import progress
    progress.install(tempfile.mkdtemp(), 0)
import torch, torch.distributed as dist
if watched:  # as the worker registers it once torch is imported
    from torch.optim import optimizer as optimizer_module
    optimizer_module.register_optimizer_step_post_hook(progress._stepped)
dist.init_process_group("gloo", rank=0, world_size=1)
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 4))
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
batches = iter(torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(4 * (steps * 6 + 300), 4)),
                                           batch_size=4))
def step():
    (inputs,) = next(batches)
    model(inputs).sum().backward()
    optimizer.step()
    optimizer.zero_grad()
    dist.all_reduce(torch.ones(1))
for _ in range(300):
    step()
def per_step():
    started = time.perf_counter()
    for _ in range(steps):
        step()
    return (time.perf_counter() - started) / steps
best = min(per_step() for _ in range(5))
ask_s = None
if watched:  # the rank's own answer to the ask, written into its run directory
    started = time.perf_counter()
    for _ in range(20):
        progress._Forensics.current._write_collectives()
    ask_s = (time.perf_counter() - started) / 20
print("overhead", best, ask_s, flush=True)
dist.destroy_process_group()
"""


def overhead(rounds: int, steps: int) -> dict[str, list[float]]:
    """(d): the best seconds per step of each round, unwatched and watched alternating, and the
    seconds one ask for the collectives took (watched rounds)."""
    import socket
    import subprocess

    found: dict[str, list[float]] = {"unwatched": [], "watched": [], "ask": []}
    for _ in range(rounds):
        for mode in ("unwatched", "watched"):
            with socket.socket() as probe:  # a free port for the group's store, released for it
                probe.bind(("127.0.0.1", 0))
                port = probe.getsockname()[1]
            done = subprocess.run([sys.executable, "-c", OVERHEAD_RANK, mode, str(steps), str(port)],
                                  capture_output=True, text=True, timeout=600)
            line = next((line for line in done.stdout.splitlines() if line.startswith("overhead ")), None)
            if done.returncode != 0 or line is None:
                raise RuntimeError(f"the {mode} process failed ({done.returncode}): {done.stderr[-2000:]}")
            _, per_step, ask = line.split()
            found[mode].append(float(per_step))
            if ask != "None":
                found["ask"].append(float(ask))
    return found


def cost(args) -> dict[str, list[float]]:
    from fanrun import distributed

    modes = {"on_stall=None (not watched)": {"on_stall": None}, "on_stall='report' (the default)": {}}
    functions = {name: distributed(**decorator_arguments(args.ranks, args.device), **given)(steps_per_second)
                 for name, given in modes.items()}
    rates: dict[str, list[float]] = {name: [] for name in modes}
    for _ in range(args.repeat):  # alternating, so that drift hits both alike
        for name, function in functions.items():
            rates[name].append(function.distributed(args.steps, args.warmup, args.device)[0])
    return rates


def torch_default_timeout(device: str) -> float:
    """The seconds a collective of the planted hang waits when init_process_group is given no timeout."""
    import torch.distributed.constants as constants

    nccl = getattr(constants, "default_pg_nccl_timeout", None)
    chosen = nccl if device == "cuda" and nccl is not None else constants.default_pg_timeout
    return chosen.total_seconds()


def torch_defaults() -> list[str]:
    import torch.distributed.constants as constants

    lines = [f"default_pg_timeout (gloo, and any backend given no timeout=): "
             f"{constants.default_pg_timeout.total_seconds():g} s"]
    nccl = getattr(constants, "default_pg_nccl_timeout", None)
    lines.append("default_pg_nccl_timeout (after which NCCL's watchdog aborts a collective): "
                 + (f"{nccl.total_seconds():g} s" if nccl is not None else "none in this torch (built without NCCL)"))
    return lines


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=2, help="ranks (default 2; with --device cuda, at most the GPUs)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--stall-timeout", type=float, default=None,
                        help="fanrun's stall timeout in (a) (default: fanrun's own, the larger of 60 s and 10 step times)")
    parser.add_argument("--torch-timeout", type=float, default=20.0,
                        help="the process-group timeout given to init_process_group in (c) (default 20; 0: none given, "
                             "so torch's own default applies)")
    parser.add_argument("--repeat", type=int, default=5, help="rounds of (b); medians are shown (default 5)")
    parser.add_argument("--steps", type=int, default=300, help="timed steps of (b) (default 300)")
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--parts", nargs="+", choices=("latency", "cost", "overhead", "torch"),
                        default=["latency", "cost", "overhead", "torch"])
    parser.add_argument("--smoke", action="store_true",
                        help="short timeouts, few steps, one round: that every path still runs (its figures mean nothing)")
    args = parser.parse_args(argv)
    if args.smoke:
        args.stall_timeout = args.stall_timeout or 8.0
        args.torch_timeout, args.repeat, args.steps, args.warmup = 8.0, 1, 20, 2
    return args


def main() -> None:
    args = parse_args()
    import tempfile

    import torch

    where = (f"{args.ranks} x {torch.cuda.get_device_name(0)}" if args.device == "cuda"
             else f"{args.ranks} CPU processes, {os.cpu_count()} cores")
    print(f"{where}; Python {sys.version.split()[0]}, torch {torch.__version__}", flush=True)
    goals = []
    if "latency" in args.parts:
        timeout = f"{args.stall_timeout:g} s (--stall-timeout)" if args.stall_timeout else \
            "fanrun's default: the larger of 60 s and 10 step times"
        print(f"\n(a) Detection latency: seconds from the planted hang to fanrun's verdict; stall timeout {timeout}")
        print("| hang | s to the verdict | stall timeout s | cause | culprits | verdict |")
        print("| --- | --- | --- | --- | --- | --- |")
        for case, label in cases_for(args.ranks, args.device):
            with tempfile.TemporaryDirectory(prefix="fanrun-stall-bench-") as marks:
                found = detection(case, args, Path(marks))
            if "error" in found:
                print(f"| {label} | FAILED: {found['error']} | | | | |", flush=True)
                goals.append((f"{label}: a verdict", False, found["error"]))
                continue
            print(f"| {label} | {found['latency']:.1f} | {found['threshold']:g} | {found['cause']} | "
                  f"{', '.join(map(str, found['culprits'])) or '-'} | {found['sentence']} |", flush=True)
            late = found["latency"] - found["threshold"]
            goals.append((f"{label}: verdict within the stall timeout + {LATENCY_GOAL_S:g} s",
                          late <= LATENCY_GOAL_S, f"{late:+.1f} s"))
    if "cost" in args.parts:
        print(f"\n(b) Observation cost: rank 0's steps/s of a DDP loop, {args.steps} steps after {args.warmup}, "
              f"median of {args.repeat}, alternating")
        rates = cost(args)
        print("| mode | steps/s | rounds |")
        print("| --- | --- | --- |")
        medians = {}
        for name, values in rates.items():
            medians[name] = statistics.median(values)
            print(f"| {name} | {medians[name]:.2f} | {', '.join(f'{v:.2f}' for v in values)} |")
        unwatched, watched = medians.values()
        ratio = watched / unwatched
        print(f"watched/not watched: {ratio:.3f}x", flush=True)
        goals.append((f"watching costs at most {COST_GOAL:.0%} of the steps/s", ratio >= 1 - COST_GOAL, f"{ratio:.3f}x"))
    if "overhead" in args.parts:
        steps = 200 if args.smoke else 1500
        print(f"\n(d) What watching adds to each step, apart from the step: one process, a DDP step of a tiny model "
              f"(a batch, the backward's all-reduce, an optimizer step, a Python all_reduce), best of 5 x {steps} "
              f"steps a round, {args.repeat} rounds alternating; and one ask for the flight recorder's collectives")
        from fanrun.backends.rank_evidence import COLLECTIVES_EVERY_S

        found = overhead(args.repeat, steps)
        unwatched, watched = statistics.median(found["unwatched"]), statistics.median(found["watched"])
        ask = statistics.median(found["ask"])
        print("| mode | us per step (median of rounds) | rounds |")
        print("| --- | --- | --- |")
        for mode in ("unwatched", "watched"):
            print(f"| {mode} | {statistics.median(found[mode]) * 1e6:.1f} | "
                  f"{', '.join(f'{value * 1e6:.0f}' for value in found[mode])} |")
        print(f"watching adds {(watched - unwatched) * 1e6:+.1f} us a step; one ask for the collectives takes "
              f"{ask * 1e3:.2f} ms of a rank, every {COLLECTIVES_EVERY_S:g} s ({ask / COLLECTIVES_EVERY_S:.2%} of it)",
              flush=True)
    if "torch" in args.parts:
        given = f"timeout={args.torch_timeout:g} s" if args.torch_timeout else "no timeout: torch's default"
        print(f"\n(c) torch alone (fanrun with on_stall=None): init_process_group({given}); "
              f"seconds from the planted hang to torch's error in the caller")
        for line in torch_defaults():
            print(f"torch's {line}")
        print("| hang | s to torch's error | error | flight recorder's dump |")
        print("| --- | --- | --- | --- |")
        for case, label in cases_for(args.ranks, args.device):
            if args.ranks == 1 and case != "streams":
                print(f"| {label} | never | no collective waits, so no timeout of torch's applies | - |")
                continue
            with tempfile.TemporaryDirectory(prefix="fanrun-stall-bench-") as marks:
                found = torch_alone(case, args, Path(marks))
            shown = f"{found['latency']:.1f}" if found["latency"] is not None else "-"
            print(f"| {label} | {shown} | {found['error']} | {found['dump']} |", flush=True)
    print("\nGoals:" if goals else "\nGoals: none among the parts run (the latency and cost parts have them)")
    for what, met, figure in goals:
        print(f"  {what}: {'holds' if met else 'NOT MET'} ({figure})")


if __name__ == "__main__":
    main()
