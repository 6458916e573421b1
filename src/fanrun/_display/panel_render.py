"""The live panel drawn: compact text rows for a terminal, and HTML for a Jupyter cell (plain
elements and inline styles, so that it shows without a widget extension, in JupyterLab,
Notebook 7, VS Code and an exported HTML file alike)."""

from __future__ import annotations

import html
import textwrap

from .panel import Panel, RankRow
from .progress_text import format_rate, format_seconds

BAR_CELLS = 20
# The latest lines of the whole call shown under a running panel.
TAIL_LINES = 6
_STATE_COLOURS = {"starting": "#777", "running": "#1565c0", "done": "#2e7d32", "failed": "#c62828", "stopped": "#777"}


def flags(panel: Panel, rank: int, now: float, stragglers: set[int]) -> list[str]:
    quiet = panel.stalled_for(rank, now)
    out = []
    if quiet is not None:
        out.append(f"no progress for {_duration(quiet)}")
    if rank in stragglers:
        out.append("straggler: under half the median rate")
    return out + panel.rows[rank].watch_flags


def _duration(seconds: float) -> str:
    if seconds >= 3600:
        return f"{seconds / 3600:.1f} h"
    if seconds >= 60:
        return f"{int(seconds // 60)} min"
    return f"{int(seconds)} s"


def gpu_words(row: RankRow) -> str:
    """'GPU 87% 41.2 GB', from the caller's NVML samples of the rank's GPU."""
    if row.gpu is None:
        return ""
    utilisation, memory_mb = row.gpu
    parts = ["GPU"]
    if utilisation is not None:
        parts.append(f"{utilisation:.0f}%")
    if memory_mb is not None:
        parts.append(f"{memory_mb / 1000:.1f} GB")
    return " ".join(parts)


def progress_words(row: RankRow) -> str:
    """'train 45/100 45% 39.8 it/s 00:01 left loss=0.25', as far as the bar and the metrics tell."""
    metrics = " ".join(part for part in (" ".join(f"{key}={value:.4g}" for key, value in list(row.metrics.items())[:3]),
                                         row.step) if part)
    progress = row.progress
    if progress is None:
        return metrics
    count = f"{progress.n:g}/{progress.total:g}" if progress.total else f"{progress.n:g}"
    parts = [progress.description, count] if progress.description else [count]
    if progress.fraction is not None:
        parts.append(f"{progress.fraction:.0%}")
    rate = format_rate(progress)
    if rate:
        parts.append(rate)
    if progress.seconds_left is not None and row.state == "running":
        parts.append(f"{format_seconds(progress.seconds_left)} left")
    if metrics:
        parts.append(metrics)
    return " ".join(parts)


def text_rows(panel: Panel, now: float, colour: bool = False, width: int | None = None) -> list[str]:
    """The title, one row per rank (and the failed rank's traceback lines below it), then the hint; with
    colour, a failed rank's lines in red and flags in yellow (for a terminal). With a width, the
    hint is wrapped to it (a row cut there would cut the command it gives); the other rows are
    the caller's to cut."""
    red, yellow, reset = ("\x1b[31m", "\x1b[33m", "\x1b[0m") if colour else ("", "", "")
    stragglers = panel.stragglers()
    # The title is wrapped as the hint is: a cut would cut the run's id.
    rows = textwrap.wrap(panel.title, width, break_on_hyphens=False) if panel.title and width else \
        [panel.title] if panel.title else []
    for rank, row in enumerate(panel.rows):
        fraction = row.progress.fraction if row.progress is not None else None
        bar = ""
        if fraction is not None:
            filled = round(fraction * BAR_CELLS)
            bar = "[" + "#" * filled + "." * (BAR_CELLS - filled) + "] "
        warned = " ".join(flags(panel, rank, now, stragglers))
        status = " ".join(part for part in (bar + progress_words(row), yellow + warned + reset if warned else "") if part)
        last = row.last_line or (row.bar_text if row.progress is None else "")
        gpu = f" ({gpu_words(row)})" if row.gpu is not None else ""
        line = f"rank {rank}  {row.where}{gpu}  {row.state:<8} {status}" + (f"  | {last}" if last else "")
        rows.append(red + line + reset if row.state == "failed" else line)
        rows.extend(f"{red}    {failure}{reset}" for failure in row.failure)
    if panel.stall:  # until progress resumes: at the end too, where the stall ended the call
        stall = f"stalled: {panel.stall}"
        rows.extend(yellow + line + reset for line in (textwrap.wrap(stall, width) if width else [stall]))
    for line in panel.run_hint.splitlines():
        rows.extend(textwrap.wrap(line, width, break_on_hyphens=False) if width else [line])
    return rows


