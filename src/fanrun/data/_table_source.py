"""A table as TableDataset reads it: its files, their row groups (the pieces an epoch orders),
the rows a Delta deletion vector removes, and the columns asked for.

Parquet files and directories (hive partitions too) are opened with pyarrow's datasets; Delta
tables with the `deltalake` package (delta-rs), which gives the files of a version, their
partition values and their deletion vectors. Either way the rows are read by pyarrow, one row
group at a time, and a filter is applied as _table_filter.py says. A remote table's footers are
read in place, its files through the node's file cache (_table_remote.py). Every problem found
is a TableError that names the table and the file.
"""

from __future__ import annotations

import dataclasses
import os
import urllib.parse
from collections.abc import Sequence
from typing import Any

from .._errors import FanrunError, TableError
from ._cache import open_cache_dir
from ._dataset_source import once_per_run
from ._table_filter import RowFilter
from ._table_deadline import delta_options, waits_named
from ._table_remote import RemoteFiles
from ._table_store import open_store


@dataclasses.dataclass(frozen=True)
class TableFile:
    path: str  # on `filesystem`
    source: str  # its URL (a remote table's) or local path: what the cache and the messages name
    partition: dict[str, Any]  # the partition columns' values, constant over the file
    keep: Any = None  # numpy bool mask of the file's rows that a deletion vector leaves, or None


@dataclasses.dataclass(frozen=True)
class Piece:
    """One row group of one file: `rows` live rows, from the file's row `first_row` on; with
    `filtered`, those of its rows that the deletion vector leaves and the filter passes."""

    file: int
    row_group: int
    first_row: int
    stored_rows: int
    rows: int
    filtered: bool = False


