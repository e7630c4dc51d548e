"""`cyclescope calc` output: DCPI's Figure 2 (instructions with samples, CPI,
culprits and stall bubbles per block) and Figure 4 (where a procedure's
cycles went, per culprit, as ranges).

Pure: everything comes from an analysis.calc.Calc.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from cyclescope.analysis.calc import Calc
from cyclescope.analysis.culprits import CULPRITS, STATIC
from cyclescope.analysis.frequency import MEASURED
from cyclescope.report.render import Col, Table, fmt_count, fmt_pct

# Why a block has no estimate, where frequency.py says.
NO_ESTIMATE = {"too-few-cycles": " (under half a model cycle outside loops: its samples are mostly a branch's stall)"}


@dataclass
class Summary:
    """Figure 4's accounting, in cycles (period units: multiply by P for absolute cycles).

    tallied = execution + static + (dynamic - gain) exactly: execution is each
    block's instructions at the full issue width, static the rest of its
    best-case schedule, dynamic what samples show beyond the schedule (split
    among culprits as ranges), gain where samples fall short of it.
    """

    samples: float  # cycles-event samples in the procedure
    tallied: float  # samples in blocks with a frequency estimate
    instructions: float  # sum F_b * n_b
    best_cycles: float  # sum F_b * sum M
    execution: float
    static: dict[str, float]
    dynamic_total: float  # sum F * max(0, CPI - M)
    dynamic: dict[str, tuple[float, float]]  # culprit -> (min, max)
    unexplained: float
    gain: float  # sum F * max(0, M - CPI)
    share_of_all: float | None = None

    @property
    def best_cpi(self) -> float:
        return self.best_cycles / self.instructions if self.instructions else 0.0

    @property
    def actual_cpi(self) -> float:
        return self.tallied / self.instructions if self.instructions else 0.0

    @property
    def static_total(self) -> float:
        return sum(self.static.values())

    def pct(self, x: float) -> float:
        return 100.0 * x / self.tallied if self.tallied else 0.0


def summarize(c: Calc, width: float = 6.0) -> Summary:
    ev = c.events.index(c.cycles_event)
    total = float(c.samples[:, ev].sum())
    tallied = instructions = best = execution = 0.0
    dyn_min = dict.fromkeys(CULPRITS, 0.0)
    dyn_max = dict.fromkeys(CULPRITS, 0.0)
    unexplained = gain = dyn_total = 0.0
    static = dict.fromkeys(STATIC, 0.0)
    for blk in c.cfg.blocks:
        f = c.freq.block[blk.id]
        if f is None:
            continue
        n = blk.last - blk.first + 1
        instructions += f * n
        cyc = c.model.blocks[blk.id].cycles
        best += f * cyc
        execution += f * min(cyc, n / width)
        block_static = f * max(0.0, cyc - n / width)
        weights = [c.static[k].cycles for k in range(blk.first, blk.last + 1)]
        wsum = sum(weights)
        for k in range(blk.first, blk.last + 1):
            tallied += float(c.samples[k, ev])
            st = c.static[k]
            if wsum > 0:
                static[st.reason] += block_static * weights[k - blk.first] / wsum
            gain += f * c.gain[k]
            cu = c.culprits[k]
            if c.dyn[k] <= 0:
                continue
            stall = f * c.dyn[k]
            dyn_total += stall
            if cu is None or not cu.codes:
                unexplained += stall
                continue
            # A D-cache and a DTLB candidate come together: without DTLB events the stall's lower
            # bound goes to the D-cache (the likelier), the DTLB keeps only an upper bound.
            letters = sorted(set(cu.codes) - {"t"} if "d" in cu.codes else set(cu.codes))
            for code in set(cu.codes):
                dyn_max[code] += stall
            if len(letters) == 1:
                dyn_min[letters[0]] += stall
        if wsum <= 0 and block_static > 0:
            static["issue"] += block_static
    return Summary(total, tallied, instructions, best, execution, static, dyn_total,
                   {k: (dyn_min[k], dyn_max[k]) for k in CULPRITS}, unexplained, gain)


def calc_to_json(c: Calc, s: Summary) -> dict[str, Any]:
    ev = c.events.index(c.cycles_event)
    blocks = []
    for blk in c.cfg.blocks:
        insns = []
        for k in range(blk.first, blk.last + 1):
            ins = c.cfg.insns[k]
            cu = c.culprits[k]
            insns.append({
                "address": ins.address, "instruction": ins.text,
                "samples": {e: float(c.samples[k, i]) for i, e in enumerate(c.events)},
                "m": c.model.blocks[blk.id].insns[k - blk.first].m, "cpi": c.cpi[k],
                "dynamic_stall": c.dyn[k], "static_stall": c.static[k].cycles, "static_reason": c.static[k].reason,
                "culprits": [CULPRITS[x] for x in sorted(set(cu.codes))] if cu else [],
                "culprit_addresses": cu.culprit_addrs if cu else {},
            })
        f = c.freq.block[blk.id]
        blocks.append({
            "start": blk.start, "end": blk.end, "frequency": f, "executions": c.executions(blk.id),
            "confidence": c.freq.block_confidence[blk.id], "method": c.freq.block_method[blk.id],
            "evidence": c.evidence.get(blk.id), "class": c.classes.block[blk.id],
            "unreachable": blk.id in c.cfg.unreachable,
            "samples": float(c.samples[blk.first : blk.last + 1, ev].sum()),
            "best_cycles": c.model.blocks[blk.id].cycles, "instructions": insns,
        })
    edges = []
    for e in c.cfg.edges:
        fe = c.freq.edge[e.id]
        edges.append({"src": e.src, "dst": e.dst, "kind": e.kind, "frequency": fe,
                      "executions": fe * c.period_cycles if fe is not None and c.period_cycles else None})
    return {
        "procedure": c.name, "start": c.start, "end": c.end, "events": c.events, "cycles_event": c.cycles_event,
        "period_cycles": c.period_cycles, "mcpu": c.model.mcpu, "missing_edges": c.cfg.missing_edges,
        "classes": c.classes.count, "blocks": blocks, "edges": edges,
        "summary": {
            "samples": s.samples, "tallied": s.tallied, "best_cpi": s.best_cpi, "actual_cpi": s.actual_cpi,
            "dynamic_percent_total": s.pct(s.dynamic_total - s.gain),
            "dynamic_percent": {CULPRITS[k]: [s.pct(a), s.pct(b)] for k, (a, b) in s.dynamic.items()},
            "unexplained_stall_percent": s.pct(s.unexplained), "unexplained_gain_percent": -s.pct(s.gain),
            "static_percent": {STATIC[k]: s.pct(v) for k, v in s.static.items()},
            "execution_percent": s.pct(s.execution),
        },
        "notes": c.notes,
    }


def summary_lines(c: Calc, s: Summary) -> list[str]:
    """Figure 4: where the procedure's cycles went."""
    p = s.pct
    lines = [
        f"*** Best-case {s.best_cycles:,.0f}/{s.instructions:,.0f} = {s.best_cpi:.2f} CPI",
        f"*** Actual    {s.tallied:,.0f}/{s.instructions:,.0f} = {s.actual_cpi:.2f} CPI",
        "***",
    ]
    for k in ("i", "d", "t", "p", "u", "w"):
        lo, hi = s.dynamic[k]
        lines.append(f"*** {CULPRITS[k]:<36} {p(lo):5.1f}% to {p(hi):5.1f}%")
    dynamic = s.dynamic_total - s.gain
    lines += [
        "***",
        f"*** {'Unexplained stall':<36} {p(s.unexplained):5.1f}%",
        f"*** {'Unexplained gain':<36} {-p(s.gain):5.1f}%",
        f"*** {'Subtotal dynamic':<36} {p(dynamic):5.1f}%",
        "***",
    ]
    for k, v in s.static.items():
        lines.append(f"*** {'Static: ' + STATIC[k]:<36} {p(v):5.1f}%")
    total_stall = dynamic + s.static_total
    lines += [
        f"*** {'Subtotal static':<36} {p(s.static_total):5.1f}%",
        "***",
        f"*** {'Total stall':<36} {p(total_stall):5.1f}%",
        f"*** {'Execution':<36} {p(s.execution):5.1f}%",
        f"*** {'Net sampling error':<36} {100.0 - p(total_stall + s.execution):5.1f}%",
        "***",
        f"*** Total tallied {fmt_count(s.tallied)} of {fmt_count(s.samples)} samples in the procedure"
        + (f" ({s.share_of_all:.1f}% of all samples)" if s.share_of_all is not None else ""),
    ]
    return lines


