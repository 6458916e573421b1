"""fetch_timeout for what fsspec does over http(s): the listing, a file's size, and a fetch where
storage options send it through fsspec. Each request gets aiohttp's deadline for the whole
request, answer included (a server that accepts and stays silent, or trickles bytes, waited
aiohttp's default of 300 s), and its expiry becomes an error naming the URL and the time waited
(fsspec raises an FSTimeoutError with no message)."""

from __future__ import annotations

import contextlib
import time
import urllib.parse
from collections.abc import Iterator


def with_deadline(url: str, storage_options: dict, fetch_timeout: float | None) -> dict:
    """`storage_options`, with each HTTP request given `fetch_timeout` seconds in all; a timeout
    the caller set in client_kwargs stays theirs, and None leaves aiohttp's own."""
    if fetch_timeout is None or urllib.parse.urlsplit(url).scheme not in ("http", "https"):
        return storage_options
    client_kwargs = dict(storage_options.get("client_kwargs") or {})
    if "timeout" in client_kwargs:
        return storage_options
    import aiohttp

    client_kwargs["timeout"] = aiohttp.ClientTimeout(total=fetch_timeout)
    return {**storage_options, "client_kwargs": client_kwargs}


def timeout_in(error: BaseException | None, words: tuple[str, ...] = ()) -> BaseException | None:
    """The error of the chain that says a request met its timeout: a TimeoutError (fsspec wraps
    aiohttp's in FSTimeoutError, or in the FileNotFoundError of a file's size that no request
    answered), or one whose message holds any of `words` (a client that says so in an OSError)."""
    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, TimeoutError) or any(word in str(error) for word in words):
            return error
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return None


@contextlib.contextmanager
def deadline_named(what: str, url: str, fetch_timeout: float | None, error_type: type[Exception]) -> Iterator[None]:
    """Turns a request's timeout inside the block into `error_type`, naming `what` of `url`,
    the deadline, and how long the block waited in all."""
    started = time.monotonic()
    try:
        yield
    except Exception as error:
        if timeout_in(error) is None:
            raise
        waited = time.monotonic() - started
        limit = (f"within fetch_timeout={fetch_timeout:g} s" if fetch_timeout is not None
                 else "within aiohttp's own deadline (fetch_timeout=None sets none of fanrun's)")
        raise error_type(f"{what} '{url}' got no whole answer from its server {limit}, after {waited:.1f} s of waiting "
                         f"in all: it did not take the connection, stayed silent, or sent too slowly. Check the server, "
                         f"or raise fetch_timeout") from error
