"""Selecting sample sets from the database and querying them with DuckDB.

A selection names epochs, hosts, processes, images and events. Corrupt
segments are skipped with a warning, so one bad file never hides the rest.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import pyarrow as pa

from cyclescope.db.layout import Database, SegmentRef
from cyclescope.db.segment import EventMeta, SegmentMeta, read_meta
from cyclescope.errors import DataError, NotFoundError, UsageError
from cyclescope.images.registry import ImageInfo

if TYPE_CHECKING:
    from cyclescope.db.stacks import StackArrays


@dataclass(frozen=True)
class Selection:
    epochs: str = "latest"  # "latest", "all", "3", "2-5", "1,4,7"
    hosts: tuple[str, ...] = ()
    processes: tuple[str, ...] = ()
    images: tuple[str, ...] = ()
    events: tuple[str, ...] = ()


def parse_epochs(spec: str, available: list[int]) -> list[int]:
    return epochs_and_notes(spec, available)[0]


def epochs_and_notes(spec: str, available: list[int]) -> tuple[list[int], list[str]]:
    """The epochs ``spec`` selects, and notes on the parts of ranges no epoch holds (a range is
    taken as far as epochs exist; the note says how far that was)."""
    notes: list[str] = []
    if not available:
        raise NotFoundError("the database holds no epochs yet (nothing recorded)")
    spec = spec.strip().lower()
    if spec in ("", "latest", "current"):
        return [available[-1]], notes
    if spec == "all":
        return list(available), notes
    out: set[int] = set()
    for part in spec.split(","):
        part = part.strip()
        m = re.fullmatch(r"(\d+)\s*-\s*(\d+)", part)
        try:
            if m:
                lo, hi = int(m.group(1)), int(m.group(2))
                if lo > hi:
                    raise UsageError(f"epoch range {part} runs backwards (try {hi}-{lo})")
                got = [e for e in available if lo <= e <= hi]
                out.update(got)
                if got and (got[0] != lo or got[-1] != hi or len(got) != hi - lo + 1):
                    notes.append(f"epochs {lo}-{hi}: only {_ranges(got)} exist")
            elif re.fullmatch(r"-\d+", part):  # -1 = latest, -2 = the one before
                k = int(part)
                if -k > len(available):
                    raise NotFoundError(f"epoch {part}: the database has only {len(available)} epoch(s)")
                out.add(available[k])
            else:
                e = int(part)
                if e not in available:
                    raise NotFoundError(f"no epoch {e} (epochs: {_ranges(available)})")
                out.add(e)
        except ValueError:
            raise UsageError(f"cannot parse epoch selection '{spec}' (try 3, 2-5, 1,4, -1, latest or all)") from None
    if not out:
        raise NotFoundError(f"no epoch matches '{spec}' (epochs: {_ranges(available)})")
    return sorted(out), notes


def _ranges(nums: list[int]) -> str:
    if not nums:
        return "none"
    parts = []
    start = prev = nums[0]
    for n in [*nums[1:], None]:
        if n is not None and n == prev + 1:
            prev = n
            continue
        parts.append(f"{start}" if start == prev else f"{start}-{prev}")
        if n is not None:
            start = prev = n
    return ",".join(parts)


class Engine(Protocol):
    """A query engine other than the embedded DuckDB (fleet/engine.py: Dask), for what grows with a
    fleet: the segments' footers, the flat counts and the call stacks."""

    name: str

    def counts(self, files: list[str], processes: list[str] | None, images: list[str] | None,
               events: list[str] | None, by_process: bool) -> pa.Table:
        """Per (image, event, offset[, process]) of ``files`` (segments) passing the filters: raw
        (sum of count, UBIGINT), w (sum of weight, DOUBLE) and unweighted (sum of count where
        weight is null, DOUBLE), sorted by image, event and offset: what the SQL below returns."""
        ...

    def stack_arrays(self, files: list[Path], images: set[str] | None, processes: set[str] | None,
                     events: set[str] | None = None) -> StackArrays:
        """load_stack_arrays over these stack files."""
        ...

    def metas(self, files: list[Path]) -> tuple[list[SegmentMeta | str], dict[str, dict[str, Any]]]:
        """See read_metas."""
        ...


