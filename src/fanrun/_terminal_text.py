"""Text from a rank made safe to print on a terminal: no control sequence of it reaches the terminal.

A rank's output or exception text may hold escape sequences that set the window's title, move the
cursor, or make the terminal answer (ESC[6n writes a reply into the terminal's input, as if typed).
printable() drops every whole sequence (ESC or its one-character C1 form, such as U+009B for CSI)
and shows every other C0 or C1 control character, and DEL, as a visible escape such as \\x07.
"""

from __future__ import annotations

import re

_C0_C1 = "\x00-\x1f\x7f-\x9f"
_SEQUENCE = re.compile(
    # CSI: ESC [ or U+009B, parameters, intermediates, one final character.
    r"(?:\x1b\[|\x9b)[\x30-\x3f]*[\x20-\x2f]*[\x40-\x7e]?"
    # OSC, DCS, SOS, PM, APC: a string up to BEL or ST, or to the next control character.
    rf"|(?:\x1b[\]PX^_]|[\x9d\x90\x98\x9e\x9f])[^{_C0_C1}]*(?:\x07|\x1b\\|\x9c)?"
    # Every other escape: ESC, intermediates, one final character (ESC c resets the terminal).
    r"|\x1b[\x20-\x2f]*[\x30-\x7e]?"
)
_CONTROL = re.compile(f"[{_C0_C1}]")


def printable(text: str, keep: str = "\n\t\r") -> str:
    """`text` without its control sequences, and its other control characters escaped, but for
    those in `keep` (a newline, a tab and a carriage return by default)."""
    text = _SEQUENCE.sub("", text)
    return _CONTROL.sub(lambda found: found[0] if found[0] in keep else f"\\x{ord(found[0]):02x}", text)
