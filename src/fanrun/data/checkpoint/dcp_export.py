"""export_dcp: a fanrun checkpoint written again in DCP's own format, so that DCP's tools
(dcp.load with only a checkpoint_id, format_utils.dcp_to_torch_save) read it."""

from __future__ import annotations

import dataclasses
import io
import os
import pickle
import shutil
import uuid
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION, _StorageInfo
from torch.distributed.checkpoint.metadata import StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem

from ..._errors import CheckpointExistsError
from . import dcp_format, engine_io, layout, storage
from .reader import VolumeReader


def export_dcp(src: str | os.PathLike, dst: str | os.PathLike, *, thread_count: int = engine_io.DEFAULT_THREADS) -> str:
    """Writes the fanrun checkpoint at ``src`` (any path VolumeReader reads) to ``dst``, a local or
    mounted directory, in the format of DCP's FileSystemWriter: each rank's items in its own
    ``__<rank>_0.distcp`` file, tensors as torch.save bytes, and DCP's ``.metadata``, with the
    same keys, shards and planner data as the checkpoint saved. Every item is checked against
    its CRC32C as it is read, with ``thread_count`` threads.

    Needs no process group: call it in one process. ``dst`` must not exist or be an empty
    directory; it appears complete or not at all (the files are written in a hidden sibling,
    which is then renamed). Returns ``dst``."""
    dst = os.fspath(dst)
    if storage.is_fsspec_url(dst):
        raise ValueError(f"export_dcp writes to a local or mounted directory, got '{dst}'")
    dst = os.path.abspath(dst)
    reader = VolumeReader(src, thread_count=thread_count)
    if reader.dcp is not None:
        raise ValueError(f"'{reader.path}' is already a checkpoint in DCP's format")
    _check_destination(dst)
    metadata = reader.read_metadata()
    reader.set_up_storage_reader(metadata, True)
    save_id = reader.record["save_id"]
    # The record names one data file per rank that saved; DCP's names number the same ranks.
    ranks = range(len(reader.record["files"]))
    names = {layout.data_file_name(rank, save_id): dcp_format.data_file_name(rank) for rank in ranks}

    parent = os.path.dirname(dst)
    os.makedirs(parent, exist_ok=True)
    staging = layout.partial_dir(dst, uuid.uuid4().hex)
    # Held while writing, so that a save in the same directory does not take this for a
    # crashed save's leftover; what a crashed export leaves is removed by the next save there.
    lock = storage.SaveLock(staging)
    try:
        os.mkdir(staging)
        with _DcpFiles(staging, names.values()) as files:
            items = _ItemsToFiles(files, reader.storage_data, names)
            reader.read_data(_whole_items(reader.storage_data), items).wait()
            storage_data = files.finish()
        exported = dataclasses.replace(
            metadata,
            storage_data=storage_data,
            storage_meta=StorageMeta(
                checkpoint_id=dst,
                save_id=uuid.uuid4().hex,
                modules=list(getattr(metadata.storage_meta, "modules", None) or []),
            ),
            version=CURRENT_DCP_VERSION,
        )
        engine_io.write_durably(os.path.join(staging, dcp_format.METADATA_NAME), pickle.dumps(exported))
        _fsync_directory(staging)
        os.rename(staging, dst)  # replaces an empty directory, fails on anything else
        _fsync_directory(parent)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    finally:
        lock.release()
    return dst


def _check_destination(dst: str) -> None:
    if not os.path.lexists(dst):
        return
    if os.path.islink(dst) or not os.path.isdir(dst) or os.listdir(dst):
        raise CheckpointExistsError(
            f"Cannot export to '{dst}': it exists and is not an empty directory. Choose another path or remove it"
        )


def _whole_items(storage_data: dict[Any, layout.ItemLocation]) -> LoadPlan:
    """One request per stored item, for all of it, in the order of the files and offsets."""
    requests = []
    for index, location in sorted(storage_data.items(), key=lambda entry: (entry[1].file, entry[1].offset)):
        if location.dtype is None:
            kind, lengths = LoadItemType.BYTE_IO, (location.length,)
        else:
            kind, lengths = LoadItemType.TENSOR, tuple(location.shape or ())
        offsets = torch.Size([0] * len(lengths))
        requests.append(ReadItem(kind, index, offsets, index, offsets, torch.Size(lengths)))
    return LoadPlan(requests)


class _DcpFiles:
    """The .distcp files being written, and where each item went in them."""

    def __init__(self, directory: str, names: Any) -> None:
        self._files: dict[str, Any] = {}
        self._written: dict[Any, _StorageInfo] = {}
        try:
            for name in names:
                self._files[name] = open(os.path.join(directory, name), "xb")
        except BaseException:
            self.__exit__()
            raise

    def write(self, index: Any, name: str, save: Any) -> None:
        """Appends one item to a file; save(stream) writes its bytes."""
        stream = self._files[name]
        offset = stream.tell()
        save(stream)
        # FileSystemWriter's record of an item; FileSystemReader unpickles this very class.
        self._written[index] = _StorageInfo(name, offset, stream.tell() - offset)

    def finish(self) -> dict[Any, _StorageInfo]:
        for stream in self._files.values():
            stream.flush()
            os.fsync(stream.fileno())
        return self._written

    def __enter__(self) -> _DcpFiles:
        return self

    def __exit__(self, *exc: object) -> None:
        for stream in self._files.values():
            stream.close()


class _ItemsToFiles:
    """Takes the place of DCP's load planner in VolumeReader.read_data: each item, once read
    and checked, goes into the DCP file of the rank that saved it, as FileSystemWriter writes it."""

    def __init__(self, files: _DcpFiles, storage_data: dict, names: dict[str, str]) -> None:
        self._files = files
        self._storage_data = storage_data
        self._names = names

    def resolve_tensor(self, request: ReadItem) -> torch.Tensor:
        location = self._storage_data[request.storage_index]
        return torch.empty(location.shape, dtype=getattr(torch, location.dtype))

    def commit_tensor(self, request: ReadItem, tensor: torch.Tensor) -> None:
        self._files.write(request.storage_index, self._name(request), lambda stream: torch.save(tensor, stream))

    def load_bytes(self, request: ReadItem, value: io.BytesIO) -> None:
        self._files.write(request.storage_index, self._name(request), lambda stream: stream.write(value.getbuffer()))

    def _name(self, request: ReadItem) -> str:
        return self._names[self._storage_data[request.storage_index].file]


def _fsync_directory(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
