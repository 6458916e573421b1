"""The verdict of a stall: from the evidence of every rank, the ranks to blame and why, in one sentence.

Pure: it judges what stall_report.py holds, gathered elsewhere. The rules, first match wins:
1. ranks in the same collective (by count, or by a process group's sequence number in the flight
   recorder) but in different operations: a mismatch; the minority is to blame;
2. some ranks wait in a collective and others are not in it: those others, each by what it does.
   Who waits is read from the progress records, else from the flight recorders (DDP's gradient
   all-reduces are no Python call of torch.distributed, so the records show none);
3. every rank waits in the same collective: the collective itself does not complete;
4. otherwise, what each rank that still runs is doing.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import re
import sysconfig
from collections.abc import Callable, Iterable, Sequence

from .stall_report import RankEvidence, Verdict

Frame = tuple[str, int, str]  # (file, line, function)

# faulthandler's lines: a thread's header, the header of a dump of the current thread alone, a frame.
_THREAD = re.compile(r"^(?:Current thread|Thread) (0x[0-9a-fA-F]+)\b.*\(most recent call first\):\s*$")
_ONE_THREAD = "Stack (most recent call first):"
_FRAME = re.compile(r'^  File (?:"(.*)"|\?\?\?), line (\d+|\?\?\?) in (.*)$')
_TRUNCATED = "  ..."  # faulthandler shows 100 frames at most: the outermost ones are missing

# Code that is not the user's: the standard library, installed packages, torch, fanrun itself.
_FANRUN_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_LIBRARY_DIRS = tuple(sorted({os.path.join(sysconfig.get_paths()[key], "") for key in
                              ("stdlib", "platstdlib", "purelib", "platlib")} | {os.path.join(_FANRUN_DIR, "")}))
_LIBRARY = re.compile(r"[/\\](?:site-packages|dist-packages|torch|fanrun[/\\]_rank)[/\\]"
                      r"|[/\\]lib[/\\]python3\.\d+t?[/\\]|^<frozen ")
# Clauses about different ranks named one by one before the rest are summed up.
_MOST_CLAUSES = 3


@dataclasses.dataclass
class _Thread:
    """A thread of a faulthandler dump."""

    ident: str | None
    frames: list[Frame] = dataclasses.field(default_factory=list)  # innermost first, as faulthandler writes them
    truncated: bool = False

    def likely_main(self) -> int:
        """2: not started by threading; 1: cannot be told (its outermost frames were cut); 0: started by threading."""
        if self.truncated:
            return 1
        file, _, function = self.frames[-1]
        return 0 if os.path.basename(file) == "threading.py" and function in ("_bootstrap", "_bootstrap_inner") else 2


def parse_stack(text: str) -> tuple[Frame, ...]:
    """The main thread's frames, outermost first, from faulthandler's text of every thread.

    The thread faulthandler calls "Current thread" is whichever received the signal, so the main
    thread is told by its outermost frame instead: every thread that threading started has
    threading.py's bootstrap there. Where that leaves several (a thread of _thread, a stack cut at
    100 frames), the last one listed wins: faulthandler lists the newest thread first. Where the
    text holds several dumps (a file appended to), the last one is read."""
    dumps: list[list[_Thread]] = [[]]
    for line in text.splitlines():
        header = _THREAD.match(line)
        if header or line.startswith(_ONE_THREAD):
            ident = header.group(1) if header else None
            if ident is None or any(thread.ident == ident for thread in dumps[-1]):
                dumps.append([])  # a thread seen again, or a dump of one thread: a dump of its own
            dumps[-1].append(_Thread(ident))
        elif dumps[-1] and (frame := _FRAME.match(line)):
            file, number, function = frame.groups()
            dumps[-1][-1].frames.append((file or "???", int(number) if number.isdigit() else 0, function))
        elif dumps[-1] and line.rstrip() == _TRUNCATED:
            dumps[-1][-1].truncated = True
    threads = next(([t for t in dump if t.frames] for dump in reversed(dumps) if any(t.frames for t in dump)), [])
    if not threads:
        return ()
    best = max(thread.likely_main() for thread in threads)
    main = [thread for thread in threads if thread.likely_main() == best][-1]
    return tuple(reversed(main.frames))


def is_user_code(file: str) -> bool:
    """Whether a frame's file is the user's: not the standard library, an installed package, torch or fanrun."""
    return not (file.startswith(_LIBRARY_DIRS) or _LIBRARY.search(file))


def verdict(ranks: Sequence[RankEvidence], now: float) -> Verdict:
    """The culprits of a stall and its cause, in one sentence (rules in the module's docstring)."""
    ranks = sorted(ranks, key=lambda evidence: evidence.rank)
    if not ranks:
        return Verdict("no rank gave any evidence", (), "unknown")
    waiting = _collective_waits(ranks) or _flight_recorder_waits(ranks, now)
    return (_mismatch(ranks) or _flight_recorder_mismatch(ranks)
            or (waiting and (_blame_the_others(ranks, waiting, now) or _all_wait(ranks, waiting, now)))
            or _each_rank(ranks, now))


@dataclasses.dataclass(frozen=True)
class _Waits:
    """Ranks that wait in collectives, and what the others missed of them."""

    where: dict[int, tuple[str, str]]  # rank: (op, label as "#57")
    since: float  # when the last of them began to wait: all of them wait at least since then
    # The collective a rank not among them never entered, as "collective #88"; None where it did.
    missed: Callable[[RankEvidence], str | None]
    steps: int  # the most steps and batches any of them made (-1 where none keeps a record)
    batches: int

    def passed_by(self, evidence: RankEvidence) -> bool:
        """Whether a rank made progress that they have not (more steps or batches than any of
        them): it went past the collective rather than being stuck before it."""
        progress = evidence.progress
        return progress is not None and (progress.steps > self.steps or progress.batches > self.batches)

    def clause(self) -> str:
        """`ranks 0 and 2 wait in all_reduce #12`, `rank 0 waits in all_reduce #12 and rank 3 in barrier #11`."""
        groups: dict[tuple[str, str], list[int]] = collections.defaultdict(list)
        for rank, place in sorted(self.where.items()):
            groups[place].append(rank)
        parts = [f"{_ranks(ranks)}{'' if index else _verb(ranks, ' waits', ' wait')} in {op} {label}"
                 for index, ((op, label), ranks) in enumerate(groups.items())]
        return _and(parts)


def _collective_waits(ranks: list[RankEvidence]) -> _Waits | None:
    """The running ranks that are in a collective by their progress records."""
    waiting = [r for r in ranks if r.running and r.progress is not None and r.progress.state == "collective"]
    if not waiting:
        return None
    counts = sorted({r.progress.collectives for r in waiting})

    def missed(evidence: RankEvidence) -> str | None:
        entered = evidence.progress.collectives if evidence.progress else 0
        return next((f"collective #{count}" for count in counts if entered < count), None)

    return _waits(ranks, {r.rank: (r.progress.op, f"#{r.progress.collectives}") for r in waiting},
                  [r.progress.state_since for r in waiting], missed)


def _waits(ranks: list[RankEvidence], where: dict[int, tuple[str, str]], since: list[float],
           missed: Callable[[RankEvidence], str | None]) -> _Waits:
    records = [r.progress for r in ranks if r.rank in where and r.progress is not None]
    return _Waits(where, max(since), missed, max((p.steps for p in records), default=-1),
                  max((p.batches for p in records), default=-1))


def _mismatch(ranks: list[RankEvidence]) -> Verdict | None:
    """Ranks in the same collective, by count, but in different operations."""
    by_count: dict[int, dict[str, list[int]]] = collections.defaultdict(lambda: collections.defaultdict(list))
    for r in ranks:
        if r.running and r.progress is not None and r.progress.state == "collective":
            by_count[r.progress.collectives][r.progress.op].append(r.rank)
    for count, ops in sorted(by_count.items()):
        if len(ops) > 1:
            return _mismatch_verdict(f"collective mismatch at #{count}", ops)
    return None


def flight_recorder_entries(collectives: Iterable[dict] | None) -> dict[tuple[str, int], dict]:
    """A rank's flight-recorder collectives by (group, seq). Left out: point-to-point ones, which
    take no collective sequence number of their own, and those of groups described as
    "undefined", torch's description of every unnamed group, which tells them not apart."""
    entries = {}
    for entry in collectives or ():
        op, seq, group = entry.get("op"), entry.get("seq"), str(entry.get("group"))
        if (isinstance(op, str) and isinstance(seq, int) and "send" not in op and "recv" not in op
                and group != "undefined"):
            entries[(group, seq)] = entry
    return entries


def flight_recorder_op(entry: dict) -> str:
    return entry["op"].split(":")[-1]  # "nccl:all_reduce": the op, without its backend


def group_label(group: str, seq: int) -> str:
    return f"#{seq}" if group in ("default_pg", "None") else f"#{seq} of group {group}"


def _flight_recorder_mismatch(ranks: list[RankEvidence]) -> Verdict | None:
    """Ranks whose flight recorders hold different operations at the same seq of the same group."""
    ops: dict[tuple[str, int], dict[str, list[int]]] = collections.defaultdict(lambda: collections.defaultdict(list))
    for r in ranks:
        for key, entry in flight_recorder_entries(r.collectives).items():
            ops[key][flight_recorder_op(entry)].append(r.rank)
    for (group, seq), by_op in sorted(ops.items()):
        if len(by_op) > 1:
            return _mismatch_verdict(f"collective mismatch at {group_label(group, seq)}", by_op)
    return None


def _flight_recorder_waits(ranks: list[RankEvidence], now: float) -> _Waits | None:
    """The running ranks in a group's latest collective by their flight recorders: where a rank of
    the group never started it, it cannot have completed, whatever the state says (gloo's stay
    "scheduled"); where every rank did, only an entry that says "started" waits."""
    recorded = {r.rank: flight_recorder_entries(r.collectives)
                for r in ranks if r.running and r.collectives is not None}
    for group in sorted({group for entries in recorded.values() for group, _ in entries}):
        last = {rank: max(seq for g, seq in entries if g == group)
                for rank, entries in recorded.items() if any(g == group for g, _ in entries)}
        seq = max(last.values())
        waiting = {rank: recorded[rank][(group, seq)] for rank, at in last.items()
                   if at == seq and recorded[rank][(group, seq)].get("state") != "completed"}
        behind = any(at < seq for at in last.values())
        if not waiting or (not behind and any(entry.get("state") != "started" for entry in waiting.values())):
            continue
        since = [entry["created_ns"] / 1e9 if isinstance(entry.get("created_ns"), int) else now
                 for entry in waiting.values()]

        def missed(evidence: RankEvidence, group=group, seq=seq, last=last) -> str | None:
            return f"collective {group_label(group, seq)}" if last.get(evidence.rank, seq) < seq else None

        return _waits(ranks, {rank: (flight_recorder_op(entry), group_label(group, seq))
                              for rank, entry in waiting.items()}, since, missed)
    return None


def _mismatch_verdict(what: str, ops: dict[str, list[int]]) -> Verdict:
    """`collective mismatch at #57: rank 0 in all_reduce, rank 1 in broadcast`: the minority's
    ranks are to blame, or all where no operation has more ranks than every other."""
    groups = sorted(ops.items(), key=lambda item: (-len(item[1]), min(item[1])))
    most = len(groups[0][1])
    tied = sum(len(ranks) == most for _, ranks in groups) > 1
    culprits = sorted(rank for op, ranks in groups for rank in ranks if tied or op != groups[0][0])
    parts = ", ".join(f"{_ranks(ranks)} in {op}" for op, ranks in groups)
    return Verdict(f"{what}: {parts}", tuple(culprits), "mismatch")


def _blame_the_others(ranks: list[RankEvidence], waiting: _Waits, now: float) -> Verdict | None:
    """Some ranks wait in a collective: the ranks not in it are to blame, each for what it does."""
    others = [r for r in ranks if r.rank not in waiting.where]
    if not others:
        return None
    clauses = _clauses(others, waiting, now)
    sentence = f"{_join(clauses)}; {waiting.clause()} for {'it' if len(others) == 1 else 'them'}"
    return Verdict(sentence, tuple(r.rank for r in others), _main_cause(clauses))


def _all_wait(ranks: list[RankEvidence], waiting: _Waits, now: float) -> Verdict:
    """Every rank waits in a collective: the same one, or (told apart by count) different ones."""
    places = set(waiting.where.values())
    if len(places) > 1:
        ops: dict[str, list[int]] = collections.defaultdict(list)
        for rank, (op, label) in sorted(waiting.where.items()):
            ops[f"{op} {label}"].append(rank)
        return _mismatch_verdict("ranks wait in different collectives", ops)
    ((op, label),) = places
    subject = "every rank waits" if len(ranks) > 1 else f"{_ranks([ranks[0].rank])} waits"
    return Verdict(f"{subject} in {op} {label} (for {_duration(now - waiting.since)}): "
                   "the collective itself does not complete", (), "collective")


def _each_rank(ranks: list[RankEvidence], now: float) -> Verdict:
    """No rank waits for another: what each rank is doing, to blame the ones still running."""
    clauses = _clauses(ranks, None, now)
    if not any(r.running for r in ranks):
        return Verdict(f"{_join(clauses)}, yet the call did not end", (), "unknown")
    blamed = [clause for clause in clauses if clause.kind not in ("ended", "unknown")]
    return Verdict(_join(clauses), tuple(sorted(rank for clause in blamed for rank in clause.ranks)),
                   _main_cause(blamed))


@dataclasses.dataclass
class _Clause:
    kind: str  # a Verdict's cause, or "ended"
    ranks: list[int]
    words: Callable[[bool], str]  # what follows the ranks, for one rank (False) or several (True)


def _clauses(ranks: list[RankEvidence], waiting: _Waits | None, now: float) -> list[_Clause]:
    """One clause per kind of doing, its ranks together, in the order of their first rank."""
    clauses: dict[tuple[str, str], _Clause] = {}
    for evidence in ranks:
        kind, words = _doing(evidence, waiting, now)
        clause = clauses.setdefault((kind, words(False)), _Clause(kind, [], words))
        clause.ranks.append(evidence.rank)
    return list(clauses.values())


def _join(clauses: list[_Clause]) -> str:
    shown = clauses[:_MOST_CLAUSES]
    text = [f"{_ranks(clause.ranks)} {clause.words(len(clause.ranks) > 1)}" for clause in shown]
    rest = [rank for clause in clauses[_MOST_CLAUSES:] for rank in clause.ranks]
    if rest:
        text.append(f"{_ranks(rest)} {_verb(rest, 'is', 'are')} elsewhere")
    return "; ".join(text)


def _main_cause(clauses: list[_Clause]) -> str:
    """The cause of most of the ranks to blame; between equals, of the lowest rank's."""
    if not clauses:
        return "unknown"
    count = collections.Counter()
    for clause in clauses:
        count["skipped" if clause.kind == "ended" else clause.kind] += len(clause.ranks)
    return max(count, key=lambda kind: count[kind])  # Counter keeps the first seen first among equals


def _doing(evidence: RankEvidence, waiting: _Waits | None, now: float) -> tuple[str, Callable[[bool], str]]:
    """What a rank not in a collective is doing: its kind (a cause) and the words that say it."""
    if not evidence.running:
        return "ended", lambda many: _verb(many, "has ended", "have ended")
    if evidence.unasked:
        return "unknown", lambda many: f"could not be asked ({evidence.unasked})"
    progress, frames = evidence.progress, _frames(evidence)
    if progress is None:
        where = _where(frames)
        return "unknown", lambda many: (_verb(many, "reports no progress", "report no progress")
                                        + (f"; {_verb(many, 'it is', 'they are')} {where}" if where else ""))
    called_from = f", called from {_caller(frames)}" if frames else ""
    missed = waiting.missed(evidence) if waiting else None
    # Where it is stuck in native code, the collective its peers wait in comes first.
    never = f"never entered {missed}: it " if missed else ""
    if not evidence.answered:
        fetching = f" while fetching data (for {_duration(now - progress.state_since)})" if progress.state == "data" else ""
        return "native-gil", lambda many: (f"{never}{_verb(many, 'is', 'are')} stuck in native code that holds the GIL"
                                           f"{fetching}{called_from}")
    if progress.state == "data":
        waited = _duration(now - progress.state_since)
        return "data", lambda many: f"{_verb(many, 'is', 'are')} in DataLoader.__next__ (waiting for data for {waited})"
    if (frames and is_user_code(frames[-1][0]) and not _runs_python(evidence)
            and not (waiting and waiting.passed_by(evidence))):
        # A C function's frame is not shown: its Python caller is the innermost one.
        return "native", lambda many: (f"{never}{_verb(many, 'is', 'are')} in native code{called_from} "
                                       f"({_verb(many, 'its GIL is', 'their GILs are')} free)")
    where = _where(frames)
    if missed:
        return "skipped", lambda many: (f"never entered {missed}"
                                        + (f"; {_verb(many, 'it is', 'they are')} {where}" if where else ""))
    quiet = _duration(now - max(progress.progress_at, progress.state_since))
    return "compute", lambda many: (f"{_verb(many, 'is', 'are')} computing{' ' + where if where else ''} "
                                    f"(no progress for {quiet})")


def _frames(evidence: RankEvidence) -> tuple[Frame, ...]:
    return evidence.main_frames or parse_stack(evidence.stack)


def _runs_python(evidence: RankEvidence) -> bool:
    """Whether the main thread moved between its two looks (the forensics thread's frames, then
    its stacks 50 ms later): it runs Python, where a call into native code would keep it in place."""
    dumped = parse_stack(evidence.stack)
    return bool(evidence.main_frames and dumped and evidence.main_frames[-1] != dumped[-1])


def _where(frames: Sequence[Frame]) -> str:
    """`in train.py:41` where the innermost frame is the user's; `in `wait` at train.py:41` where
    it is library code, which the user's innermost frame (train.py:41) called."""
    if not frames:
        return ""
    user = _innermost_user(frames)
    return f"in {_place(user)}" if user is frames[-1] else f"in {_caller(frames)}"


def _caller(frames: Sequence[Frame]) -> str:
    """`spin` at train.py:12: the innermost function, and the user's innermost place that led there."""
    return f"`{frames[-1][2]}` at {_place(_innermost_user(frames) or frames[-1])}"


def _innermost_user(frames: Sequence[Frame]) -> Frame | None:
    return next((frame for frame in reversed(frames) if is_user_code(frame[0])), None)


def _place(frame: Frame) -> str:
    return f"{os.path.basename(frame[0])}:{frame[1]}"


def _verb(many: bool | Sequence, one: str, several: str) -> str:
    if not isinstance(many, bool):
        many = len(many) > 1
    return several if many else one


def _ranks(ranks: Sequence[int]) -> str:
    """`rank 0`, `ranks 0 and 2`, `ranks 0, 1 and 3`, `ranks 0-5 and 7` (four or more in a row)."""
    ranks = sorted(ranks)
    runs: list[list[int]] = []
    for rank in ranks:
        if runs and rank == runs[-1][-1] + 1:
            runs[-1].append(rank)
        else:
            runs.append([rank])
    words = []
    for run in runs:
        words.extend([f"{run[0]}-{run[-1]}"] if len(run) >= 4 else map(str, run))
    return f"{_verb(ranks, 'rank', 'ranks')} {_and(words)}"


def _and(words: Sequence[str]) -> str:
    return words[0] if len(words) == 1 else f"{', '.join(words[:-1])} and {words[-1]}"


def _duration(seconds: float) -> str:
    """`0.5 s`, `94 s`, `3.5 min`, `2 h`."""
    seconds = max(seconds, 0.0)
    if seconds < 10:
        return f"{_trim(seconds)} s"
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{_trim(seconds / 60)} min"
    return f"{_trim(seconds / 3600)} h"


def _trim(value: float) -> str:
    return f"{value:.1f}".removesuffix(".0")
