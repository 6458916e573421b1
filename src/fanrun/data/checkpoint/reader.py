"""VolumeReader: a torch.distributed.checkpoint StorageReader that loads fanrun checkpoints
with the C++ engine, several threads per rank, every item checked against its CRC32C; and
checkpoints that DCP's own FileSystemWriter wrote, in their format."""

from __future__ import annotations

import io
import os
import pickle
import shutil
import tempfile
import uuid
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from ... import _core
from ..._errors import NotACheckpointError
from . import dcp_format, engine_io, layout, metadata_checks, storage


class VolumeReader(StorageReader):
    """Loads a checkpoint written by VolumeWriter from ``path`` (a local or mounted directory, or
    an fsspec URL, whose files are downloaded to ``local_staging_dir`` first). A checkpoint
    that DCP's own FileSystemWriter or FsspecWriter wrote there is read in DCP's format.

    The path is checked at once: one that holds no complete checkpoint raises
    NotACheckpointError here, before any rank starts loading."""

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        thread_count: int = engine_io.DEFAULT_THREADS,
        local_staging_dir: str | os.PathLike | None = None,
        chunk_bytes: int = _core.CHECKPOINT_CHUNK_BYTES,
    ) -> None:
        super().__init__()
        engine_io.check_io_options(thread_count, chunk_bytes)
        self.thread_count = thread_count
        self.chunk_bytes = chunk_bytes
        self.local_staging_dir = os.fspath(local_staging_dir) if local_staging_dir else tempfile.gettempdir()
        self.storage_data: dict[Any, layout.ItemLocation] = {}
        self._set_path(path)

    def _set_path(self, path: str | os.PathLike) -> None:
        path = os.fspath(path)
        self.remote = storage.is_fsspec_url(path)
        self.path = storage.target_path(path)
        self.dcp: dcp_format.DcpCheckpointReader | None = None
        try:
            self.record = storage.read_record(self.path)
        except NotACheckpointError:
            if not dcp_format.is_dcp_checkpoint(self.path):
                raise
            self.record = None
            self.dcp = dcp_format.DcpCheckpointReader(self.path)
        self.load_id = uuid.uuid4().hex

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        self.storage_data = {}
        if checkpoint_id:
            self._set_path(checkpoint_id)
        else:
            self.load_id = uuid.uuid4().hex

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        try:
            storage.read_record(os.fspath(checkpoint_id))
        except Exception:
            return dcp_format.is_dcp_checkpoint(storage.target_path(os.fspath(checkpoint_id)))
        return True

    @property
    def checkpoint_id(self) -> str:
        return self.path

    def read_metadata(self) -> Metadata:
        if self.dcp is not None:
            return self.dcp.read_metadata(self.load_id)
        # A pickle, as DCP's own: loading a checkpoint runs what its metadata says, so only
        # trusted checkpoints may be loaded. Its bytes are checked against the record first.
        metadata = pickle.loads(storage.read_metadata_bytes(self.path, self.record, self.local_staging_dir))
        metadata_checks.check_is_metadata(f"{self.path}/{self.record['metadata']}", metadata)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        # Here, on every rank, however the metadata reached it, and before any byte is read. (DCP
        # would turn an error of read_metadata into an AssertionError that keeps only its text.)
        if self.dcp is not None:
            metadata_checks.check_dcp_items(self.path, metadata, dcp_format.METADATA_NAME)
        else:
            metadata_checks.check_fanrun_items(self.path, metadata, self.record)
        self.storage_data = metadata.storage_data

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        if self.dcp is not None:
            return self.dcp.read_data(plan, planner, self.storage_data)
        # Each stored item is read once, even when several requests (resharding) need parts of it.
        stored: dict[Any, tuple[layout.ItemLocation, list]] = {}
        for request in plan.items:
            location = self.storage_data[request.storage_index]
            stored.setdefault(request.storage_index, (location, []))[1].append(request)

        file_names = sorted({location.file for location, _ in stored.values()})
        local_dir = self._fetch(file_names) if self.remote else self.path
        try:
            paths = [os.path.join(local_dir, name) for name in file_names]
            file_index = {name: i for i, name in enumerate(file_names)}
            to_device = False
            # Small batches only where GPUs may be the destination (see writer.py).
            batch_bytes = engine_io.BATCH_BYTES if torch.cuda.is_available() else engine_io.BATCH_BYTES * engine_io.HOST_BATCH_FACTOR
            for batch in engine_io.batches(list(stored.items()), batch_bytes, size=lambda entry: entry[1][0].length):
                to_device |= self._read_batch(batch, paths, file_index, planner)
        finally:
            if self.remote:
                shutil.rmtree(local_dir, ignore_errors=True)
        if to_device:
            torch.cuda.synchronize()  # the last batches' copies to the GPUs
        future: Future[None] = Future()
        future.set_result(None)
        return future

    def _read_batch(self, batch: list, paths: list[str], file_index: dict[str, int], planner: LoadPlanner) -> bool:
        """Reads one batch of stored items with the engine, then hands each to its requests:
        pickled objects to the planner, tensors copied into place (to GPUs asynchronously from
        pinned memory, so that the copy overlaps the next batch's read). Items that can be are
        read straight into their destination. Returns whether anything went to a GPU."""
        reads = []
        # (location, or for pickled objects their bytearray; buffer; requests) handled after the read
        after: list[tuple[Any, torch.Tensor, list]] = []
        direct: list[tuple[Any, torch.Tensor]] = []  # (request, target) read in place
        to_device = False
        for index, (location, requests) in batch:
            if location.dtype is None:
                raw = bytearray(location.length)
                buffer = torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
                after.append((raw, buffer, requests))
            else:
                target = planner.resolve_tensor(requests[0]).detach()
                if self._can_read_into(target, location, requests):
                    buffer = target
                    direct.append((requests[0], target))
                else:
                    pin = target.device.type == "cuda"
                    to_device |= pin
                    buffer = torch.empty(location.shape, dtype=getattr(torch, location.dtype), pin_memory=pin)
                    after.append((location, buffer, requests))
            # The engine reads nothing unless the item fills the buffer exactly and lies in its file.
            buffer_size = buffer.numel() * buffer.element_size()
            reads.append(
                (
                    file_index[location.file],
                    location.offset,
                    location.length,
                    buffer.data_ptr() if buffer_size else 0,
                    buffer_size,
                    location.crc32c,
                    engine_io.label(index),
                )
            )
        _core.read_checkpoint_items(paths, reads, self.thread_count, self.chunk_bytes)

        for request, target in direct:
            planner.commit_tensor(request, target)
        for raw_or_location, buffer, requests in after:
            for request in requests:
                if request.type == LoadItemType.BYTE_IO:
                    planner.load_bytes(request, io.BytesIO(raw_or_location))
                    continue
                source = _narrow(buffer, request.storage_offsets, request.lengths)
                target = planner.resolve_tensor(request).detach()
                if target.size() != source.size():
                    raise ValueError(
                        f"Checkpoint item '{request.storage_index.fqn}' has shape {tuple(source.size())} "
                        f"where the state dict expects {tuple(target.size())}"
                    )
                # From pinned memory the copy is queued on the stream and the buffer's memory is
                # not reused before it is done (torch's caching host allocator tracks that).
                target.copy_(source, non_blocking=source.is_pinned())
                planner.commit_tensor(request, target)
        return to_device

    @staticmethod
    def _can_read_into(target: torch.Tensor, location: layout.ItemLocation, requests: list) -> bool:
        """Whether the stored bytes can be read straight into the destination tensor: one request
        for the whole stored item, into contiguous host memory of the same dtype and shape, with
        no conjugate or negative flag (the bytes of such a view's memory are not its values:
        it gets its values by copy_, which writes them through the flag)."""
        request = requests[0]
        return (
            len(requests) == 1
            and not any(request.storage_offsets)
            and tuple(request.lengths) == tuple(location.shape)
            and target.device.type == "cpu"
            and target.is_contiguous()
            and not target.is_conj()
            and not target.is_neg()
            and str(target.dtype).removeprefix("torch.") == location.dtype
            and tuple(target.shape) == tuple(location.shape)
        )

    def _fetch(self, file_names: list[str]) -> str:
        """Downloads the files this rank needs next to each other in a private local directory."""
        remote = storage.RemoteStorage(self.path)
        local_dir = tempfile.mkdtemp(prefix="fanrun-download-", dir=self.local_staging_dir)
        try:
            for name in file_names:
                remote.get_file(self.path, name, os.path.join(local_dir, name))
        except BaseException:
            shutil.rmtree(local_dir, ignore_errors=True)
            raise
        return local_dir


def _narrow(tensor: torch.Tensor, offsets: Any, lengths: Any) -> torch.Tensor:
    for dim, (offset, length) in enumerate(zip(offsets, lengths, strict=True)):
        tensor = tensor.narrow(dim, offset, length)
    return tensor
