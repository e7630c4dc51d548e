"""Value reports: hotlists per instruction (the paper's Figure 1), value columns for `list`,
and the table of semi-invariant candidates (`invariants`; found by app/invariants.py)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from cyclescope.binaries.symbolize import Symbolizer
from cyclescope.db.hotlist import PER_CALL_SITE
from cyclescope.db.query import ProfileSet
from cyclescope.db.values import NamedHotlists, ValueSelection, ValuesMeta
from cyclescope.images.registry import ImageInfo
from cyclescope.report.render import Col, Table, fmt_count, fmt_pct
from cyclescope.report.summary import Summary
from cyclescope.values.api import FormatContext, Value, ValueModule
from cyclescope.values.insn import InsnDetail, decode
from cyclescope.values.modules import format_value

NOT_INVARIANT_KINDS = ("ctx", "edge", "alias")  # what a program is, not values an optimizer folds


@dataclass
class HotValue:
    text: str
    share: float  # estimated share of the values seen
    count: float  # estimated count
    value: Value
    se: float = 0.0  # standard error of share: the hotlist's thinning and the sampling of values


@dataclass
class HotRow:
    image: str  # image key
    offset: int
    kind: str
    vtot: int
    p: float
    nv: int
    values: list[HotValue]
    where: str = ""  # procedure+offset
    insn: str = ""

    def to_json(self) -> dict[str, Any]:
        return {"image": self.image, "offset": self.offset, "where": self.where, "instruction": self.insn,
                "kind": self.kind, "vtot": self.vtot, "thld": self.p, "nv": self.nv,
                "hotlist": [{"value": v.text, "share": round(v.share, 6), "se": round(v.se, 6),
                             "count": round(v.count, 2), "raw": [v.value.v0, v.value.v1]} for v in self.values]}


class Namer:
    """'procedure+0x12' for (image key, offset), and instruction text from the binaries."""

    def __init__(self, profile_set: ProfileSet, sym: Symbolizer, images: list[str]) -> None:
        self.profile_set = profile_set
        self.sym = sym
        self.images = images
        self._code: dict[str, tuple[str, Any] | None] = {}

    def info(self, key: str) -> ImageInfo | None:
        return self.profile_set.images.get(key)

    def where(self, key: str, off: int) -> str:
        info = self.info(key)
        if info is None:
            return f"{off:#x}"
        t = self.sym.table(info)
        i = int(t.lookup(np.array([off], np.uint64))[0]) if len(t) else -1
        if i < 0:
            return f"{os.path.basename(info.path)}+{off:#x}"
        s = int(t.starts[i])
        return t.names[i] + (f"+{off - s:#x}" if off != s else "")

    def by_index(self, img: int, off: int) -> str:
        if 0 <= img < len(self.images):
            return self.where(self.images[img], off)
        return f"{off:#x}"

    def insn(self, key: str, off: int) -> InsnDetail | None:
        from cyclescope.images.disasm import read_code
        from cyclescope.images.elf import read_load_info

        if key not in self._code:
            info = self.info(key)
            entry = None
            if info is not None and info.kind == "elf":
                path = self.sym.binary(info).path
                if path:
                    try:
                        entry = (path, read_load_info(path))
                    except Exception:  # a damaged binary: no instruction text, values still shown
                        entry = None
            self._code[key] = entry
        entry = self._code[key]
        if entry is None:
            return None
        try:
            raw = read_code(entry[0], off, off + 16, entry[1])
        except Exception:
            return None
        return decode(raw, off) if raw else None

    def fmt(self) -> FormatContext:
        return FormatContext(self.by_index)


def hot_rows(named: NamedHotlists, modules: list[ValueModule], namer: Namer, top: int,
             keep: np.ndarray | None = None) -> list[HotRow]:
    """A row per hotlist (those ``keep`` selects), values most frequent first."""
    lists = named.lists
    if not len(lists):
        return []
    fctx = namer.fmt()
    idx = np.flatnonzero(keep) if keep is not None else np.arange(len(lists))
    order = np.argsort(lists.hot, kind="stable")
    starts = np.searchsorted(lists.hot[order], idx, side="left")
    ends = np.searchsorted(lists.hot[order], idx, side="right")
    out = []
    for i, a, b in zip(idx.tolist(), starts.tolist(), ends.tolist(), strict=True):
        rows = order[a:b]
        k = lists.keys[i]
        kind = named.kinds[int(k["kind"])]
        p = float(lists.p[i])
        total = int(lists.total[i])
        cnt = lists.counts[rows]
        rank = rows[np.argsort(-cnt, kind="stable")]
        vals = []
        for r in rank[:top].tolist():
            v = lists.values[r]
            val = Value(int(v["v0"]), int(v["v1"]), int(v["vimg"]))
            c = float(lists.counts[r])
            est = c / p
            share = est / total if total else 0.0
            # A thinned hotlist's estimate can exceed the values seen (share > 1): its binomial term is 0,
            # not the square root of a negative number.
            se = ((c * (1 - p)) ** 0.5 / p / total + (max(0.0, share * (1 - share)) / total) ** 0.5) if total else 0.0
            vals.append(HotValue(format_value(modules, kind, val, fctx), share, est, val, se))
        key = named.images[int(k["image"])]
        out.append(HotRow(key, int(k["offset"]), kind, total, p, len(rows), vals))
    return out


def kind_matches(kind: str, patterns: list[str] | None, call_sites: bool) -> bool:
    if patterns:
        return any(kind == p or (p.endswith(":") and kind.startswith(p)) or kind.split(":")[0] == p
                   for p in patterns)
    return call_sites or not kind.endswith(PER_CALL_SITE)


@dataclass
class ValuesReport:
    rows: list[HotRow]
    meta: ValuesMeta | None
    summary: Summary | None
    title: str
    notes: list[str] = field(default_factory=list)
    top: int = 4

    def to_json(self) -> dict[str, Any]:
        from cyclescope.db.values import describe

        return {"title": self.title, "capture": describe(self.meta), "rows": [r.to_json() for r in self.rows],
                "notes": self.notes, "summary": self.summary.to_json() if self.summary else None}


def capture_line(meta: ValuesMeta | None) -> str:
    if meta is None:
        return "no value samples"
    from cyclescope.values.interp import describe_stops

    s = f"value samples {fmt_count(meta.samples)}"
    if meta.exact:
        s += f" (exact mode: {fmt_count(meta.interpreted)} stops, {meta.length} steps each"
        if meta.check.get("compared"):
            s += (f"; the interpreter agreed on {fmt_count(meta.check.get('agree', 0))} of "
                  f"{fmt_count(meta.check['compared'])} steps")
        s += ")"
    elif meta.interpreted:
        from collections import Counter

        s += (f" ({fmt_count(meta.interpreted)} interpreted, L={meta.length}, 1 in {meta.every}; "
              f"{meta.steps / meta.interpreted:.1f} steps each, stops: {describe_stops(Counter(meta.stops))})")
    if meta.over_budget:
        s += f"; {fmt_count(meta.over_budget)} not interpreted (over the CPU budget)"
    return s + " · modules " + ",".join(meta.modules)


def values_table(report: ValuesReport) -> Table:
    cols = [Col("address", style="dim"), Col("where", align="left"), Col("instruction", align="left"),
            Col("kind", align="left", style="cyan"), Col("vtot"), Col("thld"), Col("nv"),
            Col("hotlist", align="left", wrap=True, style="magenta")]
    rows = []
    for r in report.rows:
        hot = "  ".join(f"{v.text} {fmt_pct(100 * v.share, 1)}" for v in r.values)
        if r.nv > len(r.values):
            hot += f"  (+{r.nv - len(r.values)})"
        rows.append([f"{r.offset:x}", r.where, r.insn, r.kind, fmt_count(r.vtot), f"{r.p:.3g}", str(r.nv), hot])
    pre = [report.title]
    if report.summary:
        pre += report.summary.lines("values")[1:]
    pre.append(capture_line(report.meta))
    footer = ["vtot: values seen · thld: probability a value entered the hotlist (Gibbons-Matias p) · nv: values "
              "kept; shares are count/p/vtot"] + [f"note: {n}" for n in report.notes]
    return Table(cols, rows, preamble=pre, footer=footer)


# --- value columns for list ------------------------------------------------------------------


def listing_values(named: NamedHotlists, modules: list[ValueModule], namer: Namer, image_key: str, start: int,
                   end: int, kinds: list[str] | None) -> tuple[list[str], dict[int, list[str]]]:
    """Per instruction of [start, end) in ``image_key``: its most informative hotlist's top values."""
    lists = named.lists
    if not len(lists) or image_key not in named.images:
        return [], {}
    img = named.images.index(image_key)
    k = lists.keys
    sel = (k["image"] == img) & (k["offset"] >= start) & (k["offset"] < end)
    kind_ok = np.array([kind_matches(n, kinds, False) and not n.startswith("ctx") for n in named.kinds], bool)
    sel &= kind_ok[k["kind"]] if len(kind_ok) else sel
    rows = hot_rows(named, modules, namer, 2, sel)
    best: dict[int, HotRow] = {}
    for r in rows:
        cur = best.get(r.offset)
        # Prefer the hotlist whose top value explains most: that is what a reader wants to see.
        if cur is None or (r.values and (not cur.values or r.values[0].share * min(r.vtot, 50)
                                         > cur.values[0].share * min(cur.vtot, 50))):
            best[r.offset] = r
    out = {}
    for off, r in best.items():
        vals = ", ".join(f"{v.text} {fmt_pct(100 * v.share, 0)}" for v in r.values)
        out[off] = [f"{r.kind}: {vals}" if vals else r.kind]
    return ["values (top hotlist)"], out


