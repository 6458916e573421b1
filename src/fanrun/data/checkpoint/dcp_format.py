"""DCP's own checkpoint format, as torch.distributed.checkpoint's FileSystemWriter (and
FsspecWriter) lay it out, and the reading of it that VolumeReader does for such checkpoints.

A DCP checkpoint is a directory (or an fsspec prefix) holding:

- ``.metadata``: DCP's pickled ``Metadata``, renamed into place once every rank has written;
  its storage_data maps each item's ``MetadataIndex`` to a ``_StorageInfo``: the file
  (``relative_path``), ``offset`` and ``length`` of its bytes, and the stream transforms
  (``transform_descriptors``, such as ``stream.zstd/1``) applied to them, to undo in that order;
- ``__<rank>_<n>.distcp``: each rank's items at those offsets: a tensor as the bytes of
  ``torch.save(tensor)``, a pickled object as its bytes. Nothing checksums them.

Checkpoints saved with ``use_collectives=False`` have a ``__<rank>.metadata`` per rank instead
of ``.metadata``; they are not read here.
"""

from __future__ import annotations

import io
import os
import pickle
import stat
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner
from torch.futures import Future

from ..._errors import CheckpointCorruptError
from . import metadata_checks, storage

# The names torch's filesystem.py gives them (its _metadata_fn and DEFAULT_SUFFIX).
METADATA_NAME = ".metadata"
DATA_SUFFIX = ".distcp"


def data_file_name(rank: int) -> str:
    """The name FileSystemWriter gives a rank's first (with one thread, only) file."""
    return f"__{rank}_0{DATA_SUFFIX}"


def is_dcp_checkpoint(path: str) -> bool:
    """Whether path holds DCP's global metadata file, which DCP writes last."""
    try:
        return METADATA_NAME in storage.storage_for(path).list_names(path)
    except OSError:
        return False


