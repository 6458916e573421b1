"""The dataset's side of the native file cache: where it lives, how big it may be, how
files are named in it, and how remote files are fetched into it."""

from __future__ import annotations

import errno
import hashlib
import math
import os
import re

from .. import _core
from .._errors import CacheLimitError
from .._private_dir import open_private_dir
from ._fsspec_deadline import deadline_named, with_deadline

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def default_cache_dir() -> str:
    """One directory per user and node, shared by runs, so that a second run starts warm:
    $FANRUN_CACHE_DIR, or fanrun/data in the user's cache directory ($XDG_CACHE_HOME, or
    ~/.cache where that is unset or not absolute, as the XDG base directory rules say)."""
    explicit = os.environ.get("FANRUN_CACHE_DIR")
    if explicit:
        return explicit
    base = os.environ.get("XDG_CACHE_HOME", "")
    if not os.path.isabs(base):
        base = os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "fanrun", "data")


CACHE_DIR_REMEDY = ("Give VolumeDataset a cache_dir (or set FANRUN_CACHE_DIR to one) that belongs to you and only "
                    "you can write, or leave both unset for fanrun/data under $XDG_CACHE_HOME or ~/.cache.")


def open_cache_dir(path: str) -> int:
    """A descriptor of the cache directory, made (0700) where missing; refused with
    UnsafePathError where another user owns it or could write it, or a directory above it."""
    return open_private_dir(path, what="The cache directory", remedy=CACHE_DIR_REMEDY)


