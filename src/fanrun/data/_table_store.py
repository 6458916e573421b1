"""Where a table lives: the pyarrow filesystem its files are read through and its path there.

One `storage_options` dict serves both readers of a Delta table: deltalake (delta-rs) reads
the log with it, pyarrow the Parquet files. Its keys are delta-rs's; for `s3://` they are
turned into pyarrow's S3 settings here, so that a custom endpoint (MinIO, R2, a test server)
and credentials given in the dict reach both. Other URLs pyarrow knows (`gs://`, `hdfs://`,
`abfs://`) take their credentials from the environment, which both readers look in; any other
URL is served by fsspec, with the dict as its options.
"""

from __future__ import annotations

import dataclasses
import os
import urllib.parse
from typing import Any

from .._errors import TableError
from ._fsspec_deadline import with_deadline
from ._table_deadline import DELTA_CLIENT_KEYS


@dataclasses.dataclass(frozen=True)
class Store:
    filesystem: Any  # a pyarrow.fs.FileSystem
    root: str  # the table's path on it
    by_fsspec: bool  # fsspec serves the URL: pyarrow has no filesystem of its own for it
    endpoint: str  # an S3-compatible store's endpoint, "" for the default: the cache tells stores apart by it


# delta-rs's S3 keys (lower case, as it also takes them), grouped by the pyarrow setting they give.
_S3_KEYS = {
    "access_key": ("aws_access_key_id", "access_key_id"),
    "secret_key": ("aws_secret_access_key", "secret_access_key"),
    "session_token": ("aws_session_token", "session_token", "aws_token", "token"),
    "region": ("aws_region", "region", "aws_default_region", "default_region"),
    "endpoint": ("aws_endpoint_url", "aws_endpoint", "endpoint_url", "endpoint"),
    "allow_http": ("aws_allow_http", "allow_http"),
    "anonymous": ("aws_skip_signature", "skip_signature"),
    "virtual_hosted": ("aws_virtual_hosted_style_request", "virtual_hosted_style_request"),
}
# The AWS client's own limits, which pyarrow keeps unless told: to connect, and a request's stall.
_AWS_CLIENT_TIMEOUTS_S = {"connect_timeout": 1.0, "request_timeout": 3.0}
# delta-rs's keys for writing and committing: nothing a reader needs.
_S3_WRITE_KEYS = {"aws_s3_allow_unsafe_rename", "aws_s3_locking_provider", "aws_conditional_put", "conditional_put",
                  "aws_copy_if_not_exists", "copy_if_not_exists", "dynamo_lock_table_name", "delta_dynamo_table_name"}


def open_store(uri: str, storage_options: dict, fetch_timeout: float | None) -> Store:
    """The table's store, each of its requests within fetch_timeout seconds where its client takes
    a limit (http(s) through fsspec, s3 through pyarrow; None: the clients' own)."""
    import pyarrow.fs

    scheme = urllib.parse.urlsplit(uri).scheme if "://" in uri else ""
    if scheme == "s3":
        return _s3(uri, storage_options, fetch_timeout)
    try:
        filesystem, root = pyarrow.fs.FileSystem.from_uri(uri if scheme else os.path.abspath(uri))
        return Store(filesystem, root, False, "")
    except Exception as error:
        native_error = error
    try:
        import fsspec

        fs, root = fsspec.core.url_to_fs(uri, **with_deadline(uri, storage_options, fetch_timeout))
    except Exception as error:
        raise TableError(f"table {uri}: cannot open its filesystem ({native_error}; fsspec: {error})") from None
    return Store(pyarrow.fs.PyFileSystem(pyarrow.fs.FSSpecHandler(fs)), root, True, "")


def _s3(uri: str, storage_options: dict, fetch_timeout: float | None) -> Store:
    import pyarrow.fs

    settings = _s3_settings(uri, storage_options)
    if fetch_timeout is not None:
        # Shortened to fetch_timeout, never lengthened: the AWS client's request_timeout is a
        # stall limit (less than a byte a second for that long), so an hour of it would hold a
        # silent store 3 attempts of an hour where its default gives up within seconds.
        settings.update({setting: float(fetch_timeout) for setting, default in _AWS_CLIENT_TIMEOUTS_S.items()
                         if fetch_timeout < default})
    endpoint = settings.pop("endpoint", "")
    if endpoint:
        parts = urllib.parse.urlsplit(endpoint if "://" in endpoint else f"https://{endpoint}")
        settings["endpoint_override"] = parts.netloc + parts.path.rstrip("/")
        settings["scheme"] = parts.scheme
    if settings.pop("allow_http", "false").lower() not in ("true", "1") and settings.get("scheme") == "http":
        raise TableError(f"table {uri}: storage_options give the plain-http endpoint {endpoint}, which delta-rs "
                         f"refuses without AWS_ALLOW_HTTP='true': add it, or use an https endpoint")
    settings["anonymous"] = settings.get("anonymous", "false").lower() in ("true", "1")
    settings["force_virtual_addressing"] = settings.pop("virtual_hosted", "false").lower() in ("true", "1")
    location = urllib.parse.urlsplit(uri)
    if not endpoint and "region" not in settings and not os.environ.get("AWS_REGION", os.environ.get("AWS_DEFAULT_REGION")):
        try:  # AWS itself, no region given: the bucket's, as pyarrow's from_uri finds it
            settings["region"] = pyarrow.fs.resolve_s3_region(location.netloc)
        except Exception:
            pass  # pyarrow's default region; a wrong one is named in the first read's error
    try:
        filesystem = pyarrow.fs.S3FileSystem(**settings)
    except Exception as error:
        raise TableError(f"table {uri}: cannot open its S3 store ({type(error).__name__}: {error})") from None
    # An endpoint set in the environment, which both readers look in, names the store as well.
    named = endpoint or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL", "")
    return Store(filesystem, f"{location.netloc}{location.path}".rstrip("/"), False, named)


def _s3_settings(uri: str, storage_options: dict) -> dict[str, str]:
    by_key = {key: setting for setting, keys in _S3_KEYS.items() for key in keys}
    settings: dict[str, str] = {}
    for key, value in storage_options.items():
        name = str(key).lower()
        if name in _S3_WRITE_KEYS or name in DELTA_CLIENT_KEYS:
            continue
        if name not in by_key:
            known = ", ".join(keys[0].upper() for keys in _S3_KEYS.values())
            raise TableError(f"table {uri}: storage_options has {key!r}, which the S3 reader does not take; it takes "
                             f"delta-rs's keys {known} (or their short forms). Credentials the keys do not cover come "
                             f"from the environment (AWS_PROFILE, AWS_WEB_IDENTITY_TOKEN_FILE, instance roles)")
        settings[by_key[name]] = str(value)
    return settings