def read_metas(files: list[Path]) -> tuple[list[SegmentMeta | str], dict[str, dict[str, Any]]]:
    """Each segment's metadata without its images, or why it could not be read ("missing" when it
    is gone), and the images of them all: a distributed engine's task over a group of files (what
    comes back is one description per image, not one per image and segment)."""
    out: list[SegmentMeta | str] = []
    images: dict[str, dict[str, Any]] = {}
    for f in files:
        try:
            m = read_meta(f)
        except DataError as e:
            out.append("missing" if not f.exists() else f"skipping {e}")
            continue
        for k, v in m.images.items():
            images.setdefault(k, v)
        m.images = {}
        out.append(m)
    return out, images


@dataclass
class SegmentInfo:
    epoch: int
    host: str
    ref: SegmentRef
    meta: SegmentMeta


@dataclass
class ProfileSet:
    """The segments a selection covers, with their merged metadata."""

    db: Database
    selection: Selection
    epochs: list[int]
    segments: list[SegmentInfo]
    images: dict[str, ImageInfo] = field(default_factory=dict)
    events: dict[str, EventMeta] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    lost_records: int = 0
    lost_samples: int = 0
    unknown: dict[str, int] = field(default_factory=dict)
    start_time: float = 0.0
    end_time: float = 0.0
    hosts: list[str] = field(default_factory=list)
    targets: list[str] = field(default_factory=list)
    memo: dict[tuple[bool, object], pa.Table] = field(default_factory=dict)  # query results
    clock_ghz: float = 0.0  # sample-weighted measured core clock (0: unknown)
    engine: Engine | None = None  # None: the embedded DuckDB

    @property
    def files(self) -> list[str]:
        return [str(s.ref.path) for s in self.segments]

    @property
    def event_names(self) -> list[str]:
        names = list(self.events)
        if self.selection.events:
            names = [e for e in names if e in self.selection.events]
        return names


def _host_segments(db: Database, epoch: int, host: str, warnings: list[str]) -> list[SegmentInfo]:
    """The live segments of one epoch/host with their metadata. A file that vanished between the
    listing and the read was replaced by a compaction: the directory is listed again."""
    for _attempt in range(5):
        out: list[SegmentInfo] = []
        bad: list[str] = []
        vanished = False
        for ref in db.segments(epoch, host):
            try:
                out.append(SegmentInfo(epoch, host, ref, read_meta(ref.path)))
            except DataError as e:
                if not ref.path.exists():
                    vanished = True
                    break
                bad.append(f"skipping {e}")
        if not vanished:
            warnings += bad
            return out
        time.sleep(0.02)
    warnings.append(f"epoch {epoch} host {host}: its segments kept changing while they were read; left out")
    return []