def parse_byte_size(value: int | str | None) -> int:
    """'20GB', '512MiB', 1000 (bytes); None or 0: unbounded (returned as 0)."""
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise TypeError(f"cache_limit must be a number of bytes or a string such as '20GB', not {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"cache_limit must not be negative, not {value}")
        return value
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*", value)
    if match is None or match.group(2).upper() not in _UNITS:
        raise ValueError(f"cache_limit {value!r} is not a size such as '20GB', '512MiB' or '1000000'")
    return int(float(match.group(1)) * _UNITS[match.group(2).upper()])


def cache_name(source: str) -> str:
    """A file name unique to the source that keeps its base name, so that a transform can
    still go by the extension."""
    digest = hashlib.sha256(source.encode()).hexdigest()[:20]
    base = re.sub(r"[^A-Za-z0-9._-]", "_", source.rstrip("/").rsplit("/", 1)[-1]).lstrip(".")[-80:]
    return f"{digest}-{base}" if base else digest


def check_cache_limit(limit: int, readers: int, files_held: int, largest_file: int, prefetch: int) -> None:
    needed = readers * files_held * largest_file
    if limit and limit < needed:
        raise CacheLimitError(
            f"cache_limit={limit} bytes is below the {needed} bytes this dataset needs on this node: "
            f"{readers} reader(s) (local ranks x DataLoader workers) each hold up to {files_held} files "
            f"(prefetch={prefetch} ahead, plus those in use) of up to {largest_file} bytes. "
            f"Raise cache_limit to at least {needed}, or lower prefetch."
        )


def native_http_allowed(storage_options: dict) -> bool:
    """Whether the engine may fetch http(s):// sources itself: not when fsspec has a say the
    engine would ignore, storage options (headers, authentication, client settings). A proxy
    in the environment is no reason: libcurl follows http_proxy, https_proxy, all_proxy and
    no_proxy itself."""
    return not storage_options


def engine_fetches(source: str, storage_options: dict) -> bool:
    """Whether the engine's own HTTP client fetches `source` (which sources it takes, the engine
    decides: _core.engine_fetches); fsspec fetches every other remote source."""
    return native_http_allowed(storage_options) and _core.engine_fetches(source)


def check_fetch_timeout(fetch_timeout: float | None) -> None:
    """Refuses a fetch_timeout that is no number of seconds (VolumeDataset's and TableDataset's)."""
    if fetch_timeout is not None and (isinstance(fetch_timeout, bool) or not isinstance(fetch_timeout, (int, float))
                                      or not fetch_timeout > 0):
        raise ValueError(f"fetch_timeout must be a number of seconds above 0, or None for no deadline, not {fetch_timeout!r}")


# Where Linux distributions keep their bundle of certificate authorities (the list Go's
# crypto/x509 reads). The wheel's libcurl was built on a RHEL-like system and, left alone,
# looks only at that one's path, which Debian, Ubuntu, Alpine or SUSE do not have.
_SYSTEM_CA_FILES = (
    "/etc/ssl/certs/ca-certificates.crt",  # Debian, Ubuntu, Gentoo, Arch
    "/etc/pki/tls/certs/ca-bundle.crt",  # Fedora, RHEL 6
    "/etc/ssl/ca-bundle.pem",  # openSUSE
    "/etc/pki/tls/cacert.pem",  # OpenELEC
    "/etc/pki/ca-trust/extracted/pem/tls-ca-bundle.pem",  # CentOS, RHEL 7 and later
    "/etc/ssl/cert.pem",  # Alpine
)


def system_ca_file() -> str:
    """The system's bundle of certificate authorities, or "" where none of the known ones is."""
    return next((path for path in _SYSTEM_CA_FILES if os.path.isfile(path)), "")


def engine_http_options(fetch_timeout: float | None, min_fetch_rate: tuple[int, float] | None) -> dict:
    """The engine's HTTP limits, as _core.FileCache takes them, and the certificate
    authorities it trusts for https: the file named by CURL_CA_BUNDLE or else SSL_CERT_FILE,
    the directory named by SSL_CERT_DIR; the system's bundle where none is set."""
    check_fetch_timeout(fetch_timeout)
    rate, seconds = (0, 0.0) if min_fetch_rate is None else _rate(min_fetch_rate)
    return {
        "fetch_timeout_s": float(fetch_timeout or 0.0),
        "min_rate_bytes": rate,
        "min_rate_seconds": math.ceil(seconds),  # libcurl counts whole seconds
        "ca_file": os.environ.get("CURL_CA_BUNDLE") or os.environ.get("SSL_CERT_FILE")
                   or ("" if os.environ.get("SSL_CERT_DIR") else system_ca_file()),
        "ca_dir": os.environ.get("SSL_CERT_DIR") or "",
    }


def _rate(value) -> tuple[int, float]:
    try:
        rate, seconds = value
    except (TypeError, ValueError):
        rate = seconds = None
    if isinstance(rate, bool) or not isinstance(rate, int) or rate < 1 or isinstance(seconds, bool) \
            or not isinstance(seconds, (int, float)) or not seconds > 0:
        raise ValueError(f"min_fetch_rate must be (bytes per second, seconds), such as (1024, 60), or None, not {value!r}")
    return rate, float(seconds)


class FsspecFetch:
    """Writes one remote file to a local path; called by the cache's native threads, which
    take the GIL only around this call. Where the listing gave an MD5, the bytes written must
    have it, or the fetch fails (and is tried again) before the engine moves the file in."""

    def __init__(self, storage_options: dict, checksums: dict[str, str], fetch_timeout: float | None = None) -> None:
        self._storage_options = storage_options
        self._checksums = checksums
        self._fetch_timeout = fetch_timeout  # for each request over http(s)

    def __call__(self, source: str, partial_path: str) -> None:
        import fsspec

        fs, path = fsspec.core.url_to_fs(source, **with_deadline(source, self._storage_options, self._fetch_timeout))
        try:
            with deadline_named("The fetch of", source, self._fetch_timeout, TimeoutError):
                fs.get_file(path, partial_path)
        except OSError as error:
            if error.errno in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT):
                raise OSError(error.errno, f"{error.strerror} writing '{partial_path}': the cache's filesystem is full: "
                                           "free space there, lower cache_limit, or choose another cache_dir") from error
            raise
        expected = self._checksums.get(source)
        if expected is not None:
            digest = hashlib.md5(usedforsecurity=False)
            with open(partial_path, "rb") as file:
                while chunk := file.read(1 << 20):
                    digest.update(chunk)
            if digest.hexdigest() != expected:
                raise OSError(errno.EIO, f"MD5 {digest.hexdigest()} of the bytes fetched from '{source}' is not the "
                                         f"{expected} its store lists")
