"""`cyclescope prof`: samples per procedure (or per image), DCPI's dcpiprof.

The builder is pure: it takes per-(image, event, offset) counts, image
descriptions and a symbol-table lookup, and returns rows.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from cyclescope.images.elf import SymbolTable
from cyclescope.images.registry import UNKNOWN_KEY, ImageInfo
from cyclescope.report.render import Col, Table, fmt_count, fmt_pct
from cyclescope.report.summary import Summary

NO_SYMBOL = "[no symbol]"
PYTHON_PREFIX = "py::"  # Python functions' names, as CPython's perf maps and collect/pyframes.py give them


@dataclass(frozen=True)
class ProfRow:
    procedure: str
    image: str  # path as recorded
    image_key: str
    counts: tuple[int, ...]  # per event, in ProfReport.events order
    start: int | None = None  # the procedure's first address in the image, when known


@dataclass
class ProfReport:
    events: list[str]
    totals: list[int]
    rows: list[ProfRow]
    by_image: bool
    summary: Summary | None = None
    problems: dict[str, str] | None = None

    def to_json(self) -> dict[str, Any]:
        rows = []
        for r in self.rows:
            rows.append({
                "procedure": None if self.by_image else r.procedure,
                "image": r.image,
                "image_key": r.image_key,
                "address": r.start,
                "samples": dict(zip(self.events, r.counts, strict=True)),
                "percent": {e: (100.0 * c / t if t else 0.0)
                            for e, c, t in zip(self.events, r.counts, self.totals, strict=True)},
            })
        return {
            "report": "images" if self.by_image else "procedures",
            "summary": self.summary.to_json() if self.summary else None,
            "events": self.events,
            "totals": dict(zip(self.events, self.totals, strict=True)),
            "rows": rows,
            "problems": self.problems or {},
        }


def counts_by_image(table: pa.Table) -> dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """image key -> (offsets, event names as array, counts), from a query result."""
    if table.num_rows == 0:
        return {}
    img = np.array(table.column("image").to_pylist(), dtype=object)
    ev = np.array(table.column("event").to_pylist(), dtype=object)
    off = table.column("offset").to_numpy().astype(np.uint64)
    cnt = table.column("count").to_numpy().astype(np.int64)
    order = np.argsort(img, kind="stable")
    img, ev, off, cnt = img[order], ev[order], off[order], cnt[order]
    bounds = np.flatnonzero(img[1:] != img[:-1]) + 1
    out = {}
    for s, e in zip(np.concatenate(([0], bounds)), np.concatenate((bounds, [len(img)])), strict=True):
        out[str(img[s])] = (off[s:e], ev[s:e], cnt[s:e])
    return out


def build_prof(
    events: list[str],
    per_image: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]],
    images: dict[str, ImageInfo],
    symbols: Callable[[ImageInfo], SymbolTable],
    to_vaddr: Callable[[ImageInfo, np.ndarray], np.ndarray] | None = None,
    by_image: bool = False,
) -> ProfReport:
    ev_index = {e: i for i, e in enumerate(events)}
    nev = len(events)
    rows: list[ProfRow] = []
    totals = np.zeros(nev, dtype=np.int64)
    for key, (off, ev, cnt) in per_image.items():
        info = images.get(key) or ImageInfo(key, key, "unknown" if key == UNKNOWN_KEY else "elf")
        eidx = np.array([ev_index.get(e, -1) for e in ev.tolist()], dtype=np.int64)
        keep = eidx >= 0
        off, eidx, cnt = off[keep], eidx[keep], cnt[keep]
        if not len(cnt):
            continue
        np.add.at(totals, eidx, cnt)
        if by_image or info.kind == "unknown":
            c = np.bincount(eidx, weights=cnt, minlength=nev).astype(np.int64)
            name = info.path if by_image else UNKNOWN_KEY
            rows.append(ProfRow(name, info.path, key, tuple(int(x) for x in c)))
            continue
        table = symbols(info)
        addrs = to_vaddr(info, off) if to_vaddr else off
        sym = table.lookup(addrs)
        nsym = len(table)
        # Group by (symbol, event); -1 (no symbol) goes to slot nsym.
        slot = np.where(sym >= 0, sym, nsym)
        grid = np.zeros((nsym + 1, nev), dtype=np.int64)
        np.add.at(grid, (slot, eidx), cnt)
        hit = np.flatnonzero(grid.sum(axis=1))
        for s in hit.tolist():
            if s == nsym:
                rows.append(ProfRow(NO_SYMBOL, info.path, key, tuple(int(x) for x in grid[s])))
            else:
                rows.append(ProfRow(table.names[s], info.path, key, tuple(int(x) for x in grid[s]),
                                    int(table.starts[s])))
    rows.sort(key=lambda r: (tuple(-c for c in r.counts), r.procedure, r.image))
    return ProfReport(events, [int(t) for t in totals], rows, by_image)


def prof_table(report: ProfReport, limit: int | None = None) -> Table:
    cols: list[Col] = []
    for i, e in enumerate(report.events):
        cols.append(Col(e, style="bold" if i == 0 else None))
        cols.append(Col("%"))
        if i == 0:
            cols.append(Col("cum%", style="dim"))
    if not report.by_image:
        cols.append(Col("procedure", align="left", style="cyan", wrap=True))
    cols.append(Col("image", align="left", wrap=True))
    rows: list[list[str]] = []
    cum = 0
    shown = report.rows if limit is None else report.rows[:limit]
    for r in shown:
        cells: list[str] = []
        for i, (c, t) in enumerate(zip(r.counts, report.totals, strict=True)):
            cells.append(fmt_count(c))
            cells.append(fmt_pct(100.0 * c / t) if t else "-")
            if i == 0:
                cum += c
                cells.append(fmt_pct(100.0 * cum / t) if t else "-")
        if not report.by_image:
            cells.append(r.procedure)
        cells.append(r.image)
        rows.append(cells)
    footer = []
    hidden = report.rows[len(shown):]
    if hidden:
        share = sum(r.counts[0] for r in hidden)
        t0 = report.totals[0] if report.totals else 0
        what = "images" if report.by_image else "procedures"
        footer.append(
            f"... {len(hidden)} more {what} with {fmt_pct(100.0 * share / t0) if t0 else '0%'} of {report.events[0]}"
            " samples (--limit 0 shows all)"
        )
    for _key, problem in sorted((report.problems or {}).items()):
        footer.append(f"note: {problem}")
    pre = report.summary.lines("prof --images" if report.by_image else "prof") if report.summary else []
    return Table(cols, rows, preamble=pre, footer=footer)


@dataclass
class StackProfRow:
    function: str
    image: str
    total: tuple[int, ...]  # per event: samples with the function anywhere in their stack
    self_: tuple[int, ...]  # per event: samples with the function as their leaf


@dataclass
class StackProfReport:
    events: list[str]
    totals: list[int]
    rows: list[StackProfRow]
    flat: bool = False  # no stacks were recorded: one-frame stacks of the flat profile
    summary: Summary | None = None
    problems: dict[str, str] | None = None

    def to_json(self) -> dict[str, Any]:
        def per(v: tuple[int, ...]) -> dict[str, int]:
            return dict(zip(self.events, v, strict=True))

        def pct(v: tuple[int, ...]) -> dict[str, float]:
            return {e: (100.0 * c / t if t else 0.0) for e, c, t in zip(self.events, v, self.totals, strict=True)}

        return {
            "report": "functions from call stacks",
            "summary": self.summary.to_json() if self.summary else None,
            "events": self.events,
            "totals": per(tuple(self.totals)),
            "stacks_recorded": not self.flat,
            "rows": [{"function": r.function, "image": r.image, "total": per(r.total), "self": per(r.self_),
                      "percent_total": pct(r.total), "percent_self": pct(r.self_)} for r in self.rows],
            "problems": self.problems or {},
        }


def build_stack_prof(events: list[str], stacks: Counter[tuple[str, tuple[tuple[str, int], ...]]],
                     name: Callable[[tuple[str, int]], str], image: Callable[[str], str],
                     by_self: bool = False) -> StackProfReport:
    """Per function (as ``name`` names a frame): the samples whose stack holds it (each stack once,
    however often it recurs) and those whose leaf it is, per event; hottest first by the first
    event's total (``by_self``: its self), then by the other, then by name. A Python
    function (``py::``) is also its samples' own where it is their innermost Python frame: the
    interpreter's C code below it runs it (so the self column may sum to more than the samples)."""
    ix = {e: i for i, e in enumerate(events)}
    n = len(events)
    total: dict[str, list[int]] = {}
    own: dict[str, list[int]] = {}
    where: dict[str, str] = {}
    sums = [0] * n
    for (ev, frames), c in stacks.items():
        i = ix.get(ev)
        if i is None or not frames:
            continue
        sums[i] += c
        seen: set[str] = set()
        python_leaf = False
        for k, f in enumerate(frames):
            fn = name(f)
            py = fn.startswith(PYTHON_PREFIX)
            if k == 0 or (py and not python_leaf):
                own.setdefault(fn, [0] * n)[i] += c
                python_leaf = python_leaf or py
            if fn in seen:
                continue
            seen.add(fn)
            total.setdefault(fn, [0] * n)[i] += c
            if fn not in where:
                where[fn] = image(f[0])
    rows = [StackProfRow(fn, where[fn], tuple(t), tuple(own.get(fn, [0] * n))) for fn, t in total.items()]
    if n:
        rows.sort(key=lambda r: (-r.self_[0], -r.total[0], r.function) if by_self
                  else (-r.total[0], -r.self_[0], r.function))
    return StackProfReport(events, sums, rows)


