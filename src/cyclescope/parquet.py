"""Parquet files of the local file system, written and read through the classes that
``pyarrow.parquet`` itself wraps (``pyarrow._parquet``'s writer and reader).

Why not ``pyarrow.parquet``: importing it imports ``pyarrow.fs``, and with it the S3, GCS,
Azure and HDFS file systems and OpenSSL, none of which a local file needs: 9 MiB of a daemon's
resident memory (its budget is 100 MiB) and 25-30 ms of every command's start-up. What the
wrapper adds is nothing but ``pyarrow.parquet``'s own defaults (format version 2.6, data pages
v1), so the files are the same bytes (tests/unit/test_parquet.py checks it); should a pyarrow
lack the private classes, ``pyarrow.parquet`` is used instead.
"""

from __future__ import annotations

from pathlib import Path
from types import TracebackType
from typing import Any, BinaryIO

import numpy as np
import pyarrow as pa

try:
    from pyarrow._parquet import FileMetaData, ParquetReader
    from pyarrow._parquet import ParquetWriter as _ParquetWriter
except ImportError:  # pragma: no cover - every pyarrow since 0.x has them
    _ParquetWriter = None
    from pyarrow.parquet import FileMetaData

Where = str | Path | BinaryIO

# Arrow's fixed-width numeric types and the numpy dtypes with their layout (from_numpy).
_LAYOUT = {pa.int8(): "i1", pa.int16(): "<i2", pa.int32(): "<i4", pa.int64(): "<i8", pa.uint8(): "u1",
           pa.uint16(): "<u2", pa.uint32(): "<u4", pa.uint64(): "<u8", pa.float32(): "<f4", pa.float64(): "<f8"}


def from_numpy(values: Any, type_: pa.DataType) -> pa.Array:
    """pa.array(values, type_) for a 1-D array of numbers, built on its buffer. pa.array checks
    every numpy input for a masked array, and the check's first use imports numpy.ma: about 20 ms
    of a recording's first flush. Values are converted as numpy's astype does (the callers' are
    in range); other types (strings) go through pa.array as a list."""
    layout = _LAYOUT.get(type_)
    if layout is None:
        return pa.array(values.tolist() if isinstance(values, np.ndarray) else values, type_)
    a = np.ascontiguousarray(values, dtype=layout)
    return pa.Array.from_buffers(type_, len(a), [None, pa.py_buffer(a)])


# pyarrow.parquet.ParquetWriter's defaults that the class it wraps leaves to Parquet's C++ library.
_DEFAULTS = {"version": "2.6", "data_page_version": "1.0", "writer_engine_version": "V2"}


class Writer:
    """A Parquet file written a table (one or more row groups) at a time; closed on leaving a
    ``with`` block, as pyarrow.parquet.ParquetWriter is."""

    def __init__(self, where: Where, schema: pa.Schema, **options: Any) -> None:
        if _ParquetWriter is None:  # pragma: no cover
            import pyarrow.parquet as pq

            self._w: Any = pq.ParquetWriter(where, schema, **options)
        else:
            self._w = _ParquetWriter(where, schema, **{**_DEFAULTS, **options})

    def write_table(self, table: pa.Table, row_group_size: int | None = None) -> None:
        self._w.write_table(table, row_group_size=row_group_size)

    def close(self) -> None:
        self._w.close()

    def __enter__(self) -> Writer:
        return self

    def __exit__(self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.close()


def write_table(table: pa.Table, where: Where, **options: Any) -> None:
    with Writer(where, table.schema, **options) as w:
        w.write_table(table)


class File:
    """A Parquet file opened for reading: its footer (``metadata``, ``schema``) and its columns."""

    def __init__(self, source: Where) -> None:
        if _ParquetWriter is None:  # pragma: no cover
            import pyarrow.parquet as pq

            self._f: Any = pq.ParquetFile(source)
            self.metadata: FileMetaData = self._f.metadata
            self.schema: pa.Schema = self._f.schema_arrow
            return
        r = ParquetReader()
        r.open(source if not isinstance(source, Path) else str(source))
        self._f = r
        self.metadata = r.metadata
        self.schema = r.schema_arrow

    def read(self, columns: list[str] | None = None) -> pa.Table:
        if _ParquetWriter is None:  # pragma: no cover
            return self._f.read(columns=columns)
        idx = None if columns is None else [self._f.column_name_idx(c) for c in columns]
        return self._f.read_all(column_indices=idx, use_threads=True)

    def close(self) -> None:
        self._f.close()

    def __enter__(self) -> File:
        return self

    def __exit__(self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.close()


def read_metadata(source: Where) -> FileMetaData:
    with File(source) as f:
        return f.metadata


def read_schema(source: Where) -> pa.Schema:
    with File(source) as f:
        return f.schema


def read_table(source: Where, columns: list[str] | None = None) -> pa.Table:
    with File(source) as f:
        return f.read(columns)
