"""What follows a stall report, as the call's on_stall asks: the report is kept in the attempt's
run directory (which tracking uploads with the logs) and in the run's record (`fanrun stacks ID`
reads it there, during the run and after), and shown; then "abort" stops the call with
RankStalledError, and a function is given the report."""

from __future__ import annotations

from collections.abc import Callable

from .._display.output import OutputMux
from .._errors import RankStalledError
from .._spec.paths import RunPaths
from .records import RunRecord
from .stall_report import REPORT_JSON, REPORT_TEXT, StallReport


def handler(on_stall, paths: RunPaths, record: RunRecord) -> Callable[[StallReport, OutputMux], None] | None:
    """What run.run() calls with each stall's report; None where the call is not watched."""
    if on_stall is None:
        return None

    def handle(report: StallReport, mux: OutputMux) -> None:
        text, data = report.to_text().encode(), report.to_json().encode()
        for write in (paths.write_file, record.write_bytes):
            write(REPORT_JSON, data)
            write(REPORT_TEXT, text)
        mux.stall(report, f"fanrun stacks {report.run_id} shows every rank's evidence; {paths.directory / REPORT_TEXT}")
        if on_stall == "abort":
            raise RankStalledError(f"run {report.run_id} stalled, and on_stall='abort' stopped it: {report.sentence} "
                                   f"(no progress for {report.quiet_s:.0f} s). Every rank's stacks and last "
                                   f"collectives: {paths.directory / REPORT_TEXT}", report=report)
        if callable(on_stall):
            on_stall(report)

    return handle
