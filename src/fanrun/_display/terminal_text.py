"""Text from a rank made safe to print on a terminal: no control sequence of it reaches the terminal.

A rank's output or exception text may hold escape sequences that set the window's title, move the
cursor, or make the terminal answer (ESC[6n writes a reply into the terminal's input, as if typed).
printable() drops every whole sequence (ESC or its one-character C1 form, such as U+009B for CSI)
and shows every other C0 or C1 control character, and DEL, as a visible escape such as \\x07.
"""

from __future__ import annotations

import functools
import re

# Each alternative starts with a character of its own and cannot fail once started, so one pass
# over the text does it, in time linear in its length.
_SEQUENCES = (
    # CSI, 7-bit or C1: parameters, intermediates, a final byte (ECMA-48 5.4); one cut short
    # by the end of the text is taken out all the same.
    r"(?:\x1b\[|\x9b)[0-?]*[ -/]*[@-~]?"
    # OSC, DCS, SOS, PM, APC, 7-bit or C1: a string up to BEL or ST, or to the next control character.
    r"|(?:\x1b[\]PX^_]|[\x90\x98\x9d\x9e\x9f])[^\x00-\x1f\x7f-\x9f]*(?:\x07|\x1b\\|\x9c)?"
    # Any other escape: intermediates, then one final byte (ESC c resets the terminal).
    r"|\x1b[ -/]*[0-~]?"
)
# C0, DEL and C1 (U+0080 to U+009F).
_CONTROLS = [chr(code) for code in (*range(0x20), *range(0x7f, 0xa0))]


@functools.lru_cache(maxsize=8)
def _pattern(keep: str) -> re.Pattern[str]:
    controls = "".join(re.escape(c) for c in _CONTROLS if c not in keep)
    return re.compile(_SEQUENCES + (f"|[{controls}]" if controls else ""))


def _shown(found: re.Match[str]) -> str:
    text = found[0]
    return f"\\x{ord(text):02x}" if len(text) == 1 and text != "\x1b" and text not in "\x9b\x90\x98\x9d\x9e\x9f" else ""


def printable(text: str, keep: str = "\n\t\r") -> str:
    """`text` without its control sequences, and its other control characters escaped, but for
    those in `keep` (a newline, a tab and a carriage return by default)."""
    if text.isprintable():  # no control character at all (most lines), found in C at once
        return text
    return _pattern(keep).sub(_shown, text)