class TableSource:
    def __init__(self, uri: str, *, columns: Sequence[str] | None, filter: Any, version: int | None,
                 storage_options: dict | None, cache_dir: str, cache_limit: int,
                 fetch_timeout: float | None = None) -> None:
        try:
            import pyarrow.fs  # noqa: F401  (whether it is installed)
        except ImportError:
            raise TableError(f"table {uri}: reading tables needs pyarrow: pip install 'fanrun[table]'") from None
        self.uri = str(uri)
        self._open: dict[int, Any] = {}  # readers of files, by index: counting a filter's rows opens them too
        storage_options = dict(storage_options or {})
        self._fetch_timeout = fetch_timeout
        with waits_named("Opening the table", self.uri, fetch_timeout):
            self._open_table(columns, filter, version, storage_options, cache_dir, cache_limit, fetch_timeout)

    def _open_table(self, columns: Sequence[str] | None, filter: Any, version: int | None, storage_options: dict,
                    cache_dir: str, cache_limit: int, fetch_timeout: float | None) -> None:
        import pyarrow.fs

        store = open_store(self.uri, storage_options, fetch_timeout)
        self.filesystem, root = store.filesystem, store.root
        if _is_delta(self.filesystem, root):
            self.kind = "Delta table"
            self.schema, files, partition_names = _delta(self.uri, self.filesystem, root, version,
                                                         delta_options(self.uri, storage_options, fetch_timeout))
        else:
            if version is not None:
                raise TableError(f"table {self.uri}: version={version} asks for a Delta table's version, and this is "
                                 f"no Delta table (no _delta_log folder): leave version unset")
            self.kind = "Parquet table"
            self.schema, files, partition_names = _parquet(self.filesystem, root, self.uri, store.by_fsspec)
        at = f" at version {version}" if version is not None else ""
        self.filter = RowFilter(filter, self.schema, partition_names, f"{self.kind} {self.uri}{at}") \
            if filter is not None else None
        self.files = self.filter.files(files, partition_names, self.filesystem) if self.filter is not None else files
        self.columns = self._columns(columns, version)
        self.remote = None
        if isinstance(self.filesystem, pyarrow.fs.LocalFileSystem):
            self.pieces = self._pieces()
        else:
            # Footers and sizes, asked of the store by one rank of the node; the others read them.
            cache_dir_fd = open_cache_dir(cache_dir)  # refused here, before any work, if not the caller's alone
            try:
                key = ["table", store.endpoint, self.uri, version, repr(filter)]
                pieces, sizes = once_per_run(key, self._layout, cache_dir, cache_dir_fd)
            finally:
                os.close(cache_dir_fd)
            self.pieces = [Piece(*piece) for piece in pieces]
            self.remote = RemoteFiles(self.filesystem, self.files, sizes, cache_dir, cache_limit, storage_options,
                                      store.endpoint, fetch_timeout)

    @property
    def num_rows(self) -> int:
        return sum(piece.rows for piece in self.pieces)

    def _columns(self, columns: Sequence[str] | None, version: int | None) -> list[str]:
        names = list(self.schema.names)
        if columns is None:
            return names
        if isinstance(columns, str):
            raise TypeError(f"columns must be a list of column names, not the string {columns!r}")
        missing = [c for c in columns if c not in names]
        if missing:
            at = f" at version {version}" if version is not None else ""
            raise TableError(f"{self.kind} {self.uri}{at} has no column {', '.join(map(repr, missing))}; "
                             f"its columns are {', '.join(names)}")
        return list(columns)

    def _layout(self) -> list:
        """The pieces and the files' sizes, as JSON holds them."""
        sizes = [info.size for info in self.filesystem.get_file_info([f.path for f in self.files])]
        return [[dataclasses.astuple(piece) for piece in self._pieces()], sizes]

    def _pieces(self) -> list[Piece]:
        """Every row group with rows left, and how many: those the deletion vector leaves, and
        where the filter names columns other than partitions, those of them it passes."""
        import pyarrow.dataset as ds

        by_rows = self.filter is not None and not self.filter.partition_only
        parquet = ds.ParquetFileFormat()
        pieces = []
        for index, file in enumerate(self.files):
            try:
                with waits_named("The footer of", file.source, self._fetch_timeout):
                    fragment = parquet.make_fragment(file.path, filesystem=self.filesystem,
                                                     partition_expression=self.filter.partition_expression(file.partition)
                                                     if by_rows else None)
                    metadata = fragment.metadata
            except TableError:
                raise  # a footer that never came, named so
            except FileNotFoundError:
                raise TableError(self._missing(file)) from None
            except Exception as error:
                raise TableError(f"{self.kind} {self.uri}: its file {file.source} is not a readable Parquet file "
                                 f"({type(error).__name__}: {error})") from None
            candidates = set(self.filter.row_groups(fragment, metadata.num_row_groups)) if by_rows else None
            first = 0
            for group in range(metadata.num_row_groups):
                stored = metadata.row_group(group).num_rows
                piece = Piece(index, group, first, stored, stored, by_rows)
                first += stored
                if candidates is not None and group not in candidates:
                    continue  # its statistics rule every row out
                if by_rows:
                    live = self._live_rows(piece, self.filter.columns, self.filter).num_rows
                else:
                    live = stored if file.keep is None else int(file.keep[piece.first_row:piece.first_row + stored].sum())
                if live:
                    pieces.append(dataclasses.replace(piece, rows=live))
        self.close_files()
        return pieces

    def _missing(self, file: TableFile) -> str:
        if self.kind == "Delta table":
            return (f"Delta table {self.uri}: its log names the file {file.source}, which does not exist (removed by "
                    f"hand, or by a VACUUM of a version still read); read another version, or repair the table")
        return f"{self.kind} {self.uri}: its file {file.source} disappeared while the table was opened"

    def read(self, piece: Piece):
        """The piece's live rows, as a pyarrow Table of the asked columns."""
        if not piece.filtered:
            return self._live_rows(piece, self.columns)
        extra = [c for c in self.filter.columns if c not in self.columns]
        table = self._live_rows(piece, self.columns + extra, self.filter)
        if table.num_rows != piece.rows:
            raise TableError(f"{self.kind} {self.uri}: row group {piece.row_group} of {self.files[piece.file].source} "
                             f"now gives {table.num_rows} rows through the filter where it gave {piece.rows} when the "
                             f"table was opened: its file was rewritten in place; open the table again")
        return table.drop_columns(extra) if extra else table

    def _live_rows(self, piece: Piece, columns: list[str], row_filter: RowFilter | None = None):
        """The piece's rows that the deletion vector leaves (and `row_filter` passes), as a pyarrow
        Table of `columns` in the table's types: partition values and columns a file lacks filled in."""
        import pyarrow as pa

        file = self.files[piece.file]
        reader = self._reader(piece.file)
        stored = [c for c in columns if c not in file.partition and c in reader.schema_arrow.names]
        try:
            # One thread in a DataLoader worker: the workers are the parallelism, and Arrow's
            # pool in each of them made a row group of numbers decode 5x slower on 2 cores.
            table = reader.read_row_group(piece.row_group, columns=stored, use_threads=not _in_loader_worker())
        except Exception as error:
            raise TableError(f"{self.kind} {self.uri}: row group {piece.row_group} of {file.source} cannot be read "
                             f"({type(error).__name__}: {error})") from None
        if file.keep is not None:
            table = table.filter(pa.array(file.keep[piece.first_row:piece.first_row + piece.stored_rows]))
        arrays = []
        for name in columns:
            field = self.schema.field(name)
            if name in file.partition:
                arrays.append(pa.repeat(pa.scalar(file.partition[name], type=field.type), table.num_rows))
            elif name in table.column_names:
                arrays.append(table.column(name).cast(field.type) if table.schema.field(name).type != field.type
                              else table.column(name))
            else:  # a column added after this file was written: null in its rows
                arrays.append(pa.nulls(table.num_rows, type=field.type))
        table = pa.Table.from_arrays(arrays, names=columns)
        return row_filter.apply(table) if row_filter is not None else table

    def prefetch(self, indices: list[int]) -> None:
        """Files read soon: a remote table's are fetched into the cache meanwhile."""
        if self.remote is not None:
            self.remote.prefetch(indices)

    def close_files(self) -> None:
        while self._open:
            self._close(next(iter(self._open)))

    def _reader(self, index: int):
        import pyarrow.parquet as pq

        reader = self._open.get(index)
        if reader is None:
            if len(self._open) >= OPEN_FILES:
                self._close(next(iter(self._open)))
            try:
                if self.remote is None:
                    reader = pq.ParquetFile(self.filesystem.open_input_file(self.files[index].path))
                else:
                    path = self.remote.acquire(index)
                    try:
                        reader = pq.ParquetFile(path)
                    except BaseException:
                        self.remote.release(index)
                        raise
            except FileNotFoundError:
                raise TableError(self._missing(self.files[index])) from None
            except FanrunError as error:  # the engine's message names the source and the attempts
                raise TableError(f"{self.kind} {self.uri}: {error}") from None
            self._open[index] = reader
        return reader

    def _close(self, index: int) -> None:
        self._open.pop(index).close()
        if self.remote is not None:
            self.remote.release(index)

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_open"] = {}  # open files stay in the process that opened them
        return state