def calc_table(c: Calc, s: Summary, hot_only: bool = False) -> Table:
    """Figure 2: per block, best-case and actual CPI, then each instruction with samples, CPI, culprits."""
    ev = c.events.index(c.cycles_event)
    cols = [Col("address", style="dim"), Col("instruction", "left"), Col(c.cycles_event, style="bold"),
            Col("M", style="dim"), Col("CPI"), Col("culprits", "left", style="yellow")]
    rows: list[list[str]] = []
    styles: list[str | None] = []
    legend = " ".join(f"{k}={v}" for k, v in CULPRITS.items())
    for blk in c.cfg.blocks:
        bs = float(c.samples[blk.first : blk.last + 1, ev].sum())
        if hot_only and bs == 0:
            continue
        f = c.freq.block[blk.id]
        n = blk.last - blk.first + 1
        best = c.model.blocks[blk.id].cycles
        # Held at its floor: its count a lower bound (analysis/frequency.py sample_floors), its CPI
        # and stalls upper bounds.
        floor = c.freq.block_method[blk.id] == "floor"
        if blk.id in c.cfg.unreachable:
            head = f"block {blk.start:x}: unreachable (padding)"
        elif f is None:
            head = f"block {blk.start:x}: no frequency estimate" + NO_ESTIMATE.get(c.freq.block_method[blk.id], "")
        else:
            ex = c.executions(blk.id)
            exs = "" if ex is None else f", {'at least ' if floor else '~'}{ex:,.0f} executions"
            actual = bs / f / n if f else 0.0
            head = (f"block {blk.start:x}: F={f:,.2f}{exs} ({c.freq.block_confidence[blk.id]} confidence, "
                    f"{c.freq.block_method[blk.id]}) · best-case {best:.1f}/{n} = {best / n:.2f} CPI · "
                    f"actual {'at most ' if floor else ''}{bs / f if f else 0:,.1f}/{n} = {actual:.2f} CPI")
        rows.append(["", head, "", "", "", ""])
        styles.append("bold cyan")
        if blk.id in c.evidence and f is not None:  # what a measured count rests on
            rows.append(["", f"  evidence: {c.evidence[blk.id]}", "", "", "", ""])
            styles.append("dim")
        for k in range(blk.first, blk.last + 1):
            ins = c.cfg.insns[k]
            cu = c.culprits[k]
            if cu is not None and c.dyn[k] >= 0.5:
                why = "".join(sorted(set(cu.codes))) or "?"
                who = "; ".join(f"{code} at {', '.join(f'{a:x}' for a in addrs)}"
                                for code, addrs in cu.culprit_addrs.items() if addrs)
                rows.append(["", f"  {why}  {'at most ' if floor else ''}{c.dyn[k]:.1f} cy dynamic stall"
                             + (f" ({who})" if who else ""),
                             "", "", "", ""])
                styles.append("yellow")
            st = c.static[k]
            m = c.model.blocks[blk.id].insns[k - blk.first].m
            cpi = c.cpi[k]
            cpi_s = f"{'<=' if floor else ''}{cpi:.2f}cy" if cpi is not None and float(c.samples[k, ev]) else ""
            if not float(c.samples[k, ev]) and m == 0:
                cpi_s = "(0)"
            cul = ""
            if cu is not None and cu.codes and c.dyn[k] >= 0.5:
                cul = "".join(sorted(set(cu.codes)))
            elif st.cycles >= 1.0 and st.reason == "dep" and st.producer is not None:
                cul = f"s:{st.producer:x}"
            rows.append([f"{ins.address:x}", ins.text, fmt_count(c.samples[k, ev]) if c.samples[k, ev] else "",
                         f"{m:.1f}" if m else "", cpi_s, cul])
            hot = s.samples and float(c.samples[k, ev]) >= 0.05 * s.samples
            styles.append("bold red" if hot else None)
    pre = [f"cyclescope calc: {c.name} {c.start:#x}-{c.end:#x} · {len(c.cfg.blocks)} blocks, "
           f"{len(c.cfg.edges)} edges, {c.classes.count} frequency classes, model {c.model.mcpu}"
           + (f", P = {c.period_cycles:,.0f} cycles" if c.period_cycles else ""),
           f"culprits: {legend}; s:ADDR = static stall waiting on ADDR"]
    footer = summary_lines(c, s) + [f"note: {n}" for n in c.notes]
    return Table(cols, rows, preamble=pre, footer=footer, row_styles=styles)


