"""A profile over time (app/timeline.py builds it): samples per process or thread in steps of
time, as data, JSON, and a table of CPUs busy (or samples) per step."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from cyclescope.report.render import Col, Table, fmt_count

WINDOW_MS = 100  # the collector's grain
# Steps a report picks from (ms): the smallest that keeps it within ``buckets`` rows.
STEPS_MS = (100, 200, 500, 1_000, 2_000, 5_000, 10_000, 30_000, 60_000, 120_000, 300_000, 600_000, 1_800_000,
            3_600_000, 7_200_000, 21_600_000, 86_400_000)
CLOCK_EVENTS = ("cpu-clock", "task-clock")


@dataclass
class Series:
    name: str  # a process name, or "name pid/tid" by thread
    samples: list[int]  # per step
    period: list[float]  # per step: the samples' periods summed (ns of CPU for the clock events)
    total: int = 0


@dataclass
class Timeline:
    event: str
    by: str  # "process" or "thread"
    step_ms: int
    start_ms: int  # the first step's start, ms since the Unix epoch
    series: list[Series]  # the busiest first; "other" last when some were left out
    total_samples: list[int]
    total_period: list[float]
    notes: list[str] = field(default_factory=list)

    @property
    def clock(self) -> bool:
        """The event measures time: period sums are CPU nanoseconds."""
        return self.event.split(":")[0] in CLOCK_EVENTS

    def cpus(self, period: list[float]) -> list[float]:
        """CPUs busy per step (clock events): CPU time over the step's length."""
        return [p / (self.step_ms * 1e6) for p in period]

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "event": self.event, "by": self.by, "step_ms": self.step_ms, "start_ms": self.start_ms,
            "times_ms": [self.start_ms + i * self.step_ms for i in range(len(self.total_samples))],
            "total": {"samples": self.total_samples, "period": self.total_period},
            "series": [{"name": s.name, "total": s.total, "samples": s.samples, "period": s.period}
                       for s in self.series],
            "notes": self.notes,
        }
        if self.clock:
            out["total"]["cpus"] = self.cpus(self.total_period)
            for js, s in zip(out["series"], self.series, strict=True):
                js["cpus"] = self.cpus(s.period)
        return out


def pick_step(span_ms: int, buckets: int) -> int:
    """The smallest of STEPS_MS that shows ``span_ms`` in at most ``buckets`` steps."""
    for s in STEPS_MS:
        if span_ms / s <= buckets:
            return s
    return STEPS_MS[-1]




def timeline_table(tl: Timeline) -> Table:
    """One row per step: its start (local time), the total, and each series; CPUs busy for the
    clock events (CPU time over the step), samples otherwise."""
    def cell(samples: int, period: float) -> str:
        if tl.clock:
            return f"{period / (tl.step_ms * 1e6):.2f}" if samples else ""
        return fmt_count(samples) if samples else ""

    fmt = "%H:%M:%S" if tl.step_ms >= 1000 else "%H:%M:%S."
    cols = [Col("time", "left"), Col("total")] + [Col(s.name) for s in tl.series]
    rows = []
    for i, (n, per) in enumerate(zip(tl.total_samples, tl.total_period, strict=True)):
        t = (tl.start_ms + i * tl.step_ms) / 1000
        stamp = time.strftime(fmt, time.localtime(t))
        if tl.step_ms < 1000:
            stamp += str(int(t * 10) % 10)
        rows.append([stamp, cell(n, per), *(cell(s.samples[i], s.period[i]) for s in tl.series)])
    unit = "CPUs busy (CPU time of the event over each step)" if tl.clock else "samples"
    day = time.strftime("%Y-%m-%d", time.localtime(tl.start_ms / 1000))
    pre = [f"{tl.event} by {tl.by}, {unit}, every {fmt_step(tl.step_ms)} from {day} (local time)"]
    return Table(cols, rows, preamble=pre, footer=list(tl.notes))


def fmt_step(ms: int) -> str:
    if ms % 3_600_000 == 0:
        return f"{ms // 3_600_000} h"
    if ms % 60_000 == 0:
        return f"{ms // 60_000} min"
    if ms % 1000 == 0:
        return f"{ms // 1000} s"
    return f"{ms} ms"
