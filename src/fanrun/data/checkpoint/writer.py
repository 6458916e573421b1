"""VolumeWriter: a torch.distributed.checkpoint StorageWriter (and AsyncStager) over fanrun's
C++ I/O engine, publishing each checkpoint atomically once every rank has written its part."""

from __future__ import annotations

import dataclasses
import io
import json
import os
import pickle
import shutil
import tempfile
import uuid
import weakref
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from ... import _core
from ..._errors import CheckpointExistsError, CheckpointNotSharedError
from . import engine_io, layout, storage
from .staging import HostCopies, stage_state_dict

# What DCP's FileSystemWriter says when overwrite=False finds a checkpoint.
DCP_OVERWRITE_REFUSED = "Checkpoint already exists and self.overwrite=False."


class VolumeWriter(StorageWriter, AsyncStager):
    """Saves a ``torch.distributed.checkpoint`` checkpoint to ``path``, a local or mounted
    directory or an fsspec URL.

    Each rank writes its items into one file with ``thread_count`` threads and a CRC32C per
    item, and fsyncs it; the coordinator publishes the whole checkpoint in one atomic rename
    once every rank has finished, replacing an existing checkpoint at ``path`` without a moment
    in which none is there. ``keep_last=K`` then removes all but the K newest complete
    checkpoints beside it. With ``dcp.async_save`` it stages GPU tensors to pinned host memory
    on their own streams: the caller waits only while the copies are queued.
    """

    # dcp.async_save must not call synchronize_staging: stage() already ordered the copies on
    # the training streams, and write_data waits for them.
    _synchronize_after_execute: bool = False

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        thread_count: int = engine_io.DEFAULT_THREADS,
        keep_last: int | None = None,
        overwrite: bool = True,
        local_staging_dir: str | os.PathLike | None = None,
        chunk_bytes: int = _core.CHECKPOINT_CHUNK_BYTES,
    ) -> None:
        super().__init__()
        engine_io.check_io_options(thread_count, chunk_bytes)
        if keep_last is not None and (not isinstance(keep_last, int) or keep_last < 1):
            raise ValueError(f"keep_last must be None or a positive int, got {keep_last!r}")
        self.thread_count = thread_count
        self.keep_last = keep_last
        self.overwrite = overwrite
        self.chunk_bytes = chunk_bytes
        self.local_staging_dir = os.fspath(local_staging_dir) if local_staging_dir else tempfile.gettempdir()
        self._set_path(path)
        self._staged: HostCopies | None = None
        self._lock: storage.SaveLock | None = None
        self._lock_finalizer: weakref.finalize | None = None
        self._planned_save_id = ""

    # ------------------------------------------------------------ set-up

    def _set_path(self, path: str | os.PathLike) -> None:
        path = os.fspath(path)
        if not path:
            raise ValueError("VolumeWriter needs a checkpoint path, got an empty one")
        self.remote = storage.is_fsspec_url(path)
        self.path = storage.target_path(path)
        self.save_id = uuid.uuid4().hex
        self.is_coordinator = False
        self.rank = 0

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        self._release_lock()
        if checkpoint_id:
            self._set_path(checkpoint_id)
        else:
            self.save_id = uuid.uuid4().hex

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator
        rank = kwargs.get("rank")
        if rank is None and torch.distributed.is_available() and torch.distributed.is_initialized():
            rank = torch.distributed.get_rank()
        self.rank = rank or 0
        if kwargs.get("use_collectives", True) is False:
            raise ValueError(
                "VolumeWriter publishes a checkpoint once every rank has written: it needs "
                "dcp.save(..., use_collectives=True)"
            )

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return isinstance(checkpoint_id, (str, os.PathLike)) and bool(os.fspath(checkpoint_id))

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.path, save_id=self.save_id)

    @property
    def checkpoint_id(self) -> str:
        return self.path

    # ------------------------------------------------------------ planning

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        """On every rank, before any rank writes: a target that may not be replaced fails the
        save on every rank, as it does with DCP's own writers, so that each rank's error says why."""
        self._check_target()
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """On the coordinator, before any rank writes: checks the target, removes what crashed
        saves left, and creates the directory every rank writes into."""
        self._check_target()
        save_id = uuid.uuid4().hex
        staging_dir = None  # remote targets: each rank stages in its own local_staging_dir
        if not self.remote:
            parent = os.path.dirname(self.path)
            os.makedirs(parent, exist_ok=True)
            storage.clean_leftovers(parent)
            staging_dir = layout.partial_dir(self.path, save_id)
            self._take_lock(staging_dir)
            os.mkdir(staging_dir)
        self._planned_save_id = save_id
        return [
            dataclasses.replace(
                plan, storage_data=layout.RankTarget(save_id, staging_dir, layout.data_file_name(i, save_id))
            )
            for i, plan in enumerate(plans)
        ]

    def _check_target(self) -> None:
        if not self.remote and os.path.exists(self.path) and not os.path.isdir(self.path):
            raise CheckpointExistsError(f"Cannot save a checkpoint to '{self.path}': it is a file")
        names = storage.storage_for(self.path).list_names(self.path)
        if not names:
            return
        try:
            storage.read_record(self.path)
        except Exception:
            # On object stores a crashed save leaves its files under the target itself; they
            # are ours to replace (and are removed once the new record is written).
            if self.remote and all(layout.is_own_file_name(name) for name in names):
                return
            raise CheckpointExistsError(
                f"Cannot save a checkpoint to '{self.path}': it exists and is not a complete fanrun "
                "checkpoint, so it is not replaced. Choose another path or remove it"
            ) from None
        if not self.overwrite:
            # DCP's writers raise RuntimeError with these words, and code matches them.
            raise CheckpointExistsError(
                f"{DCP_OVERWRITE_REFUSED} A complete checkpoint is at '{self.path}'; pass "
                "overwrite=True to replace it, or choose another path"
            )

    def _take_lock(self, staging_dir: str) -> None:
        self._release_lock()
        self._lock = storage.SaveLock(staging_dir)
        # A save that fails on another rank never reaches finish(): the lock (and with it the
        # partial directory's claim) goes when the writer does, or at the next reset().
        self._lock_finalizer = weakref.finalize(self, self._lock.release)

    def _release_lock(self) -> None:
        if self._lock_finalizer is not None:
            self._lock_finalizer()
            self._lock_finalizer = None
        self._lock = None

    # ------------------------------------------------------------ staging (dcp.async_save)

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        copies = HostCopies(reuse_host_buffers=True)
        staged = stage_state_dict(state_dict, copies)
        self._staged = copies
        return staged

    def synchronize_staging(self) -> None:
        """Nothing to wait for here: the copies are ordered on the training streams, and the
        background save waits for them before it writes."""

    def close(self) -> None:
        self._release_lock()

    # ------------------------------------------------------------ writing

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        target: layout.RankTarget = plan.storage_data
        if target.staging_dir is not None and not os.path.isdir(target.staging_dir):
            # The coordinator made it before any rank writes: a rank that cannot see it runs on
            # a machine that does not share the checkpoint's storage.
            where = f" (node {os.environ['NODE_RANK']})" if os.environ.get("GROUP_WORLD_SIZE", "1") != "1" else ""
            raise CheckpointNotSharedError(
                f"Cannot save a checkpoint to '{self.path}': rank {self.rank}{where} does not see the directory "
                f"'{target.staging_dir}' that the coordinator (rank 0) has just made, so this path is not "
                f"storage that every machine of the run shares. Use a directory every node mounts (NFS, "
                f"Lustre, a FUSE mount of object storage) or an object store URI (s3://, gs://)"
            )
        staged, self._staged = self._staged, None
        if staged is not None:
            staged.ready()
        try:
            return self._write_rank_file(plan, planner, target)
        finally:
            if staged is not None:
                staged.written()

    def _write_rank_file(
        self, plan: SavePlan, planner: SavePlanner, target: layout.RankTarget
    ) -> Future[list[WriteResult]]:
        # Every item is resolved first, because the file's size is reserved before any write;
        # device tensors are not copied yet.
        entries: list[_Entry] = []
        offset = 0
        for item in plan.items:
            data = planner.resolve_data(item)
            if item.type == WriteItemType.BYTE_IO:
                raw = bytearray(data.getbuffer() if isinstance(data, io.BytesIO) else data)
                tensor = torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
                dtype = shape = None
            else:
                tensor = data.detach()
                dtype, shape = str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape)
            size = tensor.numel() * tensor.element_size()
            entries.append(_Entry(item, tensor, offset, size, dtype, shape))
            offset = layout.aligned(offset + size)

        local_dir = target.staging_dir
        if local_dir is None:
            local_dir = os.path.join(self.local_staging_dir, f"fanrun-upload-{target.save_id}-r{self.rank}")
            os.makedirs(local_dir, exist_ok=True)
        local_file = os.path.join(local_dir, target.file_name)
        file_size = max((e.offset + e.size for e in entries), default=0)
        writer = _core.CheckpointFileWriter.create(local_file, file_size, self.thread_count, self.chunk_bytes)
        try:
            crcs = self._write_batches(writer, entries)
            writer.finish()
        except BaseException:
            writer.abort()
            raise
        if self.remote:
            remote = storage.RemoteStorage(self.path)
            try:
                remote.put_file(local_file, self.path, target.file_name)
            finally:
                shutil.rmtree(local_dir, ignore_errors=True)

        results = [
            WriteResult(
                index=e.item.index,
                size_in_bytes=e.size,
                storage_data=layout.ItemLocation(target.file_name, e.offset, e.size, crc, e.dtype, e.shape),
            )
            for e, crc in zip(entries, crcs, strict=True)
        ]
        future: Future[list[WriteResult]] = Future()
        future.set_result(results)
        return future

    @staticmethod
    def _write_batches(writer: _core.CheckpointFileWriter, entries: list[_Entry]) -> list[int]:
        """Writes the entries batch by batch; device tensors of the next batch are copied to
        pinned host memory while the engine writes this one, so the GPU copy and the disk overlap
        and at most two batches are held in host memory. Host tensors are written in place."""
        on_device = any(e.tensor.device.type != "cpu" for e in entries)
        batches = engine_io.batches(entries, engine_io.BATCH_BYTES if on_device else engine_io.BATCH_BYTES * engine_io.HOST_BATCH_FACTOR)
        crcs: list[int] = []
        if not batches:
            return crcs
        following = _to_host(batches[0])
        # A thread of its own hands each batch to the engine while this one stages the next: a
        # process's first save allocates its pinned memory then, behind the disk, not before it.
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="fanrun-checkpoint-write") as engine:
            for index, batch in enumerate(batches):
                hosts, copies = following
                copies.ready()
                items = [
                    (host.data_ptr() if e.size else 0, e.size, e.offset, engine_io.label(e.item.index))
                    for e, host in zip(batch, hosts, strict=True)
                ]
                written = engine.submit(writer.write, items)
                try:
                    following = _to_host(batches[index + 1]) if index + 1 < len(batches) else None
                finally:
                    # Even when staging fails: the engine reads `hosts` until its write returns.
                    crcs += written.result()
                del hosts  # pinned memory goes back to torch's cache, for the batch after next
        return crcs

    # ------------------------------------------------------------ publishing (coordinator)

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Called on the coordinator with every rank's results: writes the metadata and the
        record (which gives the metadata's size and CRC32C), then publishes the checkpoint in one
        step and prunes older ones."""
        save_id = self._planned_save_id
        locations = {}
        # Every rank wrote its file, even one with no items; the record names them all.
        files = {layout.data_file_name(rank, save_id): 0 for rank in range(len(results))}
        for rank_results in results:
            for result in rank_results:
                location: layout.ItemLocation = result.storage_data
                locations[result.index] = location
                files[location.file] = max(files[location.file], location.offset + location.length)
        metadata.storage_data = locations
        metadata.storage_meta = self.storage_meta()
        pickled = pickle.dumps(metadata)
        if self.remote:
            self._publish_remote(pickled, save_id, len(results), files)
        else:
            self._publish_local(pickled, save_id, len(results), files)
        if self.keep_last is not None:
            root = self.path.rsplit("/", 1)[0] if self.remote else os.path.dirname(self.path)
            storage.prune(root, self.keep_last, self.path)

    def _publish_local(self, pickled: bytes, save_id: str, world_size: int, files: dict[str, int]) -> None:
        staging_dir = layout.partial_dir(self.path, save_id)
        try:
            name = layout.metadata_file_name(save_id)
            crc = engine_io.write_durably(os.path.join(staging_dir, name), pickled)
            record = layout.make_record(save_id, world_size, files, len(pickled), crc)
            engine_io.write_durably(os.path.join(staging_dir, layout.RECORD_NAME), json.dumps(record, indent=1).encode())
            previous = _core.publish_directory(staging_dir, self.path)
        except BaseException:
            # Every rank has written its part: nothing else uses the partial directory any more.
            shutil.rmtree(staging_dir, ignore_errors=True)
            self._release_lock()
            raise
        if previous:
            shutil.rmtree(previous, ignore_errors=True)
        self._release_lock()

    def _publish_remote(self, pickled: bytes, save_id: str, world_size: int, files: dict[str, int]) -> None:
        remote = storage.RemoteStorage(self.path)
        name = layout.metadata_file_name(save_id)
        # Staged and uploaded as the data files are, which gives its CRC32C on the way.
        local_dir = tempfile.mkdtemp(prefix="fanrun-upload-", dir=self.local_staging_dir)
        try:
            crc = engine_io.write_durably(os.path.join(local_dir, name), pickled)
            remote.put_file(os.path.join(local_dir, name), self.path, name)
        finally:
            shutil.rmtree(local_dir, ignore_errors=True)
        record = layout.make_record(save_id, world_size, files, len(pickled), crc)
        # The record is the commit: one object, written last, naming only this save's files.
        remote.write_bytes(self.path, layout.RECORD_NAME, json.dumps(record, indent=1).encode())
        keep = {layout.RECORD_NAME, record["metadata"], *record["files"]}
        for name in remote.list_names(self.path):
            if name not in keep:
                remote.remove(self.path, name)


@dataclasses.dataclass
class _Entry:
    """One item of this rank's file: its data (a tensor on any device, or the bytes of a pickled
    object as a uint8 tensor) and where it goes."""

    item: Any
    tensor: torch.Tensor
    offset: int
    size: int
    dtype: str | None
    shape: tuple[int, ...] | None


def _to_host(batch: list[_Entry]) -> tuple[list[torch.Tensor], HostCopies]:
    """Contiguous host tensors for a batch; device tensors are copied (queued, see HostCopies)."""
    copies = HostCopies()
    hosts = []
    for entry in batch:
        tensor = entry.tensor
        if tensor.device.type != "cpu":
            tensor = copies.tensor(tensor)
        if tensor.is_conj() or tensor.is_neg():
            # A conjugate or negative view is a flag over its base's memory, which holds the
            # base's values: only a resolved copy holds the view's own.
            tensor = tensor.resolve_conj().resolve_neg()
        if not tensor.is_contiguous():
            tensor = tensor.contiguous()
        hosts.append(tensor)
    copies.record()
    return hosts, copies
