"""Text from a rank made safe to print on a terminal: every control sequence and control
character taken out, so that nothing a rank wrote can move the cursor, retitle the window,
rewrite the clipboard or hide text."""

from __future__ import annotations

import functools
import re

# Each alternative starts with a character of its own and cannot fail once started, so one pass
# over the text does it, in time linear in its length.
_SEQUENCES = (
    # CSI, 7-bit or C1: parameters, intermediates, a final byte (ECMA-48 5.4); one cut short
    # by the end of the text is taken out all the same.
    r"(?:\x1b\[|\x9b)[0-?]*[ -/]*[@-~]?"
    # OSC, DCS, SOS, PM, APC, 7-bit or C1: a string up to BEL or ST, or to the next ESC.
    r"|(?:\x1b[\]PX^_]|[\x90\x98\x9d\x9e\x9f])[^\x07\x1b\x9c]*(?:\x07|\x1b\\|\x9c)?"
    # Any other escape: intermediates, then one final byte.
    r"|\x1b[ -/]*[0-~]?"
)
# C0, DEL and C1 (U+0080 to U+009F).
_CONTROLS = [chr(code) for code in (*range(0x20), *range(0x7f, 0xa0))]


@functools.lru_cache(maxsize=8)
def _pattern(keep: str) -> re.Pattern[str]:
    controls = "".join(re.escape(c) for c in _CONTROLS if c not in keep)
    return re.compile(_SEQUENCES + (f"|[{controls}]" if controls else ""))


def printable(text: str, keep: str = "\n\t\r") -> str:
    """`text` without escape sequences (CSI, OSC and the other strings, any other ESC sequence)
    and without control characters (C0 but those in `keep`, DEL, C1)."""
    if text.isprintable():  # no control character at all (the most lines), found in C at once
        return text
    return _pattern(keep).sub("", text)
