"""Segments: one Parquet file per flush (or per compaction) of one epoch and host.

Rows: (image, offset, event, process, count), sorted in that key order with
the offset varying fastest, so image/event/process compress to runs and
offsets to small deltas. The segment's metadata (images, per-event totals and
periods, losses, time range) is JSON under the Parquet key ``cyclescope``.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from cyclescope import parquet
from cyclescope.arrays import group
from cyclescope.db.layout import Database, fsync_file
from cyclescope.errors import DataError
from cyclescope.parquet import from_numpy

META_KEY = b"cyclescope"
SEGMENT_FORMAT = 1

SCHEMA = pa.schema(
    [
        ("image", pa.dictionary(pa.int32(), pa.string())),
        ("offset", pa.uint64()),
        ("event", pa.dictionary(pa.int8(), pa.string())),
        ("process", pa.dictionary(pa.int32(), pa.string())),
        ("count", pa.uint64()),
        # the sum of the samples' periods (event units): reports weigh each sample by the period it
        # stood for. Absent from segments written before it (read as null).
        ("weight", pa.uint64()),
    ]
)


@dataclass
class EventMeta:
    name: str
    type: int = 1
    config: int = 0
    time_based: bool = True
    nominal_period: int = 0
    band: float = 0.0
    samples: int = 0
    period_sum: int = 0
    lost: int = 0
    throttles: int = 0
    value: int = 0
    enabled_ns: int = 0
    running_ns: int = 0
    overhead_ns: float = 0.0  # time-based events: what each sample cost the sampled code

    @property
    def mean_period(self) -> float:
        if self.samples and self.period_sum:
            return self.period_sum / self.samples
        return float(self.nominal_period)

    @property
    def running_fraction(self) -> float | None:
        if self.enabled_ns <= 0:
            return None
        return self.running_ns / self.enabled_ns

    def merge(self, o: EventMeta) -> None:
        if o.overhead_ns or self.overhead_ns:
            self.overhead_ns = merge_clock(self.overhead_ns, self.samples, o.overhead_ns, o.samples)
        for f in ("samples", "period_sum", "lost", "throttles", "value", "enabled_ns", "running_ns"):
            setattr(self, f, getattr(self, f) + getattr(o, f))
        if not self.nominal_period:
            self.nominal_period = o.nominal_period


@dataclass
class SegmentMeta:
    host: str
    epoch: int
    first: int = 0
    last: int = 0
    start_time: float = 0.0
    end_time: float = 0.0
    targets: list[str] = field(default_factory=list)
    events: dict[str, EventMeta] = field(default_factory=dict)
    images: dict[str, dict[str, Any]] = field(default_factory=dict)
    lost_records: int = 0  # PERF_RECORD_LOST records (each stands for many samples)
    lost_samples: int = 0
    unknown: dict[str, int] = field(default_factory=dict)
    processes: dict[str, int] = field(default_factory=dict)  # comm -> samples
    malformed: int = 0
    rows: int = 0
    clock_ghz: float = 0.0  # measured core clock while recording (0: unknown)

    @property
    def total_samples(self) -> int:
        return sum(e.samples for e in self.events.values())

    def to_json(self) -> bytes:
        d = {
            "format": SEGMENT_FORMAT, "host": self.host, "epoch": self.epoch, "first": self.first,
            "last": self.last, "start_time": self.start_time, "end_time": self.end_time,
            "targets": self.targets, "events": {k: vars(v) for k, v in self.events.items()},
            "images": self.images, "lost_records": self.lost_records, "lost_samples": self.lost_samples,
            "unknown": self.unknown, "processes": self.processes, "malformed": self.malformed, "rows": self.rows,
            "clock_ghz": self.clock_ghz,
        }
        return json.dumps(d, separators=(",", ":")).encode()

    @staticmethod
    def from_json(raw: bytes) -> SegmentMeta:
        d = json.loads(raw)
        if int(d.get("format", 0)) > SEGMENT_FORMAT:
            raise DataError(f"segment format {d.get('format')} is newer than this cyclescope understands")
        m = SegmentMeta(str(d["host"]), int(d["epoch"]))
        m.first, m.last = int(d.get("first", 0)), int(d.get("last", 0))
        m.start_time, m.end_time = float(d.get("start_time", 0)), float(d.get("end_time", 0))
        m.targets = list(d.get("targets", []))
        m.events = {k: EventMeta(**v) for k, v in d.get("events", {}).items()}
        m.images = dict(d.get("images", {}))
        m.lost_records = int(d.get("lost_records", 0))
        m.lost_samples = int(d.get("lost_samples", 0))
        m.unknown = {k: int(v) for k, v in d.get("unknown", {}).items()}
        m.processes = {k: int(v) for k, v in d.get("processes", {}).items()}
        m.malformed = int(d.get("malformed", 0))
        m.rows = int(d.get("rows", 0))
        m.clock_ghz = float(d.get("clock_ghz", 0.0))
        return m

    def merge(self, o: SegmentMeta) -> None:
        self.clock_ghz = merge_clock(self.clock_ghz, self.total_samples, o.clock_ghz, o.total_samples)
        self.first = min(self.first, o.first) if self.first else o.first
        self.last = max(self.last, o.last)
        starts = [t for t in (self.start_time, o.start_time) if t]
        self.start_time = min(starts) if starts else 0.0
        self.end_time = max(self.end_time, o.end_time)
        for t in o.targets:
            if t not in self.targets and len(self.targets) < 64:
                self.targets.append(t)
        for k, v in o.events.items():
            if k in self.events:
                self.events[k].merge(v)
            else:
                self.events[k] = EventMeta(**vars(v))
        for k, img in o.images.items():
            self.images.setdefault(k, img)
        self.lost_records += o.lost_records
        self.lost_samples += o.lost_samples
        for k, n in o.unknown.items():
            self.unknown[k] = self.unknown.get(k, 0) + n
        for k, n in o.processes.items():
            self.processes[k] = self.processes.get(k, 0) + n
        self.malformed += o.malformed


def merge_clock(a: float, wa: int, b: float, wb: int) -> float:
    """Sample-weighted mean of two measured clocks, ignoring unknown (0) ones."""
    if not a:
        return b
    if not b:
        return a
    return (a * max(wa, 1) + b * max(wb, 1)) / (max(wa, 1) + max(wb, 1))


def build_table(image_keys: list[str], image: np.ndarray, offset: np.ndarray, event_names: list[str],
                event: np.ndarray, comm_names: list[str], comm: np.ndarray, count: np.ndarray,
                weight: np.ndarray | None = None) -> pa.Table:
    """Rows from index arrays; dictionaries hold only the values used."""

    def dict_array(names: list[str], idx: np.ndarray, itype: pa.DataType) -> pa.DictionaryArray:
        used, inv = group(idx)
        return pa.DictionaryArray.from_arrays(from_numpy(inv, itype), pa.array([names[i] for i in used.tolist()]))

    return pa.Table.from_arrays(
        [
            dict_array(image_keys, image, pa.int32()),
            from_numpy(offset, pa.uint64()),
            dict_array(event_names, event, pa.int8()),
            dict_array(comm_names, comm, pa.int32()),
            from_numpy(count, pa.uint64()),
            from_numpy(weight, pa.uint64()) if weight is not None else pa.nulls(len(count), pa.uint64()),
        ],
        schema=SCHEMA,
    )


@dataclass
class Chunks:
    """A table too large to build whole, built a part at a time as it is written (a daemon's
    flush: its memory peaks at one part, not at the whole)."""

    rows: int
    parts: Iterable[pa.Table]


def write_parquet(table: pa.Table | Chunks, path: Path, meta: SegmentMeta) -> None:
    if isinstance(table, Chunks):
        meta.rows, parts, schema = table.rows, table.parts, SCHEMA
    else:
        meta.rows, parts, schema = table.num_rows, [table], table.schema
    # replace_schema_metadata, not cast: cast imports pyarrow.compute (0.1 s of start-up).
    md = {META_KEY: meta.to_json()}
    schema = schema.with_metadata(md)
    with parquet.Writer(
        path, schema, compression="zstd", compression_level=6, use_dictionary=["image", "event", "process"],
        column_encoding={"offset": "DELTA_BINARY_PACKED", "count": "DELTA_BINARY_PACKED"},
        write_statistics=["image", "event", "process"], data_page_size=1 << 20,
    ) as w:
        for part in parts:
            w.write_table(part.replace_schema_metadata(md), row_group_size=1 << 20)
    fsync_file(path)


def write_segment(db: Database, epoch: int, host: str, table: pa.Table | Chunks, meta: SegmentMeta) -> Path:
    """Write one flush as a new segment, atomically; returns its path."""
    with db.host_lock(epoch, host) as d:
        seq = db.next_seq(epoch, host)
        meta.first = meta.last = seq
        meta.epoch = epoch
        tmp = db.temp_path(d)
        try:
            write_parquet(table, tmp, meta)
            return db.link_new(tmp, d, seq, seq)
        finally:
            if tmp.exists():
                tmp.unlink()


def read_meta(path: Path) -> SegmentMeta:
    try:
        md = parquet.read_metadata(path)
    except (OSError, pa.ArrowException, ValueError) as e:
        raise DataError(f"{path}: corrupt segment ({e})") from None
    kv = md.metadata or {}
    raw = kv.get(META_KEY)
    if raw is None:
        raise DataError(f"{path}: not a cyclescope segment (no metadata)")
    try:
        return SegmentMeta.from_json(raw)
    except (ValueError, KeyError, TypeError) as e:
        raise DataError(f"{path}: corrupt segment metadata ({e})") from None


def read_table(path: Path) -> pa.Table:
    """A segment's rows in the current schema (a segment from before weights gets a null weight)."""
    try:
        t = parquet.read_table(path)
        t.validate(full=True)  # damaged strings (invalid UTF-8) fail here, not later
    except (OSError, pa.ArrowException, ValueError) as e:
        raise DataError(f"{path}: corrupt segment ({e})") from None
    missing = [f.name for f in SCHEMA if f.name not in t.column_names and f.name != "weight"]
    if missing:
        raise DataError(f"{path}: corrupt segment (no {', '.join(missing)} column)")
    if "weight" not in t.column_names:
        t = t.append_column("weight", pa.nulls(t.num_rows, pa.uint64()))
    try:
        return t.select(SCHEMA.names).cast(SCHEMA)
    except (pa.ArrowException, ValueError) as e:
        raise DataError(f"{path}: corrupt segment ({e})") from None
