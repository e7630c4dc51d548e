"""Tallies: small per-flush tables of counts that merge by addition.

The evidence calc rests on besides the flat samples (loop iterations counted between samples,
branch outcomes on sampled paths, exact counts of anchors) is a set of numbers per key, each a
sum over samples or hits, so that flushes, epochs and hosts merge by adding them, like the flat
counts. Each kind lives in ``epoch=N/host=H/<kind>/<prefix>-A-B.parquet``, written and compacted
under the segments' rules (layout.py): a temporary file, fsync, a link to a name no other file
has; a compaction covering flushes A..B is linked before its inputs are deleted, and readers take
only the files no other strictly covers, so a crash between the two counts nothing twice. A
corrupt file is never merged nor deleted; readers skip it and say so.

These tables hold counts, not values: no register or memory value of a sampled process is stored
here (value sampling's hotlists, which hold values, live apart and stay opt-in: db/values.py).
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from cyclescope import parquet
from cyclescope.arrays import group
from cyclescope.db.compact import CompactResult, contiguous_run, delete_covered
from cyclescope.db.layout import Database, SegmentRef, files_named, fsync_dir, fsync_file, live_segments, own_segments
from cyclescope.errors import DataError
from cyclescope.parquet import from_numpy

META_KEY = b"cyclescope-tally"


@dataclass(frozen=True)
class TallyKind:
    """One kind of tally: where its files live, the columns that key a row (the image key first)
    and the columns summed when rows with equal keys meet."""

    name: str  # directory under the host's
    prefix: str  # file name prefix
    keys: tuple[tuple[str, pa.DataType], ...]
    sums: tuple[tuple[str, pa.DataType], ...]
    first: str = "image"  # the leading key, a string column stored as a dictionary

    @property
    def schema(self) -> pa.Schema:
        fields = [(self.first, pa.dictionary(pa.int32(), pa.string()))]
        fields += [(n, t) for n, t in self.keys if n != self.first]
        fields += list(self.sums)
        return pa.schema(fields)

    @property
    def key_names(self) -> list[str]:
        return [self.first, *[n for n, _ in self.keys if n != self.first]]

    @property
    def sum_names(self) -> list[str]:
        return [n for n, _ in self.sums]


# Loops whose iterations a counter register gives between two samples of one thread
# (analysis/loopcount.py): per loop header, the samples in the loop ("own", with the sum of their
# periods), how many of them had a next sample of the same thread ("followed") and how many of
# those were in the loop too ("next_own"), and over the pairs in the same execution of the loop
# ("pairs") the iterations between them and the sum of the second samples' periods.
LOOPS = TallyKind(
    "loops", "lc",
    keys=(("image", pa.string()), ("header", pa.uint64())),
    sums=(("own", pa.uint64()), ("own_period", pa.float64()), ("followed", pa.uint64()),
          ("next_own", pa.uint64()), ("pairs", pa.uint64()), ("iterations", pa.uint64()),
          ("pair_period", pa.float64()), ("mismatched", pa.uint64()), ("rejected", pa.uint64()),
          ("trip_samples", pa.uint64()), ("inv_trip", pa.float64())),
)

# Exact counts of procedures' entries in windows (analysis/anchors.py): per probed instruction (a
# procedure's entry, or a scale point: a rare block of a procedure whose entry is too short to count
# undisturbed), the uprobe's hits, the procedure's own samples of the time event taken in the same
# windows by the same tasks (and of those, the ones in the probe's first bytes), the time counted and
# the windows.
ANCHORS = TallyKind(
    "anchors", "an",
    keys=(("image", pa.string()), ("entry", pa.uint64())),
    sums=(("hits", pa.uint64()), ("samples", pa.uint64()), ("counted_s", pa.float64()), ("windows", pa.uint64()),
          ("near", pa.uint64())),
)

# Loops' headers and hot blocks counted beside their procedure's entry in the same windows
# (analysis/trips.py): per procedure entry and point (the entry itself, a loop header or a block's
# first instruction), the hits counted, the windows, and the entry's hits in those windows.
# Only the ratios between one entry's points mean anything: each window counted them all together.
# A point's windows are not all of its entry's where the points changed between flushes (a block
# near BLOCK_SHARE in one run and not the next): its ratio to the entry is hits / entry_hits
# (0 in tallies older than it: the entry's own hits then).
TRIPS = TallyKind(
    "trips", "tw",
    keys=(("image", pa.string()), ("entry", pa.uint64()), ("point", pa.uint64())),
    sums=(("hits", pa.uint64()), ("windows", pa.uint64()), ("entry_hits", pa.uint64())),
)

# Scale points (analysis/trips.py, "Scale windows"): per procedure entry and point (the site of a
# block, where it is probed), the point's hits and the entry's hits in the same windows, which
# counted the entry and a few rare blocks together and nothing else; the windows, and the sums of
# the squares and products of each window's two counts (how far the windows agree: rare blocks run
# in bursts). The ratio entry_hits / hits carries an anchor's count of the point (ANCHORS, keyed by
# the point) to the entry.
SCALE = TallyKind(
    "scale", "sc",
    keys=(("image", pa.string()), ("entry", pa.uint64()), ("point", pa.uint64())),
    sums=(("hits", pa.uint64()), ("entry_hits", pa.uint64()), ("windows", pa.uint64()),
          ("hits_sq", pa.float64()), ("entry_sq", pa.float64()), ("cross", pa.float64())),
)

# Arguments that move forward through a run (analysis/progress.py): per procedure entry and value
# (0-5: the argument registers rdi, rsi, rdx, rcx, r8, r9; 6-21: a general register at the
# procedure's progress point, perf's order), from consecutive samples of a thread in the
# procedure (the loop counters' side) the pairs whose move was known, their moves and time, and the
# pairs that went back or jumped, with their time; from the trip windows' entry hits the windows,
# their entries - 1 and moves, the windows whose move went back, and the sums of squares and products
# of the windows' moves and steps (the stride's error); and from the windows and the samples around
# them (the loop counter's side: loopcount.LoopCounter._local_rates), the windows whose entries per
# unit of time were found, and the sums of those rates and of their squares. Sums of moves and
# rates, never a value.
PROGRESS = TallyKind(
    "progress", "pg",
    keys=(("image", pa.string()), ("entry", pa.uint64()), ("arg", pa.uint32())),
    sums=(("pairs", pa.uint64()), ("delta", pa.float64()), ("pair_period", pa.float64()), ("back", pa.uint64()),
          ("back_period", pa.float64()), ("windows", pa.uint64()), ("window_steps", pa.uint64()),
          ("window_delta", pa.float64()), ("window_back", pa.uint64()), ("window_delta_sq", pa.float64()),
          ("window_steps_sq", pa.float64()), ("window_cross", pa.float64()), ("local_windows", pa.uint64()),
          ("local_rate", pa.float64()), ("local_rate_sq", pa.float64())),
)

# Samples over time (collect/timeline.py): per process name, 100 ms window (its start, in ms since
# the Unix epoch), process, thread and event, the samples and the sum of their periods (event
# units: nanoseconds of CPU for the clock events).
TIMELINE = TallyKind(
    "timeline", "tl",
    keys=(("process", pa.string()), ("window_ms", pa.int64()), ("pid", pa.int32()), ("tid", pa.int32()),
          ("event", pa.string())),
    sums=(("samples", pa.uint64()), ("period", pa.float64())),
    first="process",
)

KINDS = {k.name: k for k in (LOOPS, ANCHORS, TRIPS, SCALE, PROGRESS, TIMELINE)}


def tally_dir(db: Database, epoch: int, host: str, kind: TallyKind) -> Path:
    return db.host_dir(epoch, host) / kind.name


def tally_files(db: Database, epoch: int, host: str, kind: TallyKind, live_only: bool = True) -> list[SegmentRef]:
    out = files_named(tally_dir(db, epoch, host, kind), kind.prefix)
    return live_segments(out) if live_only else out


def build(kind: TallyKind, columns: dict[str, Any]) -> pa.Table:
    """A tally table from plain columns (image keys as strings, the rest numbers)."""
    arrays = []
    for f in kind.schema:
        col = columns[f.name]
        if pa.types.is_dictionary(f.type):
            # By hand rather than dictionary_encode, which imports pyarrow.compute (0.06 s of a
            # recording's first flush).
            names, idx = group(np.asarray(list(col), dtype=object)) if len(col) else (
                np.zeros(0, object), np.zeros(0, np.int64))
            arrays.append(pa.DictionaryArray.from_arrays(from_numpy(idx, pa.int32()),
                                                         pa.array(list(names), pa.string())))
        else:
            arrays.append(from_numpy(np.asarray(col), f.type))
    return pa.Table.from_arrays(arrays, schema=kind.schema)


def merge(kind: TallyKind, tables: list[pa.Table]) -> pa.Table:
    """Rows with equal keys summed; sorted by the keys."""
    if not tables:
        return kind.schema.empty_table()
    plain = pa.schema([(f.name, f.type.value_type if pa.types.is_dictionary(f.type) else f.type) for f in kind.schema])
    t = pa.concat_tables([x.select(kind.schema.names).cast(plain) for x in tables])
    if not t.num_rows:
        return kind.schema.empty_table()
    keys = kind.key_names
    g = t.group_by(keys, use_threads=False).aggregate([(n, "sum") for n in kind.sum_names])
    g = g.rename_columns([n[:-4] if n.endswith("_sum") else n for n in g.column_names])
    g = g.select(kind.schema.names).sort_by([(k, "ascending") for k in keys])
    cols = []
    import pyarrow.compute as pc

    for f in kind.schema:
        col = g.column(f.name)
        cols.append(pc.dictionary_encode(col).cast(f.type) if pa.types.is_dictionary(f.type) else col.cast(f.type))
    return pa.Table.from_arrays(cols, schema=kind.schema)


def _link(db: Database, d: Path, table: pa.Table, meta: dict[str, Any], first: int, last: int,
          kind: TallyKind) -> Path:
    tmp = db.temp_path(d)
    try:
        t = table.replace_schema_metadata({META_KEY: json.dumps(meta).encode()})
        parquet.write_table(t, tmp, compression="zstd")
        fsync_file(tmp)
        return db.link_new(tmp, d, first, last, prefix=kind.prefix)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()


def write_tally(db: Database, epoch: int, host: str, kind: TallyKind, table: pa.Table,
                meta: dict[str, Any] | None = None) -> Path:
    """One flush's tally of ``kind``, under the next free flush number of its directory."""
    with db.host_lock(epoch, host):
        d = db.ensure(tally_dir(db, epoch, host, kind))
        seq = max((s.last for s in own_segments(tally_files(db, epoch, host, kind, live_only=False))), default=0) + 1
        return _link(db, d, table, {"epoch": epoch, "host": host, "kind": kind.name, **(meta or {})}, seq, seq,
                     kind)


