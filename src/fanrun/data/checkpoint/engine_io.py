"""What the checkpoint writer and reader share: the engine's I/O options, batching, item labels,
and the durable write of a small file through the engine."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch

from ... import _core

DEFAULT_THREADS = 8
# Device tensors are copied to host memory and written in batches of about this size; host
# tensors, which need no copy, in batches this many times larger (each batch ends with every
# thread waiting for the last chunk, so fewer is faster).
BATCH_BYTES = 256 << 20
HOST_BATCH_FACTOR = 16


def check_io_options(thread_count: int, chunk_bytes: int) -> None:
    """The engine options VolumeWriter and VolumeReader share, checked before any I/O."""
    if not isinstance(thread_count, int) or thread_count < 1:
        raise ValueError(f"thread_count must be a positive int, got {thread_count!r}")
    if not isinstance(chunk_bytes, int) or chunk_bytes < 1:
        raise ValueError(f"chunk_bytes must be a positive int, got {chunk_bytes!r}")


def batches(entries: list, batch_bytes: int, size: Callable[[Any], int] = lambda entry: entry.size) -> list[list]:
    """The entries in runs of about batch_bytes, in order."""
    runs: list[list] = []
    total = batch_bytes
    for entry in entries:
        if total >= batch_bytes:
            runs.append([])
            total = 0
        runs[-1].append(entry)
        total += size(entry)
    return runs


def label(index: Any) -> str:
    """Names an item in errors: its key, and for a shard its offsets in the whole tensor."""
    if index.offset is not None and any(index.offset):
        return f"{index.fqn} (shard at {list(index.offset)})"
    return index.fqn


def write_durably(path: str, data: bytes) -> int:
    """Writes a new file with the engine, as a data file is written: its space reserved first, so
    that a full disk is an error naming the path before anything is written, then fsynced; no
    file is left if it fails. Returns the CRC32C of data."""
    raw = bytearray(data)
    buffer = torch.frombuffer(raw, dtype=torch.uint8) if raw else None
    writer = _core.CheckpointFileWriter.create(path, len(raw), 1, _core.CHECKPOINT_CHUNK_BYTES)
    try:
        (crc,) = writer.write([(buffer.data_ptr() if buffer is not None else 0, len(raw), 0, os.path.basename(path))])
        writer.finish()
    except BaseException:
        writer.abort()
        raise
    return crc
