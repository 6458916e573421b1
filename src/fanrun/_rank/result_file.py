"""A rank's result on disk: a small pickle, then each large buffer it refers to, written straight
from the tensor's or array's memory and page-aligned, so that the caller maps the file instead
of reading it and gets tensors back without copying them.

Layout: MAGIC, the pickle's offset and length and the buffer count (little-endian u64s), each
buffer's offset and length, the pickle (protocol 5), then each buffer at a multiple of ALIGN.

Standard library only at import: the rank loads this file with runpy, as the worker is loaded.
"""

from __future__ import annotations

import io
import mmap
import os
import pickle
import struct
import sys
from typing import BinaryIO

MAGIC = b"FANRUNR\x01"
ALIGN = 4096  # a page: each buffer can be mapped where it lies
# Tensors smaller than this are pickled as torch pickles them, inside the pickle; larger ones
# travel out of band, each as its own contiguous copy.
OUT_OF_BAND_MIN_BYTES = 1 << 20
_U64 = struct.Struct("<Q")


def write(fd: int, result: object, pickler_base: type) -> None:
    """Pickles `result` into the open file `fd`; tensors and arrays of at least
    OUT_OF_BAND_MIN_BYTES go out of band, written from their own memory."""
    buffers: list[pickle.PickleBuffer] = []
    keep_alive: list[object] = []  # the tensors whose memory the buffers point into
    body = io.BytesIO()
    _pickler_class(pickler_base)(body, keep_alive, protocol=5, buffer_callback=buffers.append).dump(result)
    views = [b.raw() for b in buffers]
    header_size = len(MAGIC) + _U64.size * (3 + 2 * len(views))
    pickle_offset = header_size
    offsets, end = [], pickle_offset + body.getbuffer().nbytes
    for view in views:
        end = -(-end // ALIGN) * ALIGN
        offsets.append(end)
        end += view.nbytes
    header = [MAGIC, _U64.pack(pickle_offset), _U64.pack(body.getbuffer().nbytes), _U64.pack(len(views))]
    for offset, view in zip(offsets, views):
        header += [_U64.pack(offset), _U64.pack(view.nbytes)]
    _write_all(fd, b"".join(header), 0)
    _write_all(fd, body.getbuffer(), pickle_offset)
    for offset, view in zip(offsets, views):
        _write_all(fd, view, offset)


def read(file: BinaryIO, path: object) -> object:
    """The result in the open file (named `path` in errors): its buffers are mapped copy-on-write,
    so tensors built on them are writable and cost no copy until written."""
    size = os.fstat(file.fileno()).st_size
    mapped = mmap.mmap(file.fileno(), size, access=mmap.ACCESS_COPY) if size else b""
    data = memoryview(mapped)
    fields = _header(data, path)
    pickle_offset, pickle_length, spans = fields
    buffers = [data[offset:offset + length] for offset, length in spans]
    return pickle.loads(data[pickle_offset:pickle_offset + pickle_length], buffers=buffers)


def _header(data: memoryview, path: object) -> tuple[int, int, list[tuple[int, int]]]:
    """Every offset and length checked against the file before any byte is used."""
    def u64(at: int) -> int:
        if at + _U64.size > len(data):
            raise ValueError(f"the result file {path} is cut short (at byte {at} of {len(data)})")
        return _U64.unpack_from(data, at)[0]

    if bytes(data[:len(MAGIC)]) != MAGIC:
        raise ValueError(f"the result file {path} is not one a fanrun rank wrote")
    at = len(MAGIC)
    pickle_offset, pickle_length, count = u64(at), u64(at + 8), u64(at + 16)
    at += 24
    spans = [(u64(at + 16 * i), u64(at + 16 * i + 8)) for i in range(count)]
    for offset, length in [(pickle_offset, pickle_length), *spans]:
        if offset + length > len(data):
            raise ValueError(f"the result file {path} is cut short (needs {offset + length} bytes, has {len(data)})")
    return pickle_offset, pickle_length, spans


def _write_all(fd: int, data: memoryview | bytes, offset: int) -> None:
    view = memoryview(data).cast("B")
    while view:
        written = os.pwrite(fd, view, offset)
        view, offset = view[written:], offset + written


def _pickler_class(base: type) -> type:
    class ResultPickler(base):
        """Large CPU tensors go out of band; CUDA tensors come back as CPU tensors, since
        unpickling a CUDA tensor would start CUDA in the caller, which may have no GPU or
        must keep CUDA uninitialised."""

        def __init__(self, file, keep_alive: list, **kwargs) -> None:
            super().__init__(file, **kwargs)
            self._keep_alive = keep_alive

        def reducer_override(self, obj):
            torch = sys.modules.get("torch")
            if torch is not None and isinstance(obj, torch.Tensor) and type(obj) in (torch.Tensor, torch.nn.Parameter):
                reduced = _tensor_out_of_band(torch, obj, self._keep_alive)
                if reduced is not None:
                    return reduced
                if obj.device.type != "cpu":
                    return obj.cpu().__reduce_ex__(pickle.HIGHEST_PROTOCOL)
            return super().reducer_override(obj)

    return ResultPickler


def _tensor_out_of_band(torch, tensor, keep_alive: list):
    """(rebuild, args) with the tensor's bytes as an out-of-band buffer, or None where torch's
    own pickling must keep its meaning (small tensors, sparse, quantized, a graph's non-leaf)."""
    if tensor.layout != torch.strided or tensor.is_quantized or (tensor.requires_grad and not tensor.is_leaf):
        return None
    if tensor.numel() * tensor.element_size() < OUT_OF_BAND_MIN_BYTES:
        return None
    plain = tensor.detach().resolve_conj().resolve_neg().to("cpu").contiguous()
    import ctypes

    keep_alive.append(plain)
    raw = (ctypes.c_char * (plain.numel() * plain.element_size())).from_address(plain.data_ptr())
    parameter = type(tensor) is torch.nn.Parameter
    return _rebuild_tensor, (pickle.PickleBuffer(raw), str(plain.dtype), tuple(plain.shape), tensor.requires_grad, parameter)


def _rebuild_tensor(buffer, dtype: str, shape: tuple, requires_grad: bool, parameter: bool):
    """In the caller: a tensor over the buffer's memory, which the mapped file keeps alive."""
    import torch

    flat = torch.frombuffer(buffer, dtype=torch.uint8) if len(buffer) else torch.empty(0, dtype=torch.uint8)
    tensor = flat.view(getattr(torch, dtype.removeprefix("torch."))).reshape(shape)
    if parameter:
        return torch.nn.Parameter(tensor, requires_grad=requires_grad)
    return tensor.requires_grad_(requires_grad)