def read_tally(path: Path, kind: TallyKind) -> pa.Table:
    """One tally file (DataError when it cannot be read or is not of ``kind``)."""
    try:
        t = parquet.read_table(path)
        t.validate(full=True)  # damaged strings (invalid UTF-8) fail here, not later in a report
    except (OSError, pa.ArrowException, ValueError) as err:
        raise DataError(f"{path}: {err}") from None
    missing = [n for n in kind.schema.names if n not in t.column_names]
    if missing and any(n not in kind.sum_names for n in missing):
        raise DataError(f"{path}: not a cyclescope {kind.name} tally (no {', '.join(missing)} column)")
    for n in missing:  # a sum added since the file was written: zero
        t = t.append_column(n, pa.array(np.zeros(t.num_rows), kind.schema.field(n).type))
    return t


def compact_tallies(db: Database, epoch: int, host: str, kind: TallyKind, min_files: int = 2) -> CompactResult | None:
    """Merge the live files of ``kind`` in ``epoch``/``host`` into one covering their flush range;
    None when there is nothing to do. A corrupt file is left alone, outside the merged range."""
    with db.host_lock(epoch, host):
        d = tally_dir(db, epoch, host, kind)
        if not d.is_dir():
            return None
        db.clean_temp(d)
        live = tally_files(db, epoch, host, kind)
        delete_covered(tally_files(db, epoch, host, kind, live_only=False), live)
        readable: dict[str, pa.Table] = {}
        corrupt: list[SegmentRef] = []
        for s in live:
            try:
                readable[s.name] = read_tally(s.path, kind)
            except DataError:
                corrupt.append(s)
        run = contiguous_run([s for s in live if s.name in readable], corrupt)
        if len(run) < min_files:
            return None
        merged = merge(kind, [readable[s.name] for s in run])
        first, last = run[0].first, run[-1].last
        out = _link(db, d, merged, {"epoch": epoch, "host": host, "kind": kind.name}, first, last, kind)
        before = sum(s.path.stat().st_size for s in run)
        for s in run:
            with contextlib.suppress(FileNotFoundError):
                s.path.unlink()
        fsync_dir(d)
        return CompactResult(epoch, host, len(run), before, out.stat().st_size,
                             sum(readable[s.name].num_rows for s in run), merged.num_rows, [c.name for c in corrupt])


@dataclass
class TallySelection:
    table: pa.Table
    files: int = 0
    corrupt: list[str] = field(default_factory=list)


def load_tally(db: Database, kind: TallyKind, epochs: list[int], hosts: list[str] | None = None,
               images: set[str] | None = None) -> TallySelection:
    """The selection's rows of ``kind`` summed over flushes, epochs and hosts; ``images``: only
    these values of its first key (image keys; process names for TIMELINE). Corrupt files are
    skipped and listed."""
    import pyarrow.compute as pc

    tables = []
    out = TallySelection(kind.schema.empty_table())
    for epoch in epochs:
        for host in db.hosts(epoch):
            if hosts is not None and host not in hosts:
                continue
            for ref in tally_files(db, epoch, host, kind):
                try:
                    t = read_tally(ref.path, kind)
                except DataError as err:
                    out.corrupt.append(str(err))
                    continue
                out.files += 1
                if images is not None:
                    wanted = pa.array(sorted(images), pa.string())
                    t = t.filter(pc.is_in(t.column(kind.first).cast(pa.string()), wanted))
                tables.append(t)
    out.table = merge(kind, tables)
    return out
