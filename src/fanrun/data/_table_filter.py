"""A TableDataset's row filter: a pyarrow expression on any of the table's columns, checked
against them, that leaves out files by their partition values and row groups by their Parquet
statistics, and is then applied exactly to the rows of the row groups left.

Every rank must know how many rows each row group gives before any is read (the epoch's split
is by rows), so where the filter names a column that is not a partition column, the table's
opening reads the filter's columns of each row group that the statistics keep and counts the
rows that pass; reading such a row group later applies the filter again to the same rows.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence
from typing import Any

from .._errors import TableError

# pyarrow's words for a field the schema lacks: the name, or a nested reference's first name.
_NO_MATCH = re.compile(r"No match for FieldRef\.(?:Name\((.*)\) in |Nested\(FieldRef\.Name\((.*?)\) )")


class RowFilter:
    def __init__(self, expression: Any, schema, partition_names: Sequence[str], what: str) -> None:
        import pyarrow.compute as pc

        if not isinstance(expression, pc.Expression):
            raise TypeError(f"filter must be a pyarrow expression on the table's columns, such as "
                            f"pyarrow.compute.field('day') == '2026-11-30', not {type(expression).__name__}")
        self.expression = expression
        self.schema = schema
        self.what = what  # the table, as messages name it
        _bind(expression, schema, what)
        self.columns = _named_columns(expression, schema)
        self.partition_only = set(self.columns) <= set(partition_names)

    def apply(self, table):
        """The rows of `table` (holding self.columns) that pass; a null result leaves a row out."""
        return table.filter(self.expression)

    def files(self, files: list, partition_names: Sequence[str], filesystem) -> list:
        """The files that may hold passing rows: exactly those whose partition values pass where
        the filter names partition columns only; else those that pyarrow does not rule out by
        their partition values (a filter on other columns leaves every file of a table without
        partitions)."""
        import pyarrow as pa
        import pyarrow.dataset as ds

        if self.partition_only:
            values = pa.table({**{name: _typed([f.partition.get(name) for f in files], self.schema.field(name).type)
                                  for name in partition_names}, "__index": list(range(len(files)))})
            kept = ds.dataset(values).to_table(filter=self.expression, columns=["__index"]).column("__index")
            return [files[i] for i in kept.to_pylist()]
        if not partition_names:
            return files
        dataset = ds.FileSystemDataset.from_paths(
            [f.path for f in files], schema=self.schema, format=ds.ParquetFileFormat(), filesystem=filesystem,
            partitions=[self.partition_expression(f.partition) for f in files])
        kept_paths = {fragment.path for fragment in dataset.get_fragments(filter=self.expression)}
        return [f for f in files if f.path in kept_paths]

    def partition_expression(self, partition: dict):
        """What the file's partition values guarantee of its rows, for pyarrow's pruning."""
        import pyarrow as pa
        import pyarrow.compute as pc

        terms = []
        for name, value in partition.items():
            if name not in self.schema.names:
                continue
            if value is None:
                terms.append(pc.field(name).is_null())
                continue
            try:
                terms.append(pc.field(name) == pa.scalar(value).cast(self.schema.field(name).type))
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError):
                continue  # a value of another type guarantees nothing pyarrow can use; rows decide
        return functools.reduce(lambda a, b: a & b, terms) if terms else pc.scalar(True)

    def row_groups(self, fragment, num_row_groups: int) -> list[int]:
        """The row groups of a file's fragment that its statistics do not rule out."""
        import pyarrow as pa

        try:
            return [group.id for group in fragment.subset(filter=self.expression, schema=self.schema).row_groups]
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError):
            # Statistics of another type than the table's column (a file written before the
            # column's type was widened): they rule nothing out, the rows decide.
            return list(range(num_row_groups))


def _bind_error(expression, schema) -> Exception | None:
    """Why the expression cannot be evaluated on rows of `schema`, or None where it can."""
    import pyarrow as pa

    try:
        schema.empty_table().filter(expression)
    except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError) as error:
        return error
    return None


def _missing_name(error: Exception | None) -> str | None:
    found = _NO_MATCH.match(str(error)) if error is not None else None
    return (found.group(1) if found.group(1) is not None else found.group(2)) if found is not None else None


def _bind(expression, schema, what: str) -> None:
    error = _bind_error(expression, schema)
    if error is None:
        return
    columns = ", ".join(schema.names)
    missing = _missing_name(error)
    if missing is not None:
        raise TableError(f"{what}: the filter names {missing!r}, which is not one of its columns; "
                         f"those are {columns}") from None
    raise TableError(f"{what}: the filter cannot be applied to its columns ({columns}): "
                     f"{type(error).__name__}: {error}") from None


def _named_columns(expression, schema) -> list[str]:
    """The columns the expression names, in the schema's order: bound against none at first,
    each column pyarrow says is missing is added until it binds (a few tiny bindings, where
    trying the schema without each column in turn took 42 s for 2000 columns). Where pyarrow's
    words do not give a column of the schema (a reference by position), all of them."""
    import pyarrow as pa

    named: list[str] = []
    while True:
        error = _bind_error(expression, pa.schema([schema.field(name) for name in named]))
        if error is None:
            return [name for name in schema.names if name in named]
        missing = _missing_name(error)
        if missing is None or missing in named or missing not in schema.names:
            return list(schema.names)
        named.append(missing)


def _typed(values: list, kind):
    import pyarrow as pa

    try:
        return pa.array(values, type=kind)
    except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError):
        return pa.array(values)  # as the partition's path spelled them
