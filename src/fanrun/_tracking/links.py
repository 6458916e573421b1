"""A call's MLflow run as the user sees it: the line (or, in Jupyter, the link) that names it and
says where to open it."""

from __future__ import annotations

import dataclasses
import html
import sys
import urllib.parse
from typing import Any

from . import store as tracking_store


@dataclasses.dataclass
class TrackedRun:
    client: Any  # the agent's MlflowClient; None in the caller
    run_id: str
    run_name: str
    experiment_id: str
    experiment_name: str
    tracking_uri: str
    first_system_step: int
    registry_uri: str = ""
    # A `fanrun ui` server showing this run's local store, when one answered at the start.
    ui_url: str | None = None


def run_url(run: TrackedRun) -> str | None:
    """The run's page in a UI: the tracking server's own (it serves at the tracking URI), or a
    `fanrun ui` server showing the local store."""
    if run.tracking_uri.startswith(("http://", "https://")):
        base = masked(run.tracking_uri)
    elif run.ui_url is not None:
        base = run.ui_url
    else:
        return None
    return f"{base.rstrip('/')}/#/experiments/{run.experiment_id}/runs/{run.run_id}"


def link_text(run: TrackedRun) -> str:
    where = run_url(run)
    if where is None:
        uri = masked(run.tracking_uri)
        if tracking_store.is_default_store(run.tracking_uri):
            where = "run `fanrun ui` to open it"
        elif tracking_store.is_local(run.tracking_uri):
            where = f"run `fanrun ui --backend-store-uri {uri}` to open it"
        else:
            where = f"tracking URI {uri}"
    return f"fanrun: MLflow run {run.run_name} ({run.run_id}) in experiment {run.experiment_name}: {where}"


def masked(uri: str) -> str:
    """The URI without a password, for printing: a database or server URI may carry one."""
    parts = urllib.parse.urlsplit(uri)
    if parts.password is None:
        return uri
    netloc = f"{parts.username}:***@" + parts.netloc.rpartition("@")[2]
    return urllib.parse.urlunsplit(parts._replace(netloc=netloc))


def link_html(run: TrackedRun) -> str | None:
    url = run_url(run)
    if url is None:
        return None
    return (
        f"fanrun: MLflow run <a href=\"{html.escape(url, quote=True)}\" target=\"_blank\" rel=\"noopener\">"
        f"{html.escape(run.run_name)}</a> ({html.escape(run.run_id)}) in experiment "
        f"{html.escape(run.experiment_name)}"
    )


def announce(run: TrackedRun) -> None:
    markup = link_html(run)
    if markup is not None and in_jupyter_kernel():
        try:
            from IPython.display import HTML, display

            display(HTML(markup))
            return
        except Exception:
            pass  # a front end that cannot show HTML still gets the line below
    # One write: the line comes from a thread while rank output is being written.
    sys.stdout.write(link_text(run) + "\n")
    sys.stdout.flush()


def in_jupyter_kernel() -> bool:
    # Only where IPython is already loaded: a plain script never pays for importing it.
    ipython = sys.modules.get("IPython")
    if ipython is None:
        return False
    shell = ipython.get_ipython()
    return shell is not None and getattr(shell, "kernel", None) is not None
