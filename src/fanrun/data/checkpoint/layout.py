"""What a fanrun checkpoint looks like on storage, and which checkpoints under a root are complete.

A checkpoint is a directory (or, for fsspec URLs, a prefix) holding:

- ``r<rank>-<save_id>.data``: each rank's items, raw bytes at 4 KiB-aligned offsets;
- ``metadata-<save_id>.pkl``: DCP's ``Metadata``, whose storage_data gives every item's
  file, offset, length, CRC32C, dtype and shape;
- ``fanrun-checkpoint.json``: the record, written last, naming the metadata and data files
  with their sizes and the time of publication, and giving the metadata's size and CRC32C, so
  that a damaged metadata file is refused before it is unpickled (records of version 1, written
  before, carry neither and are read without that check).

Every file name read from the record or the metadata must name a file directly inside the
checkpoint (``is_plain_file_name``); every other field of every item is checked too, by type and
range, before anything is read (metadata_checks.py).

Locally the whole directory appears at its name by one atomic rename; on object stores the
record is the last object written, so it is the commit marker (data and metadata names carry
the save id, so a save never overwrites the files of the checkpoint it replaces).
"""

from __future__ import annotations

import dataclasses
import json
import os
import time

RECORD_NAME = "fanrun-checkpoint.json"
RECORD_FORMAT = "fanrun-checkpoint"
RECORD_VERSION = 2
# Records of this version give no checksum of the metadata; they are still read.
UNCHECKED_RECORD_VERSION = 1
# Items start at multiples of this, so that chunks written by different threads never share a page.
ALIGNMENT = 4096
# Hidden siblings of a target: a save in progress, or a replaced/pruned checkpoint being removed.
PARTIAL_MARK = ".fanrun-partial-"
REMOVING_MARK = ".fanrun-removing-"
LOCK_SUFFIX = ".lock"


@dataclasses.dataclass(frozen=True)
class ItemLocation:
    """Where one saved item lies; DCP keeps it in Metadata.storage_data."""

    file: str
    offset: int
    length: int
    crc32c: int
    dtype: str | None = None  # torch dtype name for tensors ("float32"); None for pickled bytes
    shape: tuple[int, ...] | None = None


@dataclasses.dataclass(frozen=True)
class RankTarget:
    """What the coordinator tells each rank in its global plan: where to write, under which name."""

    save_id: str
    staging_dir: str | None  # the local partial directory; None for URLs (each rank stages locally)
    file_name: str


def data_file_name(rank: int, save_id: str) -> str:
    return f"r{rank}-{save_id}.data"


def metadata_file_name(save_id: str) -> str:
    return f"metadata-{save_id}.pkl"


def is_own_file_name(name: str) -> bool:
    """A name fanrun writes inside a checkpoint."""
    return (
        name == RECORD_NAME
        or (name.startswith("metadata-") and name.endswith(".pkl"))
        or (name.startswith("r") and name.endswith(".data"))
    )


def aligned(offset: int) -> int:
    return (offset + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT


def partial_dir(target: str, save_id: str) -> str:
    parent, name = os.path.split(os.path.abspath(target))
    return os.path.join(parent, f".{name}{PARTIAL_MARK}{save_id}")


def removing_dir(target: str, save_id: str) -> str:
    parent, name = os.path.split(os.path.abspath(target))
    return os.path.join(parent, f".{name}{REMOVING_MARK}{save_id}")


def is_leftover_name(name: str) -> bool:
    return name.startswith(".") and (PARTIAL_MARK in name or REMOVING_MARK in name)


def is_plain_file_name(name: object) -> bool:
    """Whether a name read from a checkpoint names a file directly inside it: one path component,
    not '.' or '..', with no separator and no control character (NUL included)."""
    return (
        isinstance(name, str)
        and name not in ("", ".", "..")
        and not any(c in "/\\" or ord(c) < 0x20 or ord(c) == 0x7F for c in name)
    )


def make_record(
    save_id: str, world_size: int, files: dict[str, int], metadata_size: int, metadata_crc32c: int
) -> dict:
    return {
        "format": RECORD_FORMAT,
        "version": RECORD_VERSION,
        "save_id": save_id,
        "published_ns": time.time_ns(),
        "world_size": world_size,
        "metadata": metadata_file_name(save_id),
        "metadata_size": metadata_size,
        "metadata_crc32c": metadata_crc32c,
        "files": files,
    }


def parse_record(text: str | bytes, where: str) -> dict:
    """The record's fields, or ValueError saying what is wrong with it."""
    try:
        record = json.loads(text)
    except ValueError as error:
        raise ValueError(f"{where} is not valid JSON ({error})") from None
    if not isinstance(record, dict) or record.get("format") != RECORD_FORMAT:
        raise ValueError(f"{where} is not a fanrun checkpoint record")
    if record.get("version") not in (RECORD_VERSION, UNCHECKED_RECORD_VERSION):
        raise ValueError(
            f"{where} has version {record.get('version')!r}; this fanrun reads versions "
            f"{UNCHECKED_RECORD_VERSION} and {RECORD_VERSION}"
        )
    keys = [("save_id", str), ("published_ns", int), ("metadata", str), ("files", dict)]
    if record["version"] == RECORD_VERSION:
        keys += [("metadata_size", int), ("metadata_crc32c", int)]
    for key, kind in keys:
        if not isinstance(record.get(key), kind) or (kind is int and record[key] < 0):
            raise ValueError(f"{where} lacks a valid {key!r}")
    if record["version"] == RECORD_VERSION and record["metadata_crc32c"] >= 1 << 32:
        raise ValueError(f"{where} lacks a valid 'metadata_crc32c'")
    for name in [record["metadata"], *record["files"]]:
        if not is_plain_file_name(name):
            raise ValueError(f"{where} names a file {name!r} that does not lie directly inside the checkpoint")
    for name, size in record["files"].items():
        if not isinstance(size, int) or size < 0:
            raise ValueError(f"{where} gives file {name!r} an invalid size {size!r}")
    return record
