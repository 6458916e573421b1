"""The one check of a checkpoint's metadata that VolumeReader makes before any byte of data is
read: every item's key, and every field of where it lies, by type and by range, in fanrun's
format (layout.ItemLocation: file, offset, length, CRC32C, dtype, shape, within the file sizes
the record gives) and in DCP's (_StorageInfo: file, offset, length, transforms). Whatever the
metadata holds, a load either reads what it describes or fails here with a
CheckpointCorruptError that names the item, the field and its value; never with an error of
the engine's argument parsing, nor an index past a file's end."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata

from ..._errors import CheckpointCorruptError
from . import layout

# The engine reads at byte offsets of 64 bits (off_t): an item must end below this.
END_LIMIT = 1 << 63
CRC32C_LIMIT = 1 << 32

_REMEDY = "The metadata is damaged or was not written by fanrun: load a checkpoint you trust"


def check_is_metadata(where: str, metadata: Any) -> None:
    """What was unpickled from `where` is DCP's Metadata, with a storage_data dict."""
    if not isinstance(metadata, Metadata) or not isinstance(metadata.storage_data, dict):
        raise CheckpointCorruptError(f"'{where}' does not hold DCP's checkpoint metadata. {_REMEDY}")


def check_fanrun_items(path: str, metadata: Metadata, record: dict) -> None:
    """Every item of a fanrun checkpoint lies, whole, in a data file that its record names, and
    its bytes are what its dtype and shape say they are."""
    where = f"The metadata of checkpoint '{path}'"
    check_is_metadata(path, metadata)
    for index, location in metadata.storage_data.items():
        item = _item_name(where, index)
        if not isinstance(location, layout.ItemLocation):
            raise _corrupt(where, item, "location", location)
        if not layout.is_plain_file_name(location.file):
            raise CheckpointCorruptError(
                f"{where} names a data file {location.file!r} for {item} that does not lie directly inside the "
                f"checkpoint; nothing was read. {_REMEDY}"
            )
        if location.file not in record["files"]:
            raise CheckpointCorruptError(
                f"{where} places {item} in {location.file!r}, a file its record does not name; nothing was read. "
                f"{_REMEDY}"
            )
        _check_range(where, item, location.offset, location.length)
        size = record["files"][location.file]
        if location.offset + location.length > size:
            raise CheckpointCorruptError(
                f"{where} places {item} at bytes {location.offset}..{location.offset + location.length} of "
                f"{location.file!r}, which holds {size} bytes; nothing was read. {_REMEDY}"
            )
        if not _is_count(location.crc32c) or location.crc32c >= CRC32C_LIMIT:
            raise _corrupt(where, item, "crc32c", location.crc32c)
        _check_bytes_or_tensor(where, item, location)


def check_dcp_items(path: str, metadata: Metadata, metadata_name: str) -> None:
    """Every item of a checkpoint in DCP's format lies in a file directly inside it, at a range
    that the engine's offsets can reach, with transforms given by name."""
    where = f"'{path}/{metadata_name}'"
    check_is_metadata(f"{path}/{metadata_name}", metadata)
    for index, info in metadata.storage_data.items():
        item = _item_name(where, index)
        name = getattr(info, "relative_path", None)
        if not layout.is_plain_file_name(name):
            raise CheckpointCorruptError(
                f"{where} places {item} in {name!r}, which is not a file inside the checkpoint; nothing was read. "
                f"{_REMEDY}"
            )
        _check_range(where, item, getattr(info, "offset", None), getattr(info, "length", None))
        transforms = getattr(info, "transform_descriptors", None)
        if transforms is not None and (
            not isinstance(transforms, (list, tuple)) or not all(isinstance(t, str) for t in transforms)
        ):
            raise _corrupt(where, item, "transform_descriptors", transforms)


def _item_name(where: str, index: Any) -> str:
    fqn = getattr(index, "fqn", None)
    if not isinstance(fqn, str):
        raise CheckpointCorruptError(f"{where} holds an item whose key {index!r} names no item. {_REMEDY}")
    return f"item '{fqn}'"


def _check_range(where: str, item: str, offset: Any, length: Any) -> None:
    if not _is_count(offset):
        raise _corrupt(where, item, "offset", offset)
    if not _is_count(length):
        raise _corrupt(where, item, "length", length)
    if offset + length >= END_LIMIT:
        raise CheckpointCorruptError(
            f"{where} places {item} at bytes {offset}..{offset + length}, past any file's end; nothing was read. "
            f"{_REMEDY}"
        )


def _check_bytes_or_tensor(where: str, item: str, location: layout.ItemLocation) -> None:
    """Pickled bytes have no dtype and no shape; a tensor's dtype is torch's, its shape counts
    its elements, and its length is their bytes."""
    if location.dtype is None:
        if location.shape is not None:
            raise CheckpointCorruptError(
                f"{where} gives {item} the dtype None of pickled bytes, yet the shape {location.shape!r} of a tensor; "
                f"nothing was read. {_REMEDY}"
            )
        return
    dtype = getattr(torch, location.dtype, None) if isinstance(location.dtype, str) else None
    if not isinstance(dtype, torch.dtype):
        raise _corrupt(where, item, "dtype", location.dtype)
    if not isinstance(location.shape, tuple) or not all(_is_count(size) for size in location.shape):
        raise _corrupt(where, item, "shape", location.shape)
    expected = math.prod(location.shape) * dtype.itemsize
    if location.length != expected:
        raise CheckpointCorruptError(
            f"{where} gives {item} a length of {location.length} bytes, but its shape {location.shape} of "
            f"{location.dtype} holds {expected}; nothing was read. {_REMEDY}"
        )


def _is_count(value: Any) -> bool:
    """A non-negative int, not a bool (which is an int to isinstance)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _corrupt(where: str, item: str, field: str, value: Any) -> CheckpointCorruptError:
    return CheckpointCorruptError(f"{where} gives {item} the {field} {value!r}, which is not valid; nothing was read. {_REMEDY}")