# Parquet files a reader keeps open: a worker's region goes through its row groups in order.
OPEN_FILES = 8


def _is_delta(filesystem, root: str) -> bool:
    import pyarrow.fs

    info = filesystem.get_file_info(root.rstrip("/") + "/_delta_log")
    return info.type == pyarrow.fs.FileType.Directory


def _parquet(filesystem, root: str, uri: str, by_fsspec: bool):
    import pyarrow.dataset as ds
    import pyarrow.fs

    if by_fsspec:
        # fsspec's own listing (HTTP's too, where a folder looks like a file), then pyarrow's
        # dataset of those files, their hive partitions taken from the paths below the root.
        source = _fsspec_parquet_files(filesystem.handler.fs, root, uri)
        options = {"partition_base_dir": root.rstrip("/")}
    else:
        if filesystem.get_file_info(root).type == pyarrow.fs.FileType.NotFound:
            raise TableError(f"table {uri} does not exist")
        source, options = root, {}
    try:
        dataset = ds.dataset(source, format="parquet", partitioning="hive", filesystem=filesystem,
                             exclude_invalid_files=False, **options)
    except Exception as error:
        raise TableError(f"Parquet table {uri}: cannot be opened ({type(error).__name__}: {error})") from None
    fragments = list(dataset.get_fragments())
    if not fragments:
        raise TableError(f"Parquet table {uri} holds no Parquet file")
    # The keys found in the files' paths: pyarrow's partitioning of a single file also lists
    # the file's own columns, which no path gives a value of.
    files = [TableFile(f.path, _url(filesystem, f.path), ds.get_partition_keys(f.partition_expression)) for f in fragments]
    partition_names = list(dict.fromkeys(name for f in files for name in f.partition))
    return dataset.schema, sorted(files, key=lambda f: f.path), partition_names


