"""Comparing sample sets: `stats` (DCPI's dcpistats, Figure 3) and `diff`.

Pure: inputs are per-set counts keyed by (procedure, image).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from cyclescope.report.render import Col, Table, fmt_count, fmt_pct

Key = tuple[str, str]  # (procedure, image)


# --- stats ------------------------------------------------------------------------------------


@dataclass
class StatsRow:
    key: Key
    counts: list[float]
    total: float
    share: float  # sum% of all sets' samples
    n: int
    mean: float
    std: float
    lo: float
    hi: float
    range_share: float  # (max - min) / sum: DCPI's normalized range

    @property
    def dispersion(self) -> float:
        """std-dev / sqrt(mean): about 1 when the counts vary only as sampling (Poisson) noise does."""
        return self.std / math.sqrt(self.mean) if self.mean > 0 else 0.0

    def to_json(self, sets: list[str]) -> dict[str, Any]:
        return {
            "procedure": self.key[0], "image": self.key[1], "range_percent": 100 * self.range_share,
            "dispersion": self.dispersion,
            "sum": self.total, "sum_percent": 100 * self.share, "n": self.n, "mean": self.mean, "std_dev": self.std,
            "min": self.lo, "max": self.hi, "per_set": dict(zip(sets, self.counts, strict=True)),
        }


@dataclass
class StatsReport:
    event: str
    sets: list[str]
    set_totals: list[int]
    rows: list[StatsRow]
    normalized: bool
    header: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {
            "event": self.event, "normalized": self.normalized,
            "sets": [{"name": s, "samples": t} for s, t in zip(self.sets, self.set_totals, strict=True)],
            "rows": [r.to_json(self.sets) for r in self.rows],
        }


def build_stats(event: str, sets: list[str], per_set: list[dict[Key, int]], normalize: bool = False) -> StatsReport:
    """Per procedure across sets: sum, mean, sample std-dev, min, max, and range / sum.

    A procedure absent from a set counts 0 there. With ``normalize``, counts
    are scaled to each set's share of a common total (runs of different
    length compare by share of time, not by absolute time).
    """
    totals = [sum(d.values()) for d in per_set]
    keys = sorted({k for d in per_set for k in d})
    grand = sum(totals)
    mean_total = grand / len(per_set) if per_set else 0
    rows = []
    for k in keys:
        raw = [float(d.get(k, 0)) for d in per_set]
        if normalize:
            raw = [c / t * mean_total if t else 0.0 for c, t in zip(raw, totals, strict=True)]
        a = np.array(raw)
        s = float(a.sum())
        if s <= 0:
            continue
        std = float(a.std(ddof=1)) if len(a) > 1 else 0.0
        rows.append(StatsRow(k, raw, s, s / grand if grand else 0.0, len(a), float(a.mean()), std, float(a.min()),
                             float(a.max()), float(a.max() - a.min()) / s))
    rows.sort(key=lambda r: (-r.range_share, -r.total, r.key))
    return StatsReport(event, sets, totals, rows, normalize)


def stats_table(report: StatsReport, limit: int | None = None, min_share: float = 0.0) -> Table:
    pre = [f"cyclescope stats: {report.event} samples in {len(report.sets)} sets"
           + (" (normalized to equal totals)" if report.normalized else "")]
    pre.append("  ".join(f"{s} = {fmt_count(t)}" for s, t in zip(report.sets, report.set_totals, strict=True))
               + f"  TOTAL {fmt_count(sum(report.set_totals))}")
    cols = [Col("range%"), Col("sum"), Col("sum%"), Col("N"), Col("mean"), Col("std-dev"), Col("min"), Col("max"),
            Col("disp"), Col("procedure", "left", style="cyan", wrap=True), Col("image", "left", wrap=True)]
    rows = []
    styles: list[str | None] = []
    big = [r for r in report.rows if r.share >= min_share]
    shown = big if limit is None else big[:limit]
    for r in shown:
        rows.append([fmt_pct(100 * r.range_share), f"{r.total:,.0f}", fmt_pct(100 * r.share), str(r.n),
                     f"{r.mean:,.2f}", f"{r.std:,.2f}", f"{r.lo:,.0f}", f"{r.hi:,.0f}", f"{r.dispersion:.1f}",
                     r.key[0], r.key[1]])
        styles.append("bold red" if not report.normalized and r.dispersion > 3 else None)
    footer = []
    if len(shown) < len(big):
        footer.append(f"... {len(big) - len(shown)} more procedures (--limit 0 shows all)")
    if len(big) < len(report.rows):
        footer.append(f"{len(report.rows) - len(big)} procedures under {100 * min_share:g}% of the samples are not "
                      "shown (--min-percent 0 shows them)")
    if not report.normalized:
        footer.append("disp = std-dev / sqrt(mean): about 1 when the differences are sampling noise; "
                      "above 3, the procedure's time really varies between sets")
    return Table(cols, rows, preamble=pre, footer=footer, row_styles=styles)


# --- diff -------------------------------------------------------------------------------------


@dataclass
class DiffRow:
    key: Key
    a: int
    b: int
    a_share: float
    b_share: float
    delta: float  # b_share - a_share (fraction)
    z: float
    p: float
    q: float  # Benjamini-Hochberg adjusted p-value
    significant: bool

    @property
    def ratio(self) -> float:
        return self.b_share / self.a_share if self.a_share else math.inf


@dataclass
class DiffReport:
    event: str
    a_name: str
    b_name: str
    a_total: int
    b_total: int
    alpha: float
    min_change: float
    rows: list[DiffRow]
    unit: str = "procedure"

    @property
    def flagged(self) -> list[DiffRow]:
        return [r for r in self.rows if r.significant]

    def to_json(self) -> dict[str, Any]:
        return {
            "event": self.event, "a": {"name": self.a_name, "samples": self.a_total},
            "b": {"name": self.b_name, "samples": self.b_total}, "alpha": self.alpha,
            "min_change_percent_points": 100 * self.min_change, "unit": self.unit,
            "rows": [{
                self.unit: r.key[0], "image": r.key[1], "a": r.a, "b": r.b, "a_percent": 100 * r.a_share,
                "b_percent": 100 * r.b_share, "delta_percent_points": 100 * r.delta,
                "ratio": None if math.isinf(r.ratio) else r.ratio, "z": r.z, "p": r.p, "q": r.q,
                "significant": r.significant,
            } for r in self.rows],
        }


def two_proportion_z(a: np.ndarray, b: np.ndarray, na: int, nb: int) -> tuple[np.ndarray, np.ndarray]:
    """z and two-sided p of H0: the share a/na equals b/nb (pooled two-proportion test).

    Samples are treated as independent draws of "which procedure was running":
    a Poisson process sampled at random times, which is what randomized
    periods aim for.
    """
    pa_, pb_ = a / na, b / nb
    pooled = (a + b) / (na + nb)
    se = np.sqrt(pooled * (1 - pooled) * (1 / na + 1 / nb))
    with np.errstate(divide="ignore", invalid="ignore"):
        z = np.where(se > 0, (pb_ - pa_) / se, 0.0)
    return z, erfc(np.abs(z) / math.sqrt(2))


def erfc(x: np.ndarray) -> np.ndarray:
    """The complementary error function of each x >= 0, vectorized, with a relative error under
    1.2e-7 everywhere (Numerical Recipes' erfcc, a Chebyshev fit: W. H. Press et al., 2nd ed., 6.2),
    so that the tiny p-values Benjamini-Hochberg ranks among a million frames keep their order.
    By hand because numpy has no erfc and scipy, which has, is a large dependency for one function;
    math.erfc per element cost 1.5 s over a flame graph's 1.7 million frames."""
    x = np.asarray(x, np.float64)
    t = 1.0 / (1.0 + 0.5 * x)
    poly = -1.26551223 + t * (1.00002368 + t * (0.37409196 + t * (0.09678418 + t * (
        -0.18628806 + t * (0.27886807 + t * (-1.13520398 + t * (1.48851587 + t * (
            -0.82215223 + t * 0.17087277))))))))
    out: np.ndarray = t * np.exp(-x * x + poly)
    return out


def benjamini_hochberg(p: np.ndarray) -> np.ndarray:
    """FDR-adjusted p-values (q-values): tests over many procedures do not flag noise by sheer number."""
    n = len(p)
    if not n:
        return p
    order = np.argsort(p)
    ranked = p[order] * n / np.arange(1, n + 1)
    q = np.minimum.accumulate(ranked[::-1])[::-1]
    out = np.empty(n)
    out[order] = np.minimum(q, 1.0)
    return out


def build_diff(event: str, a_name: str, b_name: str, a: dict[Key, int], b: dict[Key, int],
               alpha: float = 0.05, min_change: float = 0.001, unit: str = "procedure") -> DiffReport:
    """Which keys' shares of samples changed, with a two-proportion test and FDR control.

    Flagged: q < alpha and the share moved by at least ``min_change`` (a
    fraction: 0.001 is 0.1 percentage points), so that huge sample counts do
    not flag changes too small to matter.
    """
    keys = sorted(set(a) | set(b))
    na, nb = sum(a.values()), sum(b.values())
    if not keys or na == 0 or nb == 0:
        return DiffReport(event, a_name, b_name, na, nb, alpha, min_change, [], unit)
    av = np.array([a.get(k, 0) for k in keys], float)
    bv = np.array([b.get(k, 0) for k in keys], float)
    z, p = two_proportion_z(av, bv, na, nb)
    q = benjamini_hochberg(p)
    rows = []
    for i, k in enumerate(keys):
        sa, sb = av[i] / na, bv[i] / nb
        d = sb - sa
        rows.append(DiffRow(k, int(av[i]), int(bv[i]), sa, sb, d, float(z[i]), float(p[i]), float(q[i]),
                            bool(q[i] < alpha and abs(d) >= min_change)))
    rows.sort(key=lambda r: (not r.significant, -abs(r.delta), r.key))
    return DiffReport(event, a_name, b_name, na, nb, alpha, min_change, rows, unit)


def diff_table(report: DiffReport, limit: int | None = None, all_rows: bool = False) -> Table:
    pre = [f"cyclescope diff: {report.event} samples, A = {report.a_name} ({fmt_count(report.a_total)}), "
           f"B = {report.b_name} ({fmt_count(report.b_total)})",
           f"flagged: {len(report.flagged)} {report.unit}s whose share changed by >= "
           f"{100 * report.min_change:.2g} points "
           f"with FDR q < {report.alpha:g} (two-proportion z-test, Benjamini-Hochberg)"]
    cols = [Col("", "left"), Col("A"), Col("A%"), Col("B"), Col("B%"), Col("change", style="bold"), Col("ratio"),
            Col("q"), Col(report.unit, "left", style="cyan", wrap=True), Col("image", "left", wrap=True)]
    rows: list[list[str]] = []
    styles: list[str | None] = []
    src = report.rows if all_rows else [r for r in report.rows if r.significant]
    shown = src if limit is None else src[:limit]
    for r in shown:
        mark = ("+" if r.delta > 0 else "-") if r.significant else ""
        ratio = "new" if math.isinf(r.ratio) else f"{r.ratio:.2f}x"
        rows.append([mark, fmt_count(r.a), fmt_pct(100 * r.a_share), fmt_count(r.b), fmt_pct(100 * r.b_share),
                     f"{100 * r.delta:+.2f}", ratio, f"{r.q:.2g}", r.key[0], r.key[1]])
        styles.append(("red" if r.delta > 0 else "green") if r.significant else "dim")
    footer = []
    if len(shown) < len(src):
        footer.append(f"... {len(src) - len(shown)} more (--limit 0 shows all)")
    if not all_rows:
        unchanged = len(report.rows) - len(report.flagged)
        footer.append(f"{unchanged} {report.unit}s did not change significantly (--all shows them)")
    return Table(cols, rows, preamble=pre, footer=footer, row_styles=styles)
