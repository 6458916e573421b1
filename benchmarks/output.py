"""Benchmark: how fast the ranks' output reaches the caller. Each rank writes its lines as fast as
it can; every line goes through the engine (read, split, logged, reported as an event) and
through the caller's display: display="logs" with the caller's stdout a file (each line labelled
and written), and display="quiet" (the events still reach Python, which only keeps stderr's
tail). What it measures is fanrun's own path; a change to the engine's events or to the display
is held against the figures it printed before.

For each: lines per second from the first line to the last, and the caller's CPU per line (its
whole process: the engine's reading and the Python side). A call with no lines is timed in the
same round and taken off, so that starting the ranks does not count.

    python benchmarks/output.py [--lines 200000] [--ranks 2] [--rounds 3] [--smoke]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

DISPLAYS = ("logs", "quiet")

# The rank's whole program: its lines in blocks of a thousand, through sys.stdout.
EMIT = textwrap.dedent(
    """
    import sys

    def emit(lines):
        block = "".join(f"{i:08d} the quick brown fox jumps over the lazy dog, step {i}\\n" for i in range(1000))
        for _ in range(lines // 1000):
            sys.stdout.write(block)
        sys.stdout.flush()
        return lines

    if __name__ == "__main__":
        emit(int(sys.argv[1]))
    """
)

CALLER = textwrap.dedent(
    """
    import json, resource, sys, time
    sys.path.insert(0, sys.argv[1])
    from emit import emit
    from fanrun import distributed

    displays, ranks, lines, rounds, out = sys.argv[2].split(","), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), sys.argv[6]
    calls = {d: distributed(num_accelerators=ranks, accelerator_type="CPU", tracking=False, display=d)(emit)
             for d in displays}
    for call in calls.values():
        call.distributed(1000)  # imports and caches warm
    results = {d: [] for d in displays}

    def timed(call, count):
        cpu, wall = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        call.distributed(count)
        after, wall = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter() - wall
        return wall, (after.ru_utime - cpu.ru_utime) + (after.ru_stime - cpu.ru_stime)

    for round in range(rounds):
        for display in displays[round % len(displays):] + displays[:round % len(displays)]:
            empty_wall, empty_cpu = timed(calls[display], 0)
            wall, cpu = timed(calls[display], lines)
            results[display].append({"wall_s": wall - empty_wall, "cpu_s": cpu - empty_cpu})
            print(f"round {round + 1}, {display}: {wall:.2f} s", file=sys.__stderr__, flush=True)
    with open(out, "w") as file:
        json.dump(results, file)
    """
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--lines", type=int, default=200_000, help="per rank, a multiple of 1000")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--smoke", action="store_true", help="tiny: 20000 lines, one round")
    options = parser.parse_args()
    if options.smoke:
        options.lines, options.rounds = 20_000, 1
    total = options.ranks * options.lines
    with tempfile.TemporaryDirectory() as name:
        folder = Path(name)
        (folder / "emit.py").write_text(EMIT)
        (folder / "caller.py").write_text(CALLER)
        out = folder / "results.json"
        with open(folder / "caller.out", "wb") as sink:  # a file: display="logs" writes every line there
            subprocess.run([sys.executable, str(folder / "caller.py"), str(folder), ",".join(DISPLAYS),
                            str(options.ranks), str(options.lines), str(options.rounds), str(out)],
                           stdout=sink, check=True, timeout=3600)
        results = json.loads(out.read_text())
    print(f"machine: {platform.node()}, {os.cpu_count()} cores, Python {platform.python_version()}; "
          f"{options.ranks} ranks x {options.lines} lines, {options.rounds} round(s), medians")
    print("| display | lines/s | caller CPU us/line |")
    print("| --- | ---: | ---: |")
    for display, rounds in results.items():
        rate = statistics.median(total / r["wall_s"] for r in rounds)
        cpu = statistics.median(r["cpu_s"] for r in rounds) / total * 1e6
        print(f"| {display} | {rate:,.0f} | {cpu:.2f} |")
    for display, rounds in results.items():
        print(f"{display}, each round: " + ", ".join(
            f"{total / r['wall_s']:,.0f} lines/s, {r['cpu_s'] / total * 1e6:.2f} us/line" for r in rounds))


if __name__ == "__main__":
    main()
