"""`cyclescope prof`: samples per procedure (or per image), DCPI's dcpiprof.

The builder is pure: it takes per-(image, event, offset) counts, image
descriptions and a symbol-table lookup, and returns rows.
"""

from __future__ import annotations

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
