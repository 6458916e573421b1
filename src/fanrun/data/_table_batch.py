"""A batch of a table's rows as columns: a dict of tensors for numeric and boolean columns, lists
of Python values for the rest (format="torch").

In a DataLoader worker, every tensor of the batch is written into one shared-memory block, and
the batch travels to the rank's process as that block and where each column lies in it: torch
hands a block over as a descriptor, whatever its size, so a batch costs one hand-over instead of
one per column, and no column's values are pickled. The rank's process makes each column a view
of the block: the dict it gets is the dict the worker made.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.utils.data

# Each column starts at a multiple of this in the block, so that its view is aligned for any
# element type.
_ALIGN = 64


def to_columns(table) -> dict[str, Any]:
    """The batch in `table` (a pyarrow Table) as a dict of column to tensor or list; in a
    DataLoader worker, its tensors packed into one shared-memory block (ColumnBatch)."""
    arrays = {name: _numeric(column) for name, column in zip(table.column_names, table.columns)}
    if torch.utils.data.get_worker_info() is None:
        return {name: _tensor(values) if values is not None else _pylist(table.column(name))
                for name, values in arrays.items()}
    return ColumnBatch(table, arrays)


def _pylist(column) -> list:
    return column.to_pylist()


def _numeric(column):
    """A numpy view of the column where Arrow's memory allows it (integers and floats without
    nulls, fixed-size lists of them), a copy for booleans, None for anything else."""
    import pyarrow as pa

    array = column.combine_chunks() if column.num_chunks != 1 else column.chunk(0)
    kind = array.type
    if array.null_count:
        return None
    if pa.types.is_integer(kind) or pa.types.is_floating(kind):
        return array.to_numpy(zero_copy_only=True)
    if pa.types.is_boolean(kind):
        return array.to_numpy(zero_copy_only=False)
    if (pa.types.is_fixed_size_list(kind) and (pa.types.is_integer(kind.value_type) or pa.types.is_floating(kind.value_type))
            and array.values.null_count == 0):
        flat = array.values.slice(array.offset * kind.list_size, len(array) * kind.list_size)
        return flat.to_numpy(zero_copy_only=True).reshape(len(array), kind.list_size)
    return None


def _tensor(values) -> torch.Tensor:
    with warnings.catch_warnings():
        # Arrow's buffers are read-only; the tensor shares them (docs/tables.md).
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(values)


class ColumnBatch:
    """A batch on its way out of a DataLoader worker: its tensors in one shared-memory block, the
    other columns as lists. Unpickled, it is the batch's dict."""

    def __init__(self, table, arrays: dict) -> None:
        layout, offset = [], 0
        for name, values in arrays.items():
            if values is not None:
                layout.append((name, offset, values.nbytes, str(values.dtype), values.shape))
                offset += -(-values.nbytes // _ALIGN) * _ALIGN
        self.block = _shared_block(offset)
        memory = self.block.numpy()
        for (name, start, size, _, _), values in zip(layout, (v for v in arrays.values() if v is not None)):
            memory[start:start + size] = values.reshape(-1).view("uint8")
        self.layout = [(name, start, size, _DTYPES[dtype], shape) for name, start, size, dtype, shape in layout]
        self.order = list(arrays)
        self.lists = {name: _pylist(table.column(name)) for name, values in arrays.items() if values is None}

    def __reduce__(self):
        return _unpack, (self.block, self.layout, self.order, self.lists)


def _shared_block(size: int) -> torch.Tensor:
    """A uint8 tensor of `size` bytes made in shared memory at once, as torch's default_collate
    makes a worker's batch, so that handing it over copies nothing."""
    storage = torch.empty(0, dtype=torch.uint8)._typed_storage()._new_shared(max(size, 1))
    return torch.empty(0, dtype=torch.uint8).new(storage)[:size]


def _unpack(block: torch.Tensor, layout: list, order: list[str], lists: dict) -> dict[str, Any]:
    tensors = {name: block[start:start + size].view(dtype).reshape(shape) for name, start, size, dtype, shape in layout}
    return {name: tensors[name] if name in tensors else lists[name] for name in order}


_DTYPES = {str(torch.empty(0, dtype=dtype).numpy().dtype): dtype for dtype in (
    torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.uint16, torch.uint32,
    torch.uint64, torch.float16, torch.float32, torch.float64)}