def _fsspec_parquet_files(fs, root: str, uri: str) -> list[str]:
    """The Parquet files below `root` on fsspec's filesystem, as pyarrow's datasets choose them:
    none whose name starts with '_' or '.', at any level (_SUCCESS, _delta_log, .crc files)."""
    if not fs.exists(root):
        raise TableError(f"table {uri} does not exist")
    if not fs.isdir(root):  # HTTP's filesystem says "file" for any URL that answers, so asked second
        return [root]
    base = root.rstrip("/")
    # An HTTP server's index gives the names percent-encoded ("day%3D2026-11-30"): decoded, the
    # hive partitions are found in them, and the server is asked for the same files.
    http = urllib.parse.urlsplit(base).scheme in ("http", "https")
    found = []
    for path, info in sorted(fs.find(root, detail=True).items()):
        path = urllib.parse.unquote(path) if http else path
        relative = path[len(base):].strip("/") if path.startswith(base) else path.rsplit("/", 1)[-1]
        if info.get("type") != "directory" and not any(part[:1] in ("_", ".") for part in relative.split("/")):
            found.append(path)
    return found


def _url(filesystem, path: str) -> str:
    """What the cache and the messages name a file by: its URL, or a local file's path."""
    import pyarrow.fs

    if isinstance(filesystem, pyarrow.fs.LocalFileSystem):
        return path
    if isinstance(filesystem, pyarrow.fs.PyFileSystem):
        return filesystem.handler.fs.unstrip_protocol(path)
    return f"{filesystem.type_name}://{path}"


def _delta(uri: str, filesystem, root: str, version: int | None, storage_options: dict):
    import pyarrow as pa

    try:
        from deltalake import DeltaTable
    except ImportError:
        raise TableError(f"table {uri} is a Delta table: pip install deltalake to read it") from None
    try:
        table = DeltaTable(uri, version=version, storage_options=storage_options or None)
    except Exception as error:
        raise TableError(f"Delta table {uri}: cannot be opened{f' at version {version}' if version is not None else ''} "
                         f"({type(error).__name__}: {error})") from None
    schema = pa.schema(table.schema().to_arrow())
    partition_names = list(table.metadata().partition_columns)
    actions = pa.table(table.get_add_actions(flatten=True)).to_pylist()
    masks = {}
    for batch in pa.RecordBatchReader.from_stream(table.deletion_vectors()):
        for path, keep in zip(batch.column("filepath").to_pylist(), batch.column("selection_vector").to_pylist()):
            masks[path] = keep
    import numpy

    base = root.rstrip("/")
    files = []
    for action in actions:
        relative = urllib.parse.unquote(action["path"])
        path = relative if "://" in relative else f"{base}/{relative}"
        keep = masks.get(f"{table.table_uri.rstrip('/')}/{action['path']}")
        partition = {name: action.get(f"partition.{name}") for name in partition_names}
        files.append(TableFile(path, _url(filesystem, path), partition,
                               numpy.asarray(keep, dtype=bool) if keep is not None else None))
    if not files:
        raise TableError(f"Delta table {uri}{f' at version {version}' if version is not None else ''} has no rows")
    return schema, sorted(files, key=lambda f: f.path), partition_names


def _in_loader_worker() -> bool:
    import torch.utils.data

    return torch.utils.data.get_worker_info() is not None
