"""A caller whose rank prints lines of any length: a 64 KiB line, a line of 1 MiB redrawn with
'\\r', and 100 MB with no newline at all; it says what the call cost it, in CPU and peak memory."""

from __future__ import annotations

import re

HUGE = 100_000_000
SHOWN = 64 * 1024  # output.SHOWN_LINE_CHARS

CALLER = """
import resource, sys, time
from fanrun import distributed

@distributed(num_accelerators=1, accelerator_type="CPU", tracking=False, display={display!r})
def write(huge):
    import os
    os.write(1, b"a" * 65536 + b"\\n")
    os.write(1, b"\\r" + b"b" * (1 << 20) + b"\\n")
    chunk = b"x" * (1 << 20)
    left = huge
    while left > 0:
        left -= os.write(1, chunk[:left])
    return "returned"

# A first call, short: what any call costs the caller (its imports, the rendezvous store) is the baseline.
write.distributed(10)
before = resource.getrusage(resource.RUSAGE_SELF)
print(write.distributed({huge})[0], flush=True)
after = resource.getrusage(resource.RUSAGE_SELF)
cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
print(f"measured: cpu_s={{cpu:.2f}} peak_growth_mb={{(after.ru_maxrss - before.ru_maxrss) / 1024:.0f}}", flush=True)
"""

# A display holds a few times SHOWN_LINE_CHARS of a line, and the engine hands over 1 MiB at a
# time; the line itself is 100 MB.
MOST_GROWTH_MB = 60
# The call takes 1.5 s of the caller's CPU on a loaded 2-core machine; a 32 KiB line took 18 s.
MOST_CPU_S = 20


def caller(display: str | None, huge: int = HUGE) -> str:
    return CALLER.format(display=display, huge=huge)


def check_cost(output: str) -> None:
    found = re.search(r"measured: cpu_s=([0-9.]+) peak_growth_mb=(-?[0-9]+)", output)
    assert found, output[-3000:]
    cpu, growth = float(found.group(1)), int(found.group(2))
    assert cpu < MOST_CPU_S and growth < MOST_GROWTH_MB, (cpu, growth)


def left_out_note(characters: int) -> str:
    return f" [... {characters:,} more characters: rank_0.log in the run's directory holds the whole line]"


# A rank's text with every kind of control sequence in it: CSI (7-bit and C1), OSC (7-bit and C1,
# ended by BEL and by ST), C0, DEL, NEL (C1), DCS; what a display may show of it is SAFE.
HOSTILE = ("<<a\x1b[2Jb\u009b2Jc\x1b]0;title\x07d\u009d0;t\u009ce\x07f\x00g\x7fh\u0085i\x1bPq\x1b\\j"
           "\x1b[5Ck\x1b(Bl\x08m>>")
SAFE = "<<abcde\\x07f\\x00g\\x7fh\\x85ijkl\\x08m>>"  # sequences gone, lone controls shown as text

HOSTILE_CALLER = """
import sys, time
from fanrun import distributed

@distributed(num_accelerators=1, accelerator_type="CPU", tracking=False, display={display!r})
def hostile(text):
    import sys, time
    print(text, flush=True)
    print(text, file=sys.stderr, flush=True)
    print("start " + text, end="", flush=True)  # a line shown before its end
    time.sleep(0.5)
    print(" end")
    for step in range(3):
        print(f"\\r{{step}}/3 " + text, end="", flush=True)  # a line redrawn
        time.sleep(0.3)
    print()
    raise ValueError(text)

try:
    hostile.distributed({hostile!r})
except ValueError:
    print("raised", flush=True)
"""


def hostile_caller(display: str | None) -> str:
    return HOSTILE_CALLER.format(display=display, hostile=HOSTILE)


def controls_in(text: str) -> list[str]:
    """The control characters in `text` other than the line ends a display writes."""
    return sorted({c for c in text if (ord(c) < 0x20 and c not in "\n\r") or 0x7f <= ord(c) <= 0x9f})
