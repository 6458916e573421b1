"""fetch_timeout for a remote table: what each client is told, and the error a timeout becomes.

Over http(s) fsspec reads the listing and the footers (each request within fetch_timeout in all,
_fsspec_deadline.py) and the engine fetches the files. Over s3:// pyarrow reads the listing, the
footers and the files, with connect_timeout and request_timeout; pyarrow's AWS client makes the
latter a minimum rate (less than a byte a second for that long fails), so a server that trickles
a byte a second is not cut short by it. deltalake (object_store) reads a Delta log, with its
"timeout" for each request in all and "retry_timeout" for its retries of one request. The S3
clients' limits are only ever shortened to fetch_timeout: theirs are seconds to minutes, where the
default fetch_timeout is an hour for a whole file over http(s). None of the clients says in its
error which limit it met; the error raised here does."""

from __future__ import annotations

import contextlib
import re
import time
import urllib.parse
from collections.abc import Iterator

from .._errors import TableError
from ._fsspec_deadline import timeout_in

# How the clients' own errors say that a request met its timeout: pyarrow's AWS client (libcurl's
# CURLE_OPERATION_TIMEDOUT) and object_store (reqwest) put it in the message of an OSError.
_TIMEOUT_WORDS = ("curlCode: 28", "Timeout was reached", "operation timed out")
# object_store's client settings, which deltalake takes in storage_options and pyarrow has no use for.
DELTA_CLIENT_KEYS = {"timeout", "connect_timeout", "retry_timeout", "max_retries", "pool_idle_timeout"}
# object_store's own limits: a request in all, and the retries of one request.
_OBJECT_STORE_TIMEOUTS_S = {"timeout": 30.0, "retry_timeout": 180.0}


def delta_options(uri: str, storage_options: dict, fetch_timeout: float | None) -> dict:
    """deltalake's storage_options for a remote table: each request, and one request's retries
    together, within fetch_timeout where it is shorter than object_store's own limits (so the
    default hour lengthens none); a limit the caller set in the dict stays theirs."""
    scheme = urllib.parse.urlsplit(uri).scheme if "://" in uri else ""
    if fetch_timeout is None or scheme in ("", "file"):
        return storage_options
    given = {str(key).lower() for key in storage_options}
    duration = f"{max(1, round(fetch_timeout * 1000))}ms"  # humantime, as object_store reads it
    limits = {key: duration for key, default in _OBJECT_STORE_TIMEOUTS_S.items()
              if key not in given and fetch_timeout < default}
    return {**storage_options, **limits}


@contextlib.contextmanager
def waits_named(what: str, url: str, fetch_timeout: float | None, error_type: type[Exception] = TableError) -> Iterator[None]:
    """Turns a request's timeout inside the block into `error_type`, naming `what` of `url`, the
    limit, how long the block waited in all, and the client's own words. One named so by an
    inner block (a file's footer, within the table's opening) passes through as it is."""
    started = time.monotonic()
    try:
        yield
    except Exception as error:
        timeout = None if getattr(error, "fetch_timeout_named", False) else timeout_in(error, _TIMEOUT_WORDS)
        if timeout is None:
            raise
        waited = time.monotonic() - started
        limit = (f"within fetch_timeout={fetch_timeout:g} s for each request" if fetch_timeout is not None
                 else "within its client's own timeout (fetch_timeout=None sets none of fanrun's)")
        named = error_type(f"{what} '{url}' got no whole answer from its server {limit}, after {waited:.1f} s of "
                           f"waiting in all (retries included): the server did not take the connection, stayed "
                           f"silent, or sent too slowly. Check the server, or raise fetch_timeout "
                           f"({type(timeout).__name__}: {_client_words(timeout)})")
        named.fetch_timeout_named = True
        raise named from error


def _client_words(error: BaseException) -> str:
    """The client's message on one line: object_store's spreads its causes over several, coloured."""
    plain = re.sub(r"\x1b\[[0-9;]*m", "", str(error))
    text = " ".join(line.strip().lstrip("↳ ") for line in plain.splitlines() if line.strip())
    return (text[:400] + " ...") if len(text) > 400 else (text or "no message")
