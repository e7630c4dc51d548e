"""`cyclescope list`: a procedure's instructions with samples and source, and per-line source views.

The builders are pure: they take instructions, counts per offset, source
positions and inlined-call stacks, and return rows. Finding binaries,
decoding DWARF and reading source files happen in the callers.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from cyclescope.images.disasm import Insn
from cyclescope.images.dwarf import Scope, SourcePos
from cyclescope.images.registry import ImageInfo
from cyclescope.report.render import Col, Table, fmt_count, fmt_pct
from cyclescope.report.summary import Summary


@dataclass(frozen=True)
class Target:
    info: ImageInfo
    name: str  # procedure name, or the range as written
    start: int
    end: int


@dataclass
class Row:
    kind: str  # "insn", "source", "inline", "gap"
    address: int | None = None
    text: str = ""
    raw: bytes = b""
    counts: tuple[int, ...] = ()
    pos: SourcePos | None = None
    inline: tuple[str, ...] = ()
    note: str = ""


@dataclass
class Listing:
    target: Target
    binary: str | None
    events: list[str]
    proc_totals: list[int]
    selection_totals: list[int]
    rows: list[Row]
    problems: list[str] = field(default_factory=list)
    summary: Summary | None = None
    value_columns: list[str] = field(default_factory=list)
    values: dict[int, list[str]] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        insns = []
        for r in self.rows:
            if r.kind != "insn":
                continue
            d: dict[str, Any] = {
                "address": r.address, "bytes": r.raw.hex(), "instruction": r.text,
                "samples": dict(zip(self.events, r.counts, strict=True)),
                "file": r.pos.file if r.pos else None, "line": r.pos.line if r.pos else None,
                "inlined": list(r.inline),
            }
            if self.value_columns and r.address is not None:
                d["values"] = dict(zip(self.value_columns, self.values.get(r.address, []), strict=False))
            insns.append(d)
        return {
            "procedure": self.target.name, "image": self.target.info.path, "image_key": self.target.info.key,
            "build_id": self.target.info.build_id, "start": self.target.start, "end": self.target.end,
            "binary": self.binary, "events": self.events,
            "samples": dict(zip(self.events, self.proc_totals, strict=True)),
            "selection_samples": dict(zip(self.events, self.selection_totals, strict=True)),
            "instructions": insns, "problems": self.problems,
            "summary": self.summary.to_json() if self.summary else None,
        }


def counts_at(events: list[str], offsets: np.ndarray, ev: np.ndarray, cnt: np.ndarray) -> dict[int, np.ndarray]:
    """offset -> counts per event."""
    idx = {e: i for i, e in enumerate(events)}
    out: dict[int, np.ndarray] = {}
    for o, e, c in zip(offsets.tolist(), ev.tolist(), cnt.tolist(), strict=True):
        i = idx.get(e)
        if i is None:
            continue
        a = out.get(o)
        if a is None:
            a = out[o] = np.zeros(len(events), np.int64)
        a[i] += c
    return out


def build_listing(
    target: Target,
    events: list[str],
    insns: Sequence[Insn],
    counts: dict[int, np.ndarray],
    positions: Sequence[SourcePos | None],
    stacks: Sequence[Sequence[Scope]],
    source_line: Callable[[str, int], str | None],
    name_of: Callable[[int], str | None],
    selection_totals: list[int],
) -> Listing:
    nev = len(events)
    rows: list[Row] = []
    totals = np.zeros(nev, np.int64)
    starts = np.array([i.address for i in insns], np.uint64)
    # Samples at offsets that are not instruction starts go to the instruction containing them.
    per_insn = np.zeros((len(insns), nev), np.int64)
    stray = 0
    for off, c in counts.items():
        if not target.start <= off < target.end:
            continue
        totals += c
        if not len(insns):
            continue
        k = int(np.searchsorted(starts, np.uint64(off), side="right")) - 1
        if k < 0:
            stray += int(c.sum())
            continue
        if insns[k].address != off:
            stray += int(c.sum())
        per_insn[k] += c
    last_pos: tuple[str, int] | None = None
    last_inline: tuple[str, ...] = ()
    for k, ins in enumerate(insns):
        pos = positions[k] if k < len(positions) else None
        stack = stacks[k] if k < len(stacks) else ()
        inline = tuple(f"{s.name} (from {os.path.basename(s.file)}:{s.line})" for s in stack if s.inlined)
        if inline != last_inline:
            if inline:
                rows.append(Row("inline", text="inlined: " + " > ".join(inline)))
            elif last_inline:
                rows.append(Row("inline", text="back in " + target.name))
            last_inline = inline
        if pos is not None and (pos.file, pos.line) != last_pos:
            text = source_line(pos.file, pos.line)
            rows.append(Row("source", pos=pos, text=text if text is not None else ""))
            last_pos = (pos.file, pos.line)
        txt = ins.text
        tgt = ins.direct_target
        if tgt is not None:
            if target.start <= tgt < target.end:
                txt += f" <{target.name}+{tgt - target.start:#x}>"
            else:
                nm = name_of(tgt)
                if nm:
                    txt += f" <{nm}>"
        rows.append(Row("insn", ins.address, txt, ins.raw, tuple(int(x) for x in per_insn[k]), pos, inline))
    if not insns:
        for off in sorted(o for o in counts if target.start <= o < target.end):
            rows.append(Row("insn", off, "(no code available)", b"", tuple(int(x) for x in counts[off])))
    problems = []
    if stray:
        problems.append(f"{stray} samples fell inside instructions rather than at their start: the binary may not "
                        "match the profile")
    return Listing(target, None, events, [int(x) for x in totals], selection_totals, rows, problems)


def listing_table(lst: Listing, show_bytes: bool = False) -> Table:
    cols: list[Col] = []
    for i, e in enumerate(lst.events):
        cols.append(Col(e, style="bold" if i == 0 else None))
        cols.append(Col("%"))
    cols.append(Col("address", align="right", style="dim"))
    if show_bytes:
        cols.append(Col("bytes", align="left", style="dim"))
    for v in lst.value_columns:
        cols.append(Col(v, align="left", style="magenta"))
    cols.append(Col("instruction", align="left", wrap=True))
    nev = len(lst.events)
    rows: list[list[str]] = []
    styles: list[str | None] = []
    blank_counts = [""] * (2 * nev)
    extra_blank = [""] * (1 + (1 if show_bytes else 0) + len(lst.value_columns))
    for r in lst.rows:
        if r.kind == "source":
            where = f"{os.path.basename(r.pos.file)}:{r.pos.line}" if r.pos else "?"
            rows.append(blank_counts + extra_blank + [f"{where}  {r.text.strip()}".rstrip()])
            styles.append("green")
        elif r.kind == "inline":
            rows.append(blank_counts + extra_blank + [f"[{r.text}]"])
            styles.append("yellow")
        else:
            cells = []
            for c, tot in zip(r.counts, lst.proc_totals, strict=True):
                cells.append(fmt_count(c) if c else "")
                cells.append(fmt_pct(100.0 * c / tot, 1) if c and tot else "")
            cells.append(f"{r.address:x}" if r.address is not None else "")
            if show_bytes:
                cells.append(r.raw.hex(" "))
            vals = lst.values.get(r.address or -1, [])
            for i in range(len(lst.value_columns)):
                cells.append(vals[i] if i < len(vals) else "")
            cells.append(r.text)
            rows.append(cells)
            hot = lst.proc_totals and lst.proc_totals[0] and r.counts and r.counts[0] >= 0.05 * lst.proc_totals[0]
            styles.append("bold red" if hot else None)
    t = lst.target
    bid = f", build-id {t.info.build_id[:12]}" if t.info.build_id else ""
    pre = [f"cyclescope list: {t.name} in {t.info.path}{bid} · {t.start:#x}-{t.end:#x} ({t.end - t.start} bytes)"]
    if lst.summary:
        pre += lst.summary.lines("list")[1:]
    share = ", ".join(
        f"{e} {fmt_count(p)}" + (f" ({fmt_pct(100.0 * p / s)} of the selection)" if s else "")
        for e, p, s in zip(lst.events, lst.proc_totals, lst.selection_totals, strict=True)
    )
    pre.append(f"In this procedure: {share}")
    footer = [f"note: {p}" for p in lst.problems]
    return Table(cols, rows, preamble=pre, footer=footer, row_styles=styles)


# --- source files -----------------------------------------------------------------------------


class SourceFiles:
    """Reads source lines, looking under --source-dir roots when the recorded path is gone."""

    def __init__(self, roots: Sequence[str] = (), near: Sequence[str] = ()) -> None:
        self.roots = [Path(r) for r in roots]
        self.near = [Path(n) for n in near]
        self._files: dict[str, list[str] | None] = {}
        self.missing: set[str] = set()

    def resolve(self, path: str) -> Path | None:
        p = Path(path)
        cands = [p] if p.is_absolute() else [d / p for d in self.near] + [Path.cwd() / p]
        parts = p.parts[1:] if p.is_absolute() else p.parts
        for root in self.roots:
            for i in range(len(parts)):
                cands.append(root.joinpath(*parts[i:]))
        for c in cands:
            if c.is_file():
                return c
        return None

    def lines(self, path: str) -> list[str] | None:
        if path in self._files:
            return self._files[path]
        found = self.resolve(path)
        text: list[str] | None = None
        if found is not None:
            try:
                text = found.read_text(errors="replace").splitlines()
            except OSError:
                text = None
        if text is None:
            self.missing.add(path)
        self._files[path] = text
        return text

    def line(self, path: str, n: int) -> str | None:
        lines = self.lines(path)
        if lines is None or not 1 <= n <= len(lines):
            return None
        return lines[n - 1]


@dataclass
class SourceListing:
    file: str
    events: list[str]
    per_line: dict[int, np.ndarray]
    total: list[int]
    text: list[str] | None
    hottest: list[int]
    images: list[str]
    summary: Summary | None = None
    others: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {
            "file": self.file, "events": self.events, "samples": dict(zip(self.events, self.total, strict=True)),
            "images": self.images, "hottest_lines": self.hottest,
            "lines": [{"line": ln, "samples": dict(zip(self.events, (int(x) for x in c), strict=True)),
                       "text": self.text[ln - 1] if self.text and 0 < ln <= len(self.text) else None}
                      for ln, c in sorted(self.per_line.items())],
            "summary": self.summary.to_json() if self.summary else None,
        }


def build_source_listing(file: str, events: list[str], hits: dict[int, np.ndarray], text: list[str] | None,
                         images: list[str], mark: int = 5) -> SourceListing:
    """Per-line totals of one source file; the ``mark`` hottest lines (by the first event) are flagged."""
    total = np.zeros(len(events), np.int64)
    for c in hits.values():
        total += c
    ranked = sorted(hits, key=lambda ln: -int(hits[ln][0]))
    hottest = [ln for ln in ranked[:mark] if total[0] and hits[ln][0] >= 0.01 * total[0]]
    return SourceListing(file, events, hits, [int(x) for x in total], text, hottest, images)


def source_table(sl: SourceListing, context_only: bool = False) -> Table:
    cols = []
    for i, e in enumerate(sl.events):
        cols.append(Col(e, style="bold" if i == 0 else None))
        cols.append(Col("%"))
    cols += [Col("line", style="dim"), Col("", align="left"), Col("source", align="left", wrap=True)]
    rows: list[list[str]] = []
    styles: list[str | None] = []
    n = len(sl.text) if sl.text else (max(sl.per_line) if sl.per_line else 0)
    hot = set(sl.hottest)
    for ln in range(1, n + 1):
        c = sl.per_line.get(ln)
        if context_only and c is None:
            continue
        cells = []
        for i in range(len(sl.events)):
            v = int(c[i]) if c is not None else 0
            cells.append(fmt_count(v) if v else "")
            cells.append(fmt_pct(100.0 * v / sl.total[i], 1) if v and sl.total[i] else "")
        rank = sl.hottest.index(ln) + 1 if ln in hot else 0
        cells.append(str(ln))
        cells.append(f">>{rank}" if rank else "")
        cells.append(sl.text[ln - 1] if sl.text and ln <= len(sl.text) else "")
        rows.append(cells)
        styles.append("bold red" if ln in hot else None)
    pre = [f"cyclescope list --source: {sl.file}"]
    if sl.summary:
        pre += sl.summary.lines("list")[1:]
    pre.append("In this file: " + ", ".join(f"{e} {fmt_count(t)}" for e, t in zip(sl.events, sl.total, strict=True))
               + (f" · from {', '.join(sl.images)}" if sl.images else ""))
    footer = []
    if sl.hottest:
        footer.append("hottest lines: " + ", ".join(f">>{i + 1} line {ln}" for i, ln in enumerate(sl.hottest)))
    if sl.text is None:
        footer.append(f"note: {sl.file}: source not found; showing line numbers only (--source-dir DIR to look there)")
    for o in sl.others:
        footer.append(f"note: also matched {o} (give a longer path to choose it)")
    return Table(cols, rows, preamble=pre, footer=footer, row_styles=styles)
