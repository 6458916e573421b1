"""A progress bar read back from the line a rank redraws with '\\r': tqdm's format, and the
Rich / Keras-like "12/100" forms that carry a count, so that the panel can draw its own bar
with the rate and the time left."""

from __future__ import annotations

import dataclasses
import re

_SUFFIX = {"": 1.0, "k": 1e3, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12}
_NUMBER = r"[0-9]+(?:\.[0-9]+)?[kKMGT]?"
# "desc:  45%|████▌     | 45/100 [00:01<00:01, 39.82it/s, loss=0.1]"
_TQDM = re.compile(rf"(?:(?P<desc>.*?):\s*)?(?P<percent>[0-9]+)%\|.*?\|\s*(?P<n>{_NUMBER})/(?P<total>{_NUMBER})"
                   rf"(?:\s*\[(?P<times>[^\]]*)\])?")
# "desc: 123it [00:01, 99.5it/s]": tqdm without a total
_TQDM_COUNT = re.compile(rf"(?:(?P<desc>.*?):\s*)?(?P<n>{_NUMBER})(?P<unit>[a-zA-Z]+)\s*\[(?P<times>[^\]]*)\]")
# Any other "n/total" the line starts a count with ("Epoch 3/10", "120/500 [====>...]")
_COUNT = re.compile(r"(?P<desc>.*?)\b(?P<n>[0-9]+)/(?P<total>[0-9]+)\b")
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
    "n/total" is no progress (in an ordinary line, it is more often a step's words)."""
    match = _TQDM.search(text)
    if match is not None:
        rate, unit = _rate(match.group("times") or "")
        return Progress(_number(match.group("n")), _number(match.group("total")), _description(match), rate, unit)
    match = _TQDM_COUNT.search(text)
    if match is not None:
        rate, unit = _rate(match.group("times"))
        return Progress(_number(match.group("n")), None, _description(match), rate, unit or match.group("unit"))
    match = None if tqdm_only else _COUNT.search(text)
    if match is not None and int(match.group("total")) > 0:
        return Progress(float(match.group("n")), float(match.group("total")), match.group("desc").strip(" :[|"))
    return None


def _description(match: re.Match) -> str:
    return (match.group("desc") or "").strip()


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