def stack_prof_table(report: StackProfReport, limit: int | None = None) -> Table:
    ev = report.events[0] if report.events else "samples"
    t0 = report.totals[0] if report.totals else 0
    cols = [Col(f"total {ev}", style="bold"), Col("%"), Col(f"self {ev}"), Col("%"),
            Col("function", align="left", style="cyan", wrap=True), Col("image", align="left", wrap=True)]
    shown = report.rows if limit is None else report.rows[:limit]
    rows = [[fmt_count(r.total[0]), fmt_pct(100.0 * r.total[0] / t0) if t0 else "-",
             fmt_count(r.self_[0]), fmt_pct(100.0 * r.self_[0] / t0) if t0 else "-", r.function, r.image]
            for r in shown]
    footer = []
    hidden = report.rows[len(shown):]
    if hidden:
        footer.append(f"... {len(hidden)} more functions (--limit 0 shows all)")
    if len(report.events) > 1:
        footer.append(f"samples of {ev} (of {', '.join(report.events)}; --event picks another, --json has all)")
    if any(r.function.startswith(PYTHON_PREFIX) for r in shown):
        footer.append("self of a Python function (py::): its samples as the innermost Python frame, "
                      "the interpreter's C code it ran included")
    if report.flat:
        footer.append("note: no call stacks recorded in the selection (record with -g dwarf or -g fp): "
                      "each sample is its own function's alone, total = self")
    for _key, problem in sorted((report.problems or {}).items()):
        footer.append(f"note: {problem}")
    pre = report.summary.lines("prof --stacks") if report.summary else []
    return Table(cols, rows, preamble=pre, footer=footer)