class DcpCheckpointReader:
    """What VolumeReader does for a checkpoint in DCP's format: DCP's semantics (torch.load of
    each tensor's bytes, narrowed to each request and copied into its destination), with every
    stored item read once however many requests (resharding) need parts of it, file names kept
    inside the checkpoint, and every offset and length checked against the file."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.remote = storage.is_fsspec_url(path)

    def read_metadata(self, load_id: str) -> Metadata:
        target = storage.storage_for(self.path)
        # A pickle, as with DCP's own reader: a checkpoint must come from someone trusted.
        metadata = pickle.loads(target.read_bytes(target.join(self.path, METADATA_NAME)))
        # Its items are checked once it is set up for reading (metadata_checks.check_dcp_items).
        metadata_checks.check_is_metadata(f"{self.path}/{METADATA_NAME}", metadata)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = load_id
        return metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner, storage_data: dict) -> Future[None]:
        stored: dict[Any, list] = {}
        for request in plan.items:
            stored.setdefault(request.storage_index, []).append(request)
        by_file: dict[str, list] = {}
        for index in stored:
            by_file.setdefault(storage_data[index].relative_path, []).append(index)
        for name, indexes in sorted(by_file.items()):
            with self._open(name) as source:
                for index in sorted(indexes, key=lambda i: storage_data[i].offset):
                    info = storage_data[index]
                    item = source.item(info.offset, info.length, index.fqn)
                    where = f"item '{index.fqn}' of '{source.path}'"
                    item = _undo_transforms(item, info.transform_descriptors or (), where)
                    _hand_over(item, stored[index], planner)
        future: Future[None] = Future()
        future.set_result(None)
        return future

    def _open(self, name: str) -> _LocalFile | _RemoteFile:
        return _RemoteFile(self.path, name) if self.remote else _LocalFile(self.path, name)


class _LocalFile:
    """A data file opened relative to the checkpoint's directory, never through a symlink, and
    only if it is a regular file (O_NONBLOCK: opening a FIFO planted there must not hang)."""

    def __init__(self, directory: str, name: str) -> None:
        self.path = os.path.join(directory, name)
        dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
            self._fd = os.open(name, flags, dir_fd=dir_fd)
        finally:
            os.close(dir_fd)
        status = os.fstat(self._fd)
        if not stat.S_ISREG(status.st_mode):
            os.close(self._fd)
            raise CheckpointCorruptError(f"'{self.path}' is not a regular file")
        self._size = status.st_size

    def item(self, offset: int, length: int, fqn: str) -> _ItemView:
        if offset + length > self._size:
            raise _short(self.path, fqn, offset, length, self._size)
        return _ItemView(self._fd, offset, length, self.path, fqn)

    def __enter__(self) -> _LocalFile:
        return self

    def __exit__(self, *exc: object) -> None:
        os.close(self._fd)


class _RemoteFile:
    """A data file under an fsspec URL, read by ranges."""

    def __init__(self, directory: str, name: str) -> None:
        self._remote = storage.RemoteStorage(directory)
        self.path = self._remote.join(directory, name)

    def item(self, offset: int, length: int, fqn: str) -> io.BytesIO:
        data = self._remote.read_range(self.path, offset, length)
        if len(data) != length:
            raise _short(self.path, fqn, offset, length, offset + len(data))
        return io.BytesIO(data)

    def __enter__(self) -> _RemoteFile:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


class _ItemView(io.RawIOBase):
    """One item's bytes in a file, as a seekable stream that torch.load reads straight from
    the file (readinto), without a copy of the whole item first."""

    def __init__(self, fd: int, offset: int, length: int, path: str, fqn: str) -> None:
        super().__init__()
        self._fd, self._start, self._length = fd, offset, length
        self._position = 0
        self._path, self._fqn = path, fqn

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._position

    def seek(self, position: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._position, io.SEEK_END: self._length}[whence]
        self._position = max(0, base + position)
        return self._position

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        wanted = min(len(view), self._length - self._position)
        done = 0
        while done < wanted:
            count = os.preadv(self._fd, [view[done:wanted]], self._start + self._position + done)
            if count == 0:  # the file shrank since it was opened
                end = self._start + self._position + done
                raise _short(self._path, self._fqn, self._start, self._length, end)
            done += count
        self._position += done
        return done


def _short(path: str, fqn: str, offset: int, length: int, end: int) -> CheckpointCorruptError:
    return CheckpointCorruptError(
        f"'{path}' is shorter than the checkpoint's metadata says: item '{fqn}' lies at bytes "
        f"{offset}..{offset + length}, the file ends at {end}"
    )


def _undo_transforms(item: Any, descriptors: Any, where: str) -> Any:
    """The item's stream with its stream transforms (compression) undone, as DCP's reader does
    with its default extension registry; seekable, as torch.load needs."""
    if not descriptors:
        return item
    from torch.distributed.checkpoint._extension import ExtensionRegistry, StreamTransformExtension

    try:
        extensions = ExtensionRegistry().from_descriptor_list(list(descriptors))
    except ValueError as error:
        raise ValueError(f"Cannot read {where}: it was saved with {list(descriptors)} ({error})") from None
    stream = item
    for extension in extensions:
        if isinstance(extension, StreamTransformExtension):
            stream = extension.transform_from(stream)
    return io.BytesIO(stream.read())


def _hand_over(item: Any, requests: list, planner: LoadPlanner) -> None:
    """Gives one stored item to the requests that need it: bytes to the planner, a tensor's
    parts copied into their destinations (copy_ casts the dtype and writes through a
    destination's conjugate or negative flag, as with DCP's reader)."""
    if requests[0].type == LoadItemType.BYTE_IO:
        data = item.read()
        for request in requests:
            planner.load_bytes(request, io.BytesIO(data))
        return
    tensor = torch.load(item, map_location="cpu", weights_only=True)
    for request in requests:
        source = tensor
        for dim, (offset, length) in enumerate(zip(request.storage_offsets, request.lengths, strict=True)):
            source = source.narrow(dim, offset, length)
        target = planner.resolve_tensor(request).detach()
        if target.size() != source.size():
            raise ValueError(
                f"Checkpoint item '{request.storage_index.fqn}' has shape {tuple(source.size())} "
                f"where the state dict expects {tuple(target.size())}"
            )
        target.copy_(source)
        planner.commit_tensor(request, target)
