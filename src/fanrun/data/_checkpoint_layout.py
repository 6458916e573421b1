"""What a fanrun checkpoint looks like on storage, and which checkpoints under a root are complete.

A checkpoint is a directory (or, for fsspec URLs, a prefix) holding:

- ``r<rank>-<save_id>.data``: each rank's items, raw bytes at 4 KiB-aligned offsets;
- ``metadata-<save_id>.pkl``: DCP's ``Metadata``, whose storage_data gives every item's
  file, offset, length, CRC32C, dtype and shape;
- ``fanrun-checkpoint.json``: the record, written last, naming the metadata and data files
  with their sizes and the time of publication.

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
RECORD_VERSION = 1
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


def make_record(save_id: str, world_size: int, files: dict[str, int]) -> dict:
    return {
        "format": RECORD_FORMAT,
        "version": RECORD_VERSION,
        "save_id": save_id,
        "published_ns": time.time_ns(),
        "world_size": world_size,
        "metadata": metadata_file_name(save_id),
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
    if record.get("version") != RECORD_VERSION:
        raise ValueError(
            f"{where} has version {record.get('version')!r}; this fanrun reads version {RECORD_VERSION}"
        )
    for key, kind in (("save_id", str), ("published_ns", int), ("metadata", str), ("files", dict)):
        if not isinstance(record.get(key), kind):
            raise ValueError(f"{where} lacks a valid {key!r}")
    return record