def html_panel(panel: Panel, now: float) -> str:
    stragglers = panel.stragglers()
    cells = "padding:2px 8px;text-align:left;vertical-align:top"
    head = "".join(f'<th style="{cells}">{name}</th>'
                   for name in ("rank", "where", "state", "progress", "", "last line"))
    body = "".join(_html_row(panel, rank, row, now, stragglers, cells) for rank, row in enumerate(panel.rows))
    hint = (f'<div style="color:#666;margin-top:4px;white-space:pre-line">{html.escape(panel.run_hint)}</div>'
            if panel.run_hint else "")
    title = (f'<div class="fanrun-title" style="font-weight:bold;margin-bottom:4px">{html.escape(panel.title)}</div>'
             if panel.title else "")
    plot = (f'<img class="fanrun-plot" alt="the metrics the ranks logged, by step" '
            f'src="data:image/png;base64,{panel.plot_png}">' if panel.plot_png else "")
    stall = (f'<div class="fanrun-stall" style="color:#e65100;margin-top:4px">&#9888; stalled: '
             f'{html.escape(panel.stall)}</div>' if panel.stall else "")
    return (f'<div class="fanrun-panel" style="font-family:var(--jp-code-font-family,monospace);font-size:12px">'
            f'{title}<table style="border-collapse:collapse"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'
            f'{plot}{stall}{hint}{_html_logs(panel)}</div>')


def _html_logs(panel: Panel) -> str:
    """While ranks run, the latest lines, always shown: the panel is drawn anew every second, and
    a collapsed block would snap shut under the reader each time. Once the call ended, the panel is
    drawn no more, so the kept lines go into a block the reader opens."""
    if not panel.ended:
        tail = list(panel.logs)[-TAIL_LINES:]
        return (f'<pre class="fanrun-tail" style="margin:4px 0;color:#444">'
                f'{html.escape(chr(10).join(f"[rank{rank}]: {text}" for rank, text in tail))}</pre>' if tail else "")
    logs = "\n".join(f"[rank{rank}]: {text}" for rank, text in panel.logs)
    shown = f"last {len(panel.logs)} of {panel.lines_seen} lines" if panel.lines_seen > len(panel.logs) else \
        f"{panel.lines_seen} lines"
    return (f'<details class="fanrun-logs"><summary>Logs ({shown})</summary>'
            f'<pre style="max-height:30em;overflow:auto">{html.escape(logs)}</pre></details>')


def _html_row(panel: Panel, rank: int, row: RankRow, now: float, stragglers: set[int], cells: str) -> str:
    fraction = row.progress.fraction if row.progress is not None else None
    meter = (f'<progress value="{fraction:.4f}" max="1" style="width:10em"></progress>' if fraction is not None
             else html.escape(row.bar_text if row.progress is None else ""))
    warnings = flags(panel, rank, now, stragglers)
    warning = "".join(f'<div class="fanrun-flag" style="color:#e65100">&#9888; {html.escape(w)}</div>' for w in warnings)
    failure = (f'<pre class="fanrun-failure" style="margin:2px 0;color:#c62828;white-space:pre-wrap">'
               f'{html.escape(chr(10).join(row.failure))}</pre>' if row.failure else "")
    background = "background:#fdecea;" if row.state == "failed" else ""
    colour = _STATE_COLOURS.get(row.state, "#000")
    return (f'<tr class="fanrun-rank" data-rank="{rank}" data-state="{row.state}" '
            f'data-fraction="{"" if fraction is None else f"{fraction:.4f}"}" style="{background}">'
            f'<td style="{cells}">{rank}</td><td style="{cells}">{html.escape(row.where)}'
            f'<div class="fanrun-gpu" style="color:#555">{html.escape(gpu_words(row))}</div></td>'
            f'<td style="{cells};color:{colour};font-weight:bold">{row.state}</td>'
            f'<td style="{cells}">{meter}</td><td style="{cells}">{html.escape(progress_words(row))}{warning}</td>'
            f'<td style="{cells};max-width:40em;overflow:hidden;white-space:nowrap;text-overflow:ellipsis">'
            f'{html.escape(row.last_line)}{failure}</td></tr>')
