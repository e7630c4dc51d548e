"""The distributed path: the aggregations behind prof, stats, diff, listings and flame graphs run on
Dask (``--engine dask``), the embedded DuckDB staying the default.

Why Dask rather than Spark: cyclescope is Python, and Dask is a Python library from PyPI, so its
workers run cyclescope's own readers (pyarrow over the same Parquet files, the stack files'
loader) with no JVM, no second implementation of the formats, and one `pip install` on each node;
a local cluster of worker processes is one call, and the same code runs on a cluster given its
scheduler's address (``--engine-address tcp://HOST:8786``), whose workers must see the database
at the same path (shared storage) and have cyclescope installed.

Each aggregation is a map over groups of files and a tree of combines (fan-in 8), so what crosses
the network is partial sums, not rows. A flat-count task runs the embedded engine's own query
(DuckDB, one thread) over its files, and a combine adds the partial sums with pyarrow; a stack
task reads its files into columns and sums equal stacks (db.stacks.StackArrays). The results are
those of the embedded engine: the same sums over the same live files.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import pyarrow as pa

from cyclescope.db.query import counts_sql, read_metas
from cyclescope.db.segment import SegmentMeta
from cyclescope.db.stacks import StackArrays, stack_arrays_of
from cyclescope.errors import DataError, UsageError

FAN_IN = 8
T = TypeVar("T")
# Partial sums arrive in a worker unpickled, their buffers not aligned as Arrow's query engine
# likes: copy them where it must rather than warn on every combine (set here, before the first
# group-by of a worker, which imports this module to run its tasks).
os.environ.setdefault("ACERO_ALIGNMENT_HANDLING", "reallocate")


_DUCK: Any = None


def partial_counts(files: Sequence[str], processes: list[str] | None, images: list[str] | None,
                   events: list[str] | None, by_process: bool) -> pa.Table:
    """One task: the embedded engine's query over ``files`` (one DuckDB connection per worker, one
    thread: the worker is the unit of parallelism)."""
    global _DUCK
    if _DUCK is None:
        import duckdb

        _DUCK = duckdb.connect(":memory:")
        _DUCK.execute("SET threads TO 1")
    sql, params = counts_sql(list(files), processes, images, events, by_process, ordered=False)
    return _DUCK.sql(sql, params=params).to_arrow_table()


def combine_counts(parts: Sequence[pa.Table], keys: list[str] | None = None) -> pa.Table:
    """Partial sums added per key."""
    parts = [p for p in parts if p.num_rows] or list(parts[:1])
    if not parts:
        return pa.table({})
    keys = keys or [n for n in parts[0].column_names if n not in ("raw", "w", "unweighted")]
    t = pa.concat_tables(parts) if len(parts) > 1 else parts[0]
    if not t.num_rows:
        return t
    g = t.group_by(keys, use_threads=False).aggregate([("raw", "sum"), ("w", "sum"), ("unweighted", "sum")])
    return g.rename_columns([n[:-4] if n.endswith("_sum") else n for n in g.column_names])


def partial_stacks(files: list[Path], images: set[str] | None, processes: set[str] | None,
                   events: set[str] | None) -> StackArrays:
    """One task: the stacks of ``files``, equal ones summed."""
    return stack_arrays_of(files, images, processes, events).summed()


def combine_stacks(parts: list[StackArrays]) -> StackArrays:
    return StackArrays.concat(parts).summed()


class DaskEngine:
    """Aggregations on a Dask cluster: a local one of ``workers`` processes, or the one whose
    scheduler is at ``address``."""

    name = "dask"

    def __init__(self, address: str | None = None, workers: int | None = None) -> None:
        try:
            from distributed import Client, LocalCluster
        except ImportError:
            raise UsageError("--engine dask needs Dask: pip install 'dask[distributed]' (scripts/setup does)") from None
        import logging

        logging.getLogger("distributed").setLevel(logging.ERROR)
        if address:
            try:
                self.client = Client(address, timeout="20s")  # type: ignore[no-untyped-call]
            except OSError as e:
                raise UsageError(f"--engine-address {address}: {e}") from None
            self.cluster = None
        else:
            n = workers or min(os.cpu_count() or 1, 8)
            self.cluster = LocalCluster(  # type: ignore[no-untyped-call]
                n_workers=n, threads_per_worker=1, processes=True, dashboard_address=None, silence_logs=logging.ERROR)
            self.client = Client(self.cluster)  # type: ignore[no-untyped-call]

    @property
    def workers(self) -> int:
        return max(1, len(self.client.scheduler_info().get("workers", {})))

    def _groups(self, files: Sequence[T]) -> list[list[T]]:
        """Files in groups: a few tasks per worker, so that a slow one does not hold up the rest."""
        n = max(1, min(len(files), self.workers * 4))
        size = -(-len(files) // n)
        return [list(files[i : i + size]) for i in range(0, len(files), size)]

    def _tree(self, map_fn: Callable[..., Any], combine: Callable[[list[Any]], Any], files: Sequence[Any],
              *args: Any) -> Any:
        futures = [self.client.submit(map_fn, g, *args, pure=False) for g in self._groups(files)]
        while len(futures) > 1:
            futures = [self.client.submit(combine, futures[i : i + FAN_IN], pure=False)
                       for i in range(0, len(futures), FAN_IN)]
        try:
            return futures[0].result()
        except FileNotFoundError:
            raise  # a compaction replaced a file since the listing: the caller lists again
        except (OSError, pa.ArrowException, ValueError) as e:
            raise DataError(f"query failed on dask: {e}") from None

    def counts(self, files: list[str], processes: list[str] | None, images: list[str] | None,
               events: list[str] | None, by_process: bool) -> pa.Table:
        keys = ["image", "event", "offset"] + (["process"] if by_process else [])
        if not files:
            return _empty(keys)
        t = self._tree(partial_counts, combine_counts, files, processes, images, events, by_process)
        if not t.num_rows:
            return _empty(keys)
        t = t.select([*keys, "raw", "w", "unweighted"]).sort_by([("image", "ascending"), ("event", "ascending"),
                                                                 ("offset", "ascending")])
        return t.set_column(t.column_names.index("raw"), "raw", t.column("raw").cast(pa.uint64()))

    def metas(self, files: list[Path]) -> tuple[list[SegmentMeta | str], dict[str, dict[str, Any]]]:
        if not files:
            return [], {}
        futures = self.client.map(read_metas, self._groups(files), pure=False)
        parts: list[tuple[list[SegmentMeta | str], dict[str, dict[str, Any]]]] = \
            self.client.gather(futures)  # type: ignore[no-untyped-call]
        images: dict[str, dict[str, Any]] = {}
        for _, im in parts:
            for k, v in im.items():
                images.setdefault(k, v)
        return [m for metas, _ in parts for m in metas], images

    def stack_arrays(self, files: list[Path], images: set[str] | None, processes: set[str] | None,
                     events: set[str] | None = None) -> StackArrays:
        if not files:
            return stack_arrays_of([])
        return self._tree(partial_stacks, combine_stacks, files, images, processes, events)  # type: ignore[no-any-return]

    def close(self) -> None:
        self.client.close()  # type: ignore[no-untyped-call]
        if self.cluster is not None:
            self.cluster.close()


def _empty(keys: list[str]) -> pa.Table:
    types = {"image": pa.string(), "event": pa.string(), "offset": pa.uint64(), "process": pa.string()}
    return pa.schema([(k, types[k]) for k in keys] + [("raw", pa.uint64()), ("w", pa.float64()),
                                                      ("unweighted", pa.float64())]).empty_table()