# --- invariants ------------------------------------------------------------------------------


@dataclass
class Invariant:
    image: str
    offset: int
    where: str
    insn: str
    kind: str
    value: str
    prob: float
    prob_low: float  # two standard errors below
    vtot: int
    proc_share: float  # the procedure's share of the selection's samples
    save: float  # upper estimate of the cycles specializing it could remove, as a share of all samples
    source: str
    call_site: str = ""

    def to_json(self) -> dict[str, Any]:
        return {k: (round(v, 6) if isinstance(v, float) else v) for k, v in self.__dict__.items()}


@dataclass
class InvariantsReport:
    items: list[Invariant]
    meta: ValuesMeta | None
    summary: Summary | None
    criteria: str
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        from cyclescope.db.values import describe

        return {"criteria": self.criteria, "capture": describe(self.meta),
                "invariants": [i.to_json() for i in self.items], "notes": self.notes,
                "summary": self.summary.to_json() if self.summary else None}


def invariants_table(report: InvariantsReport) -> Table:
    cols = [Col("save<=", style="bold"), Col("proc%"), Col("address", style="dim"), Col("where", align="left"),
            Col("kind", align="left", style="cyan"), Col("value", align="left", style="magenta"), Col("prob"),
            Col("vtot"), Col("call site", align="left"), Col("source", align="left", style="green"),
            Col("instruction", align="left", wrap=True)]
    rows = []
    for x in report.items:
        rows.append([fmt_pct(100 * x.save, 2), fmt_pct(100 * x.proc_share, 1), f"{x.offset:x}", x.where, x.kind,
                     x.value, f"{fmt_pct(100 * x.prob, 0)} (>={fmt_pct(100 * x.prob_low, 0)})", fmt_count(x.vtot),
                     x.call_site or "any", x.source, x.insn])
    pre = ["cyclescope invariants: " + report.criteria]
    if report.summary:
        pre += report.summary.lines("invariants")[1:]
    pre.append(capture_line(report.meta))
    footer = ["save<=: the top value's probability times the samples of the instructions that depend on it "
              "(a register slice of the procedure), as a share of all samples: what specializing for that value "
              "could remove at most",
              "prob: estimated probability of the top value (>= two standard errors below)",
              "`cyclescope specialize` weighs such values under an optimizer's cost model (what they fold, "
              "against the test) and can profile only the candidates that could pay (`record --goal`)"]
    footer += [f"note: {n}" for n in report.notes]
    if not report.items:
        footer.insert(0, "no instruction meets the criteria")
    return Table(cols, rows, preamble=pre, footer=footer)


def selection_notes(vs: ValueSelection) -> list[str]:
    notes = []
    if vs.unreadable:
        notes.append(f"{vs.unreadable} value file(s) or directories of other users are not readable by you "
                     "(values are private to the sampled processes' owners)")
    notes += [f"skipped: {c}" for c in vs.corrupt]
    return notes
