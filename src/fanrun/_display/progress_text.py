"""A progress bar read back from the line a rank redraws with '\\r': tqdm's format, and the
Rich / Keras-like "12/100" forms that carry a count, so that the panel can draw its own bar
with the rate and the time left."""

from __future__ import annotations

import dataclasses
import re

_SUFFIX = {"": 1.0, "k": 1e3, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12}
# A bar is read from the last this many characters of a line: tqdm's, with a long description and
# postfix, fits. Every step below is linear in what it looks at, and this bounds what that is: a
# rank's line can be megabytes long, and the panel reads every line and every redraw.
PARSED_CHARS = 1024
# Places in a line tried as tqdm's "%|": past this many, it is no bar.
_MOST_TRIES = 4

# A number starts where no digit or point stands before it: a search then tries each run of
# digits once, not once per digit.
_NUMBER = r"(?<![0-9.])[0-9]+(?:\.[0-9]+)?[kKMGT]?"
# After tqdm's bar: " 45/100 [00:01<00:01, 39.82it/s, loss=0.1]"
_AFTER_BAR = re.compile(rf"\s*(?P<n>{_NUMBER})/(?P<total>{_NUMBER})(?:\s*\[(?P<times>[^\]]*)\])?")
# Before a total-less tqdm's "[...]": "123it "
_COUNT_BEFORE_TIMES = re.compile(rf"(?P<n>{_NUMBER})(?P<unit>[a-zA-Z]+)\s*$")
# Any other "n/total" the line starts a count with ("Epoch 3/10", "120/500 [====>...]")
_COUNT = re.compile(r"\b(?P<n>[0-9]+)/(?P<total>[0-9]+)\b")
_RATE = re.compile(rf"(?P<value>{_NUMBER})\s*(?P<unit>[a-zA-Z]*)/(?P<per>s|it|[a-zA-Z]+)")


@dataclasses.dataclass(frozen=True)
class Progress:
    n: float
    total: float | None
    description: str = ""
    rate: float | None = None  # units per second
    unit: str = "it"

    @property
    def fraction(self) -> float | None:
        if not self.total:
            return None
        return min(max(self.n / self.total, 0.0), 1.0)

    @property
    def seconds_left(self) -> float | None:
        if self.total is None or not self.rate:
            return None
        return max(self.total - self.n, 0.0) / self.rate


def parse(text: str, tqdm_only: bool = False) -> Progress | None:
    """The progress that `text` shows, or None when it shows no count. tqdm_only: a bare
    "n/total" is no progress (in an ordinary line, it is more often a step's words). Only the
    line's last PARSED_CHARS characters are read, in time linear in them."""
    tail = text[-PARSED_CHARS:]
    return _tqdm_bar(tail) or _tqdm_count(tail) or (None if tqdm_only else _count(tail))


def _tqdm_bar(text: str) -> Progress | None:
    """'desc:  45%|████▌     | 45/100 [00:01<00:01, 39.82it/s, loss=0.1]'"""
    at = -1
    for _ in range(_MOST_TRIES):
        at = text.find("%|", at + 1)
        if at < 0:
            return None
        digits = at
        while digits > 0 and "0" <= text[digits - 1] <= "9" and at - digits < 3:  # "100" at most
            digits -= 1
        close = text.find("|", at + 2)
        if digits == at or close < 0:
            continue
        match = _AFTER_BAR.match(text, close + 1)
        if match is not None:
            rate, unit = _rate(match.group("times") or "")
            return Progress(_number(match.group("n")), _number(match.group("total")), _description(text[:digits]),
                            rate, unit)
    return None


def _tqdm_count(text: str) -> Progress | None:
    """tqdm without a total: 'desc: 123it [00:01, 99.5it/s]', the times last."""
    shown = text.rstrip()
    if not shown.endswith("]"):
        return None
    opening = shown.rfind("[")
    if opening < 0:
        return None
    before = shown[max(opening - 64, 0):opening]  # the count and its unit are short
    match = _COUNT_BEFORE_TIMES.search(before)
    if match is None:
        return None
    rate, unit = _rate(shown[opening + 1:-1])
    start = opening - len(before) + match.start()
    return Progress(_number(match.group("n")), None, _description(shown[:start]), rate, unit or match.group("unit"))


def _count(text: str) -> Progress | None:
    match = _COUNT.search(text)
    if match is None or int(match.group("total")) == 0:
        return None
    return Progress(float(match.group("n")), float(match.group("total")), text[:match.start()].strip(" :[|"))


def _description(before: str) -> str:
    """tqdm's "desc: " before its count: what stands before a colon that ends `before`."""
    before = before.rstrip()
    return before[:-1].strip() if before.endswith(":") else ""


def _number(text: str) -> float:
    return float(text[:-1]) * _SUFFIX[text[-1]] if text[-1] in _SUFFIX else float(text)


def _rate(times: str) -> tuple[float | None, str]:
    """Units per second from tqdm's "39.82it/s" or "2.50s/it" (seconds per unit)."""
    for match in _RATE.finditer(times):
        value, unit, per = _number(match.group("value")), match.group("unit"), match.group("per")
        if per == "s" and unit:
            return value, unit
        if unit == "s" and per:
            return (1.0 / value if value else None), per
    return None, "it"


def format_seconds(seconds: float) -> str:
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}" if hours else f"{rest // 60:02d}:{rest % 60:02d}"


def format_rate(progress: Progress) -> str:
    if progress.rate is None:
        return ""
    if progress.rate >= 1 or progress.rate == 0:
        return f"{progress.rate:.3g} {progress.unit}/s"
    return f"{1 / progress.rate:.3g} s/{progress.unit}"
