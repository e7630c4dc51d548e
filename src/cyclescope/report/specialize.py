"""`cyclescope specialize` output: the opportunities, most valuable first, and how many candidates
the goal kept (pure: everything comes from an app.specialize.SpecializeReport)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from cyclescope.analysis.goal import PHI_SHARE, TEST_COST_ZERO, Candidate, GoalModel
from cyclescope.report.render import Col, Table, fmt_count, fmt_pct
from cyclescope.values.modules import fmt_int


@dataclass
class Opportunity:
    procedure: str
    address: int  # where the test would go (ELF address)
    where: str  # procedure+offset
    source: str  # file:line
    what: str  # the register or expression
    kind: str  # argument, register, trips, difference
    value: int
    prob: float
    se: float
    observed: int  # values behind prob
    benefit: float  # cycles saved if the value were always known (period units: cycles / P)
    net: float  # rule (1): benefit x prob - test cost x executions of the point
    share: float  # net as a share of the selection's cycles
    folded: int  # instructions the value evaluates or reduces
    exact: bool = False  # prob from every execution of the point (a probe), not from samples

    def to_json(self) -> dict[str, Any]:
        return {k: (round(v, 6) if isinstance(v, float) else v) for k, v in self.__dict__.items()}


@dataclass
class ProcedureGoal:
    """One procedure's candidates: what the model saw and what static elimination kept."""

    name: str
    image: str  # image key
    path: str  # the binary
    build_id: str | None
    start: int
    instructions: int
    loads: int  # the straightforward profiler's candidates: every load's result
    candidates: list[Candidate]
    kept: list[Candidate]
    addresses: list[int]  # instruction addresses, by index
    offsets: dict[int, int]  # ELF address -> image offset (for the hotlists and uprobes)


@dataclass
class SpecializeReport:
    opportunities: list[Opportunity]
    procedures: list[ProcedureGoal]
    unobserved: int  # kept candidates without a value profile
    phi: float  # in period units
    total: float  # the selection's cycles-event samples
    period_cycles: float | None
    notes: list[str] = field(default_factory=list)
    models: dict[str, GoalModel] = field(default_factory=dict)  # "image:start" -> the procedure's model
    # executions per CPU-second of the profiled programs per unit of calc's frequencies (the core
    # clock over the samples' count); None where the clock was not measured
    rate_scale: float | None = None

    @property
    def counts(self) -> dict[str, int]:
        return {"instructions": sum(p.instructions for p in self.procedures),
                "loads": sum(p.loads for p in self.procedures),
                "candidates": sum(len(p.candidates) for p in self.procedures),
                "kept": sum(len(p.kept) for p in self.procedures)}

    def to_json(self) -> dict[str, Any]:
        return {"opportunities": [o.to_json() for o in self.opportunities], "counts": self.counts,
                "kept_unobserved": self.unobserved, "phi_share": PHI_SHARE if not self.total else self.phi / self.total,
                "period_cycles": self.period_cycles, "notes": self.notes,
                "procedures": [{"name": p.name, "instructions": p.instructions, "loads": p.loads,
                                "candidates": len(p.candidates), "kept": len(p.kept)} for p in self.procedures]}


def counts_line(report: SpecializeReport) -> str:
    c = report.counts
    kept = 100.0 * c["kept"] / c["candidates"] if c["candidates"] else 0.0
    return (f"{len(report.procedures)} procedure(s), {fmt_count(c['instructions'])} instructions: "
            f"{fmt_count(c['candidates'])} candidates (registers at their definitions and at entry, differences, "
            f"trip counts), {fmt_count(c['kept'])} kept by static elimination ({fmt_pct(kept, 1)}); "
            f"profiling every load's result would take {fmt_count(c['loads'])}")


def specialize_table(report: SpecializeReport) -> Table:
    cols = [Col("saves", style="bold"), Col("net", style="bold"), Col("benefit"), Col("address", style="dim"),
            Col("where", align="left"), Col("what", align="left", style="cyan"), Col("value", align="left",
                                                                                   style="magenta"),
            Col("prob"), Col("n"), Col("folds"), Col("source", align="left", style="green")]
    p = report.period_cycles

    def unit(x: float) -> str:
        return fmt_count(x * p) if p else fmt_count(x)

    rows = []
    for o in report.opportunities:
        rows.append([fmt_pct(100 * o.share, 2), unit(o.net), unit(o.benefit), f"{o.address:x}", o.where,
                     f"{o.what} ({o.kind})", fmt_int(o.value),
                     f"{fmt_pct(100 * o.prob, 0)} (>={fmt_pct(100 * max(0.0, o.prob - 2 * o.se), 0)})",
                     fmt_count(o.observed) + ("*" if o.exact else ""), str(o.folded), o.source])
    pre = ["cyclescope specialize: where knowing a value pays for its test (goal-directed value profiling)",
           counts_line(report)]
    if report.unobserved:
        pre.append(f"{report.unobserved} kept candidate(s) had no values in this selection")
    cyc = "cycles" if p else "cycles/P (the clock was not measured)"
    phi = fmt_pct(100 * report.phi / report.total, 2) if report.total else "0"
    footer = [f"saves: net as a share of the selection's cycles; net: benefit x prob - test ({TEST_COST_ZERO:g} cycle "
              f"a compare and branch, 2 for a value beyond 32 bits) x executions of the point, in {cyc}; "
              f"benefit: what the value known on every execution would save (the instructions it folds, times "
              f"calc's counts of them, times their latency)",
              f"kept: rule (2), benefit >= test x executions + phi (phi: {phi} of the selection's cycles)"]
    if any(o.exact for o in report.opportunities):
        footer.append("n*: every execution of the point, captured by a probe (record --goal), not sampled")
    footer += [f"note: {n}" for n in report.notes]
    if not report.opportunities:
        footer.insert(0, "no opportunity passes rule (1)")
    return Table(cols, rows, preamble=pre, footer=footer)