def image_table(rows: list[tuple[str, Calc, Summary]], total_samples: float) -> Table:
    cols = [Col("samples", style="bold"), Col("%"), Col("best CPI"), Col("actual CPI"), Col("D-cache%"),
            Col("I-cache%"), Col("mispredict%"), Col("unexplained%"), Col("static%"), Col("measured%"),
            Col("confidence", "left"), Col("procedure", "left", style="cyan", wrap=True)]
    out = []
    for name, c, s in rows:
        conf = [c.freq.block_confidence[b.id] for b in c.cfg.blocks if c.freq.block[b.id] is not None]
        high = sum(1 for x in conf if x == "high")
        ev = c.events.index(c.cycles_event)
        measured = sum(float(c.samples[b.first : b.last + 1, ev].sum()) for b in c.cfg.blocks
                       if c.freq.block_method[b.id] in MEASURED
                       and not (c.freq.block_method[b.id] == "paths" and c.freq.block_confidence[b.id] == "low"))
        out.append([fmt_count(s.samples), fmt_pct(100 * s.samples / total_samples) if total_samples else "-",
                    f"{s.best_cpi:.2f}", f"{s.actual_cpi:.2f}", f"{s.pct(s.dynamic['d'][1]):.1f}",
                    f"{s.pct(s.dynamic['i'][1]):.1f}", f"{s.pct(s.dynamic['p'][1]):.1f}",
                    f"{s.pct(s.unexplained):.1f}", f"{s.pct(sum(s.static.values())):.1f}",
                    f"{100 * measured / s.samples:.0f}" if s.samples else "-", f"{high}/{len(conf)} high", name])
    return Table(cols, out, preamble=["cyclescope calc: per procedure (upper bounds of culprit shares; measured%: "
                                      "samples in blocks whose count rests on a measurement: an anchor, a loop "
                                      "counter, a trip count, or sampled paths scaled by those or by the model's "
                                      "clean blocks)"])