def open_profile(db: Database, sel: Selection, engine: Engine | None = None) -> ProfileSet:
    epochs, warnings = epochs_and_notes(sel.epochs, db.epochs())
    segs: list[SegmentInfo] = []
    images: dict[str, dict[str, Any]] = {}
    hosts_seen: set[str] = set()
    todo = []
    for ep in epochs:
        for h in db.hosts(ep):
            if sel.hosts and h not in sel.hosts:
                continue
            hosts_seen.add(h)
            todo.append((ep, h))
    if engine is None:
        for ep, h in todo:
            segs += _host_segments(db, ep, h, warnings)
    else:  # every footer at once, read by the engine's workers
        refs = [(ep, h, ref) for ep, h in todo for ref in db.segments(ep, h)]
        got, images = engine.metas([r.path for _, _, r in refs])
        redo = sorted({(ep, h) for (ep, h, _), m in zip(refs, got, strict=True) if m == "missing"})
        for (ep, h, ref), m in zip(refs, got, strict=True):
            if (ep, h) in redo:
                continue
            if isinstance(m, str):
                warnings.append(m)
            else:
                segs.append(SegmentInfo(ep, h, ref, m))
        for ep, h in redo:  # a compaction replaced files meanwhile: list those hosts again
            segs += _host_segments(db, ep, h, warnings)
    if sel.hosts:
        missing = set(sel.hosts) - hosts_seen
        if missing:
            raise NotFoundError(f"no samples from host(s) {', '.join(sorted(missing))} in the selected epoch(s)")
    profile_set = ProfileSet(db, sel, epochs, segs, warnings=warnings, hosts=sorted(hosts_seen), engine=engine)
    if engine is not None:
        profile_set.images = {k: ImageInfo.from_json(v) for k, v in images.items()}
    from cyclescope.db.segment import merge_clock

    weight = 0
    for s in segs:
        m = s.meta
        profile_set.clock_ghz = merge_clock(profile_set.clock_ghz, weight, m.clock_ghz, m.total_samples)
        weight += m.total_samples
        for k, v in m.images.items():
            if k not in profile_set.images:
                profile_set.images[k] = ImageInfo.from_json(v)
        for k, ev in m.events.items():
            if k in profile_set.events:
                profile_set.events[k].merge(ev)
            else:
                profile_set.events[k] = EventMeta(**vars(ev))
        profile_set.lost_records += m.lost_records
        profile_set.lost_samples += m.lost_samples
        for k, n in m.unknown.items():
            profile_set.unknown[k] = profile_set.unknown.get(k, 0) + n
        if m.start_time and (not profile_set.start_time or m.start_time < profile_set.start_time):
            profile_set.start_time = m.start_time
        profile_set.end_time = max(profile_set.end_time, m.end_time)
        for t in m.targets:
            if t not in profile_set.targets:
                profile_set.targets.append(t)
    if sel.events:
        unknown_ev = [e for e in sel.events if e not in profile_set.events]
        if unknown_ev and segs:
            raise NotFoundError(
                f"no samples of event(s) {', '.join(unknown_ev)}; recorded: {', '.join(profile_set.events) or 'none'}"
            )
    return profile_set


def match_images(profile_set: ProfileSet, patterns: Iterable[str]) -> list[str]:
    """Image keys whose key, path or file name equals a pattern (or whose path ends with it); a
    relative path naming an existing file (``./prog``) also matches that file's absolute path."""
    keys: list[str] = []
    for pat in patterns:
        full = os.path.abspath(pat) if "/" in pat and not pat.startswith("/") and os.path.exists(pat) else pat
        found = [
            k for k, info in profile_set.images.items()
            if pat in (k, info.path, Path(info.path).name) or full == info.path
            or info.path.endswith("/" + pat.lstrip("/"))
            or (info.build_id and info.build_id.startswith(pat) and len(pat) >= 8)
        ]
        if not found:
            raise NotFoundError(f"no image matches '{pat}' in the selected samples")
        keys.extend(k for k in found if k not in keys)
    return keys


_CON: Any = None


def _connect() -> Any:
    """One in-memory DuckDB connection per process (connecting costs ~0.1 s)."""
    global _CON
    if _CON is None:
        import duckdb

        _CON = duckdb.connect(":memory:")
        _CON.execute("SET threads TO 2")
    return _CON


def query_counts(profile_set: ProfileSet, by_process: bool = False, images: list[str] | None = None) -> pa.Table:
    """Summed counts per (image, event, offset[, process]) over the selection.

    The unfiltered result is computed once per ProfileSet; asking for some
    images then filters it instead of querying again.
    """
    if images is not None and not by_process:
        full = query_counts(profile_set)
        if full.num_rows == 0:
            return full
        import numpy as np

        col = np.asarray(full.column("image").to_numpy(zero_copy_only=False), dtype=object)
        return full.filter(pa.array(np.isin(col, np.array(images, dtype=object))))
    memo_key = (by_process, None)
    if memo_key in profile_set.memo:
        return profile_set.memo[memo_key]
    result = _query_counts(profile_set, by_process, images)
    profile_set.memo[memo_key] = result
    return result


