"""Host copies of state dicts for saving: GPU tensors go to pinned memory with copies queued on
each tensor's current CUDA stream, so the training stream is held up by the copy itself and
nothing more, and the caller only waits for the copies to be queued."""

from __future__ import annotations

import copy
import threading
from typing import Any

import torch


class _HostBuffers:
    """Host tensors that stage CPU tensors, kept from one async save for the next: a copy into
    memory that is already mapped costs the copy alone, while fresh memory first takes a page
    fault per page, 3-5x the copy. Holds one state dict's worth at most: the buffers of the
    save that completed last. (GPU tensors stage into pinned memory, which torch's caching
    host allocator keeps in the same way.)"""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._free: dict[tuple[tuple[int, ...], torch.dtype], list[torch.Tensor]] = {}

    def take(self, like: torch.Tensor) -> torch.Tensor:
        with self._lock:
            free = self._free.get((tuple(like.shape), like.dtype))
            if free:
                return free.pop()
        return torch.empty(like.shape, dtype=like.dtype, device="cpu")

    def keep(self, buffers: list[torch.Tensor]) -> None:
        """Called once the save that used `buffers` has written them; they replace what was kept."""
        free: dict[tuple[tuple[int, ...], torch.dtype], list[torch.Tensor]] = {}
        for buffer in buffers:
            free.setdefault((tuple(buffer.shape), buffer.dtype), []).append(buffer)
        with self._lock:
            self._free = free


_HOST_BUFFERS = _HostBuffers()


class HostCopies:
    """Copies queued for one state dict; ready() blocks until the data has reached host memory."""

    def __init__(self, reuse_host_buffers: bool = False) -> None:
        self._events: dict[torch.device, Any] = {}
        self._reuse = reuse_host_buffers
        self._host_buffers: list[torch.Tensor] = []

    def tensor(self, tensor: torch.Tensor) -> torch.Tensor:
        """A contiguous host tensor that holds (once ready) the values `tensor` has now."""
        tensor = tensor.detach()
        if tensor.device.type == "cpu":
            # A snapshot even when the tensor is already contiguous on the host: training may
            # change it in place while the write runs.
            if not self._reuse:
                return tensor.clone(memory_format=torch.contiguous_format)
            buffer = _HOST_BUFFERS.take(tensor)
            buffer.copy_(tensor)
            self._host_buffers.append(buffer)
            return buffer
        if tensor.device.type != "cuda":
            return tensor.to("cpu").contiguous()
        host = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=True)
        # Queued on the stream that produced the values, so that it sees every earlier update
        # and later updates on that stream wait for it.
        host.copy_(tensor, non_blocking=True)
        if tensor.device not in self._events:
            self._events[tensor.device] = None
        return host

    def record(self) -> None:
        """Marks, on each device's current stream, the point after every copy queued so far."""
        for device in self._events:
            with torch.cuda.device(device):
                event = torch.cuda.Event()
                event.record(torch.cuda.current_stream(device))
                self._events[device] = event

    def ready(self) -> None:
        for event in self._events.values():
            if event is not None:
                event.synchronize()

    def written(self) -> None:
        """The save has written every staged tensor: their host buffers may stage the next one."""
        if self._host_buffers:
            _HOST_BUFFERS.keep(self._host_buffers)
            self._host_buffers = []


def stage_state_dict(state_dict: Any, copies: HostCopies) -> Any:
    """The same structure with every tensor replaced by its host copy (DTensors keep their
    sharding, ShardedTensors are not supported) and other values deep-copied, so that nothing
    the caller changes afterwards reaches the checkpoint."""
    from torch.distributed.tensor import DTensor

    def stage(value: Any) -> Any:
        if isinstance(value, DTensor):
            # The private constructor keeps the mesh and placements with a host local tensor,
            # as DCP's own staging does; DTensor.from_local would move it back to the device.
            return DTensor(copies.tensor(value.to_local()), value._spec, requires_grad=False)
        if _is_sharded_tensor(value):
            raise TypeError(
                "VolumeWriter's async staging supports tensors and DTensors (FSDP2, "
                "torch.distributed.tensor); this state dict holds a ShardedTensor (FSDP1). "
                "Use dcp.save, or FSDP2's fully_shard"
            )
        if isinstance(value, torch.Tensor):
            return copies.tensor(value)
        if isinstance(value, dict):
            staged_items = {k: stage(v) for k, v in value.items()}
            return staged_items if type(value) is dict else type(value)(staged_items)
        if isinstance(value, list):
            return [stage(v) for v in value]
        if isinstance(value, tuple) and not hasattr(value, "_fields"):
            return tuple(stage(v) for v in value)
        return copy.deepcopy(value)

    staged = stage(state_dict)
    copies.record()
    return staged


def _is_sharded_tensor(value: Any) -> bool:
    try:
        from torch.distributed._shard.sharded_tensor import ShardedTensor
    except ImportError:
        return False
    return isinstance(value, ShardedTensor)
