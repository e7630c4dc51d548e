"""Samples over time, per thread: the collector's processor that keeps a profile's timeline.

Each sample counts in its 100 ms window (of CLOCK_MONOTONIC, the samples' clock) under its
process, thread and event, with the sum of its periods (so clock events give CPU time per
window). The ring path computes the rows from the drain's samples; the eBPF path's program
counts them in the kernel (collect/bpf/profile.bpf.c) and the drain carries them. At a flush
the windows become wall-clock times (ms since the Unix epoch) and go to a TIMELINE tally
(db/tallies.py): a few rows per thread and window, never more than the samples.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import numpy as np

from cyclescope.arrays import group_rows

if TYPE_CHECKING:
    from pathlib import Path

    from cyclescope.collect.processor import Context, Drain
    from cyclescope.db.layout import Database

WINDOW_NS = 100_000_000
# A timeline row, on both paths (the eBPF path's drain builds them from the program's counts,
# collect/ebpf.py): samples of one thread in one window of one event, and their periods' sum.
TIMELINE_DTYPE = np.dtype([("pid", "<i4"), ("tid", "<i4"), ("window_ns", "<u8"), ("event", "<i4"),
                           ("count", "<u8"), ("period", "<f8")])


def rows_of_samples(pid: np.ndarray, tid: np.ndarray, time_ns: np.ndarray, event: np.ndarray,
                    period: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """One row (TIMELINE_DTYPE) per (thread, window, event) of these samples, and the index
    of the first sample of each."""
    n = len(pid)
    if not n:
        return np.zeros(0, TIMELINE_DTYPE), np.zeros(0, np.int64)
    # Two packed keys, (pid, tid) and (window, event), sorted together (each group's first row is
    # its first sample). np.unique over a structured array compared the rows in Python.
    u32 = np.uint64(0xFFFFFFFF)
    window = time_ns.astype(np.uint64) // np.uint64(WINDOW_NS)
    thread = (((pid.astype(np.int64).astype(np.uint64) & u32) << np.uint64(32))
              | (tid.astype(np.int64).astype(np.uint64) & u32))
    when = (window << np.uint64(16)) | (event.astype(np.uint64) & np.uint64(0xFFFF))
    first, inv = group_rows(thread, when)
    out = np.zeros(len(first), TIMELINE_DTYPE)
    out["pid"], out["tid"], out["event"] = pid[first], tid[first], event[first]
    out["window_ns"] = window[first] * np.uint64(WINDOW_NS)
    out["count"] = np.bincount(inv, minlength=len(first)).astype(np.uint64)
    out["period"] = np.bincount(inv, weights=period.astype(np.float64), minlength=len(first))
    return out, first


class TimelineProcessor:
    """Timeline rows from each drain, summed by (process name, window, pid, tid, event) until
    the flush writes them."""

    name = "timeline"
    needs_regs = False

    def __init__(self) -> None:
        self._ctx: Context | None = None
        self._rows: dict[tuple[int, int, int, int, int], list[float]] = {}
        # CLOCK_MONOTONIC to the wall clock: the offset at start (a clock step since moves the
        # windows by as much, as it would any other wall-clock stamp).
        self._to_wall_ns = time.time_ns() - time.clock_gettime_ns(time.CLOCK_MONOTONIC)
        self.samples = 0

    def bind(self, ctx: Context) -> None:
        self._ctx = ctx

    def process(self, d: Drain) -> None:
        if self._ctx is None or not len(d):
            return
        if d.timeline is not None:
            rows = d.timeline
            procs = self._ctx.mapper.procs
            # The command of each process now (the eBPF program counts by process, not name).
            comm = np.array([st.comm if (st := procs.get(p)) is not None else 0 for p in rows["pid"].tolist()],
                            np.int64)
        else:
            s = d.samples
            rows, first = rows_of_samples(s["pid"], s["tid"], s["time"], d.event, d.period)
            comm = d.comm[first]  # the command of the row's first sample
        acc = self._rows
        for c, w, p, t, e, n, per in zip(comm.tolist(), rows["window_ns"].tolist(), rows["pid"].tolist(),
                                         rows["tid"].tolist(), rows["event"].tolist(), rows["count"].tolist(),
                                         rows["period"].tolist(), strict=True):
            k = (c, w, p, t, e)
            got = acc.get(k)
            if got is None:
                acc[k] = [n, per]
            else:
                got[0] += n
                got[1] += per
            self.samples += n

    def forget(self, pid: int, tid: int) -> None:
        pass

    def finish(self) -> None:
        pass

    def flush(self, db: Database, epoch: int, host: str) -> list[Path]:
        from cyclescope.db.tallies import TIMELINE, build, write_tally

        if self._ctx is None or not self._rows:
            return []
        rows, self._rows = self._rows, {}
        names = self._ctx.mapper.comms.names
        events = self._ctx.events
        keys = list(rows)
        vals = list(rows.values())
        table = build(TIMELINE, {
            "process": [names[c] if 0 <= c < len(names) else "[unknown]" for c, _, _, _, _ in keys],
            "window_ms": [(w + self._to_wall_ns) // 1_000_000 for _, w, _, _, _ in keys],
            "pid": [p for _, _, p, _, _ in keys], "tid": [t for _, _, _, t, _ in keys],
            "event": [events[e] if 0 <= e < len(events) else str(e) for _, _, _, _, e in keys],
            "samples": [int(v[0]) for v in vals], "period": [float(v[1]) for v in vals],
        })
        return [write_tally(db, epoch, host, TIMELINE, table)]

    def close(self) -> None:
        pass

    def status(self) -> dict[str, Any]:
        return {"pending_rows": len(self._rows), "samples": self.samples}

    def summary(self) -> str | None:
        return None