def counts_sql(files: list[str], processes: list[str] | None, images: list[str] | None,
               events: list[str] | None, by_process: bool, ordered: bool = True) -> tuple[str, list[object]]:
    """The query behind query_counts over ``files`` and its parameters: per (image, event,
    offset[, process]) the raw count (UBIGINT), the summed weights (DOUBLE) and the samples of
    rows without weights (DOUBLE). The embedded engine runs it over the whole selection, a
    distributed one over each group of files (fleet/engine.py)."""
    where = []
    params: list[object] = [files]
    for col, allowed in (("process", processes), ("image", images), ("event", events)):
        if allowed is not None:
            where.append(f"{col} IN (SELECT unnest(?))")
            params.append(list(allowed))
    cols = 'image, event, "offset"' + (", process" if by_process else "")
    # Each sample counts for the period it stood for: periods are drawn at random and re-drawn every
    # 200 ms, so a phase of the program sampled while the period was long would otherwise count for
    # less than its time. Counts come back in samples of the selection's mean period, so totals do
    # not change; rows of segments from before weights count as plain samples.
    sql = (
        f'SELECT {cols}, sum("count")::UBIGINT AS raw, sum(weight)::DOUBLE AS w, '
        'sum(CASE WHEN weight IS NULL THEN "count" ELSE 0 END)::DOUBLE AS unweighted '
        "FROM read_parquet(?, hive_partitioning=false, union_by_name=true) "
        + ("WHERE " + " AND ".join(where) + " " if where else "")
        + f"GROUP BY {cols}" + (' ORDER BY image, event, "offset"' if ordered else "")
    )
    return sql, params


def _query_counts(profile_set: ProfileSet, by_process: bool, images: list[str] | None) -> pa.Table:
    if not profile_set.segments:
        return _empty_counts(by_process)
    sel = profile_set.selection
    keys = images if images is not None else (match_images(profile_set, sel.images) if sel.images else None)
    processes, events = list(sel.processes) or None, list(sel.events) or None
    files = profile_set.files
    last: Exception | None = None
    for attempt in range(4):
        try:
            if profile_set.engine is not None:
                t = profile_set.engine.counts(files, processes, keys, events, by_process)
            else:
                sql, params = counts_sql(files, processes, keys, events, by_process)
                t = _connect().sql(sql, params=params).to_arrow_table()
            return _weigh(profile_set, t)
        except Exception as e:  # duckdb raises its own IOException when compaction removed a file
            last = e
            text = str(e)
            if attempt < 3 and ("IO Error" in text or "No files found" in text or "No such file" in text):
                # A compaction replaced files since the selection was listed: list it again.
                time.sleep(0.05 * (attempt + 1))
                files = open_profile(profile_set.db, profile_set.selection, profile_set.engine).files
                if not files:
                    return _empty_counts(by_process)
                continue
            break
    raise DataError(f"query failed: {str(last).splitlines()[0] if last else 'unknown error'}") from None


def _weigh(profile_set: ProfileSet, t: pa.Table) -> pa.Table:
    """Weighted counts: (sum of periods + plain samples * mean period) / mean period, per event."""
    import numpy as np

    events = t.column("event").to_pylist()
    mean = {e: (m.mean_period or 1.0) for e, m in profile_set.events.items()}
    p = np.array([mean.get(e, 1.0) for e in events], np.float64)
    w = np.nan_to_num(t.column("w").to_numpy(zero_copy_only=False).astype(np.float64))
    un = t.column("unweighted").to_numpy(zero_copy_only=False).astype(np.float64)
    count = np.rint((w + un * p) / p).astype(np.uint64)
    t = t.drop_columns(["w", "unweighted"])
    return t.append_column("count", pa.array(count, pa.uint64()))


def _empty_counts(by_process: bool) -> pa.Table:
    fields = [("image", pa.string()), ("event", pa.string()), ("offset", pa.uint64())]
    if by_process:
        fields.append(("process", pa.string()))
    fields += [("raw", pa.uint64()), ("count", pa.uint64())]
    return pa.schema(fields).empty_table()
