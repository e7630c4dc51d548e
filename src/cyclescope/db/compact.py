"""Compaction: merge the live segments of one epoch/host into one.

After compaction, the size depends on the number of distinct
(image, offset, event, process) keys, not on how many flushes (or samples)
produced them. Safe against crashes at any point (see layout.py).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import pyarrow as pa

from cyclescope.db.layout import Database, SegmentRef, own_segments
from cyclescope.db.segment import SCHEMA, SegmentMeta, read_meta, read_table, write_parquet
from cyclescope.errors import DataError


@dataclass
class CompactResult:
    epoch: int
    host: str
    merged: int
    bytes_before: int
    bytes_after: int
    rows_before: int
    rows_after: int
    skipped_corrupt: list[str]


def fill_weights(table: pa.Table, meta: SegmentMeta) -> pa.Table:
    """A segment from before weights: each row weighed by its event's mean period in that segment."""
    if "weight" in table.column_names and table.column("weight").null_count == 0:
        return table
    import numpy as np

    events = table.column("event").to_pylist()
    mean = {e: m.mean_period for e, m in meta.events.items()}
    w = np.rint(table.column("count").to_numpy(zero_copy_only=False).astype(np.float64)
                * np.array([mean.get(e, 0.0) for e in events], np.float64)).astype(np.uint64)
    if "weight" in table.column_names:
        table = table.drop_columns(["weight"])
    return table.append_column("weight", pa.array(w, pa.uint64()))


def merge_tables(tables: list[pa.Table]) -> pa.Table:
    """Sum counts over equal keys; sorted by (image, event, process, offset) like a flush."""
    import pyarrow.compute as pc  # not at import time: recording never needs it
    plain_schema = pa.schema([(f.name, f.type.value_type if pa.types.is_dictionary(f.type) else f.type)
                              for f in SCHEMA])
    t = pa.concat_tables([x.select(SCHEMA.names).cast(plain_schema) for x in tables])
    keys = ["image", "offset", "event", "process"]
    g = t.group_by(keys, use_threads=False).aggregate([("count", "sum"), ("weight", "sum")])
    g = g.rename_columns([n[:-4] if n.endswith("_sum") else n for n in g.column_names])
    g = g.sort_by([("image", "ascending"), ("event", "ascending"), ("process", "ascending"),
                   ("offset", "ascending")])
    cols = []
    for f in SCHEMA:
        col = g.column(f.name)
        cols.append(pc.dictionary_encode(col).cast(f.type) if pa.types.is_dictionary(f.type) else col.cast(f.type))
    return pa.Table.from_arrays(cols, schema=SCHEMA)


def compact(db: Database, epoch: int, host: str, min_segments: int = 2) -> CompactResult | None:
    """Merge the live segments of ``epoch``/``host``; None when there is nothing to do."""
    with db.host_lock(epoch, host) as d:
        db.clean_temp(d)
        live = db.segments(epoch, host)
        delete_covered(db.segments(epoch, host, live_only=False), live)
        readable: dict[str, tuple[SegmentRef, SegmentMeta, pa.Table]] = {}
        corrupt: list[SegmentRef] = []
        for s in live:
            try:
                readable[s.name] = (s, read_meta(s.path), read_table(s.path))
            except DataError:
                corrupt.append(s)  # leave it alone: compaction never destroys data
        # The merged range must not swallow a corrupt segment it did not read.
        run = contiguous_run([r[0] for r in readable.values()], corrupt)
        if len(run) < min_segments:
            return None
        good = run
        metas = [readable[s.name][1] for s in run]
        tables = [readable[s.name][2] for s in run]
        merged = merge_tables([fill_weights(t, m) for t, m in zip(tables, metas, strict=True)])
        meta = metas[0]
        for m in metas[1:]:
            meta.merge(m)
        first, last = good[0].first, good[-1].last
        meta.first, meta.last = first, last
        tmp = db.temp_path(d)
        try:
            write_parquet(merged, tmp, meta)
            final = db.link_new(tmp, d, first, last)
        finally:
            if tmp.exists():
                tmp.unlink()
        before = sum(s.path.stat().st_size for s in good)
        rows_before = sum(t.num_rows for t in tables)
        for s in good:
            with contextlib.suppress(FileNotFoundError):
                s.path.unlink()
        return CompactResult(epoch, host, len(good), before, final.stat().st_size, rows_before, merged.num_rows,
                             [c.name for c in corrupt])


def contiguous_run(good: list[SegmentRef], corrupt_ranges: list[SegmentRef]) -> list[SegmentRef]:
    """The longest run of readable segments with no corrupt segment inside its range, among the
    database's own (files shipped from other hosts are theirs to compact)."""
    runs: list[list[SegmentRef]] = [[]]
    for s in own_segments(sorted(good)):
        if runs[-1] and any(runs[-1][-1].last < c.first < s.first for c in corrupt_ranges):
            runs.append([])
        runs[-1].append(s)
    return max(runs, key=len)


def delete_covered(every: list[SegmentRef], live: list[SegmentRef]) -> None:
    """Remove the files of ``every`` that are not ``live``: those a finished compaction covers (left
    over by a crash between linking the merged file and deleting its inputs)."""
    names = {s.name for s in live}
    for s in every:
        if s.name not in names:
            with contextlib.suppress(FileNotFoundError):
                s.path.unlink()
