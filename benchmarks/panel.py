"""Benchmark: what the live panel costs. Each rank trains a small model for a fixed number of
steps, with a tqdm bar, a printed line every 50 steps and mlflow.log_metric every step; one
caller, in a pseudo-terminal or in a Jupyter kernel, makes the call with display="panel",
"logs" and "quiet", each round in a rotated order. For each: the caller's CPU time over the
call's wall time (its share of one core), the ranks' CPU time over it (the cores they kept
busy), and their training steps per second against quiet's in the same round. The panel's own
cost is its CPU share less quiet's (no display at all).

    python benchmarks/panel.py              # 2 ranks, 3 rounds
    python benchmarks/panel.py --ranks 1 --accelerator GPU
    python benchmarks/panel.py --where notebook
    python benchmarks/panel.py --smoke
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import pty
import select
import statistics
import sys
import tempfile
import textwrap
from pathlib import Path

GOAL_CPU_SHARE = 0.01  # of one core, for the panel
GOAL_THROUGHPUT = 0.98  # of quiet's steps per second
DISPLAYS = ("panel", "logs", "quiet")

CALLER = textwrap.dedent(
    """
    import json, resource, statistics, sys, time
    from fanrun import distributed

    displays, ranks, steps, rounds, out = sys.argv[1].split(","), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
    accelerator = sys.argv[6]
    # The caller, and the ranks (its children, reaped by the end of each call).
    WHO = (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)

    def train(steps, accelerator):
        import time
        import mlflow
        import torch
        from tqdm import tqdm

        torch.set_num_threads(1)
        # On a GPU a wider model, so that a step is the GPU's work and not the launch of its kernels.
        device, width = ("cuda", 4096) if accelerator == "GPU" else ("cpu", 256)
        model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.ReLU(), torch.nn.Linear(width, 1)).to(device)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        x, y = torch.randn(64, width, device=device), torch.randn(64, 1, device=device)
        started = time.perf_counter()
        for step in tqdm(range(steps), desc="train"):
            loss = torch.nn.functional.mse_loss(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            mlflow.log_metric("loss", loss.item(), step=step)
            if step % 50 == 0:
                print(f"step {step} loss {loss.item():.4f}", flush=True)
        return steps / (time.perf_counter() - started)

    # accelerator_type=None: the machine's GPUs.
    kind = None if accelerator == "GPU" else "CPU"
    calls = {d: distributed(num_accelerators=ranks, accelerator_type=kind, tracking=False, display=d)(train)
             for d in displays}
    for call in calls.values():
        call.distributed(10, accelerator)  # imports and caches warm: what is measured is the display
    results = {d: [] for d in displays}
    for round in range(rounds):
        # Each round in another order, so that each display takes each place: the first call of
        # a round ran faster or slower than the others by up to 20 % on the 2-core machine.
        for display in displays[round % len(displays):] + displays[:round % len(displays)]:
            call = calls[display]
            before, wall = [resource.getrusage(who) for who in WHO], time.perf_counter()
            rates = call.distributed(steps, accelerator)
            after, wall = [resource.getrusage(who) for who in WHO], time.perf_counter() - wall
            cpu, ranks_cpu = [(a.ru_utime - b.ru_utime) + (a.ru_stime - b.ru_stime) for a, b in zip(after, before)]
            results[display].append({"cpu_s": cpu, "ranks_cpu_s": ranks_cpu, "wall_s": wall,
                                     "steps_per_s": statistics.mean(rates)})
            # On the process's own stderr, which a notebook's kernel shares with whoever started it.
            print(f"round {round + 1}, {display}: {wall:.1f} s", file=sys.__stderr__, flush=True)
    with open(out, "w") as file:
        json.dump(results, file)
    """
)


def in_terminal(args: list[str]) -> int:
    """Runs `args` with a pseudo-terminal of 150 x 50 for its stdout and stderr, reading what it
    draws as a terminal would; returns its exit code."""
    import fcntl
    import struct
    import termios

    pid, master = pty.fork()
    if pid == 0:
        os.environ["TERM"] = "xterm"
        os.execv(args[0], args)
    fcntl.ioctl(master, termios.TIOCSWINSZ, struct.pack("HHHH", 50, 150, 0, 0))
    screen = bytearray()  # its last 20 kB, shown if it fails
    while True:
        select.select([master], [], [])
        try:
            data = os.read(master, 65536)
        except OSError:  # EIO: the child closed its side
            break
        if not data:
            break
        screen = (screen + data)[-20000:]
    _, status = os.waitpid(pid, 0)
    os.close(master)
    code = os.waitstatus_to_exitcode(status)
    if code != 0:
        print(screen.decode(errors="replace")[-3000:], file=sys.stderr)
    return code


def in_notebook(args: list[str]) -> int:
    """Runs the caller script `args[1]` with `args[1:]` for its argv in a Jupyter kernel, through
    nbclient: the kernel is then the caller, and its CPU counts the panel's HTML and plot, and the
    messages that carry them to the notebook. Returns 0, or 1 when the cell raised."""
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError

    cell = f"import sys\nsys.argv = {args[1:]!r}\nexec(compile(open(sys.argv[0]).read(), sys.argv[0], 'exec'))"
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(cell)])
    try:
        NotebookClient(notebook, timeout=3600, kernel_name="python3").execute()
    except CellExecutionError as error:
        print(error, file=sys.stderr)
        return 1
    return 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--accelerator", choices=("CPU", "GPU"), default="CPU", help="what each rank trains on")
    parser.add_argument("--where", choices=("terminal", "notebook"), default="terminal",
                        help="the caller in a pseudo-terminal, or in a Jupyter kernel")
    parser.add_argument("--smoke", action="store_true", help="tiny: 200 steps, one round")
    options = parser.parse_args()
    if options.smoke:
        options.steps, options.rounds = 200, 1
    with tempfile.TemporaryDirectory() as folder:
        script, out = Path(folder) / "caller.py", Path(folder) / "results.json"
        script.write_text(CALLER)
        # One caller for every display: one interpreter start, one warm-up.
        run = in_notebook if options.where == "notebook" else in_terminal
        code = run([sys.executable, str(script), ",".join(DISPLAYS), str(options.ranks), str(options.steps),
                    str(options.rounds), str(out), options.accelerator])
        if code != 0:
            raise SystemExit(f"the caller exited with {code}")
        results = json.loads(out.read_text())
    print(f"machine: {platform.node()}, {os.cpu_count()} cores, Python {platform.python_version()}; "
          f"caller in a {options.where}; {options.ranks} {options.accelerator} ranks x {options.steps} steps, "
          f"{options.rounds} round(s), medians")
    print("| display | caller CPU share of one core | ranks' CPU, cores | steps/s per rank | vs quiet, same round |")
    print("| --- | ---: | ---: | ---: | ---: |")
    share = {d: statistics.median(r["cpu_s"] / r["wall_s"] for r in results[d]) for d in DISPLAYS}
    cores = {d: statistics.median(r["ranks_cpu_s"] / r["wall_s"] for r in results[d]) for d in DISPLAYS}
    rate = {d: statistics.median(r["steps_per_s"] for r in results[d]) for d in DISPLAYS}
    # Each round's rate against quiet's in the same round: the machine's speed drifts from call to
    # call (by 20 % on the 2-core machine), less within a round than across rounds.
    paired = {d: statistics.median(r["steps_per_s"] / q["steps_per_s"] for r, q in zip(results[d], results["quiet"]))
              for d in DISPLAYS}
    for display in DISPLAYS:
        print(f"| {display} | {share[display]:.2%} | {cores[display]:.2f} | {rate[display]:,.0f} | {paired[display]:.3f}x |")
    for display in DISPLAYS:
        print(f"{display}, each round: CPU share " + ", ".join(f"{r['cpu_s'] / r['wall_s']:.2%}" for r in results[display])
              + "; steps/s " + ", ".join(f"{r['steps_per_s']:,.0f}" for r in results[display]))
    own = share["panel"] - share["quiet"]
    print("Goals:")
    print(f"  the panel's own CPU (panel - quiet) under {GOAL_CPU_SHARE:.0%} of one core: "
          f"{'holds' if own < GOAL_CPU_SHARE else 'NOT MET'} ({own:.2%})")
    print(f"  training throughput with the panel at least {GOAL_THROUGHPUT:.0%} of quiet's: "
          f"{'holds' if paired['panel'] >= GOAL_THROUGHPUT else 'NOT MET'} ({paired['panel']:.3f}x)")


if __name__ == "__main__":
    main()
