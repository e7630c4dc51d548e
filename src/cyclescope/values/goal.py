"""Targeted value collection for goal-directed profiling (`record --goal PLAN`).

`cyclescope specialize --plan FILE` writes the candidates static elimination keeps (analysis/goal.py)
with, for each, every instruction of its procedure where the candidate's value is still in its
register (the definition is the only one reaching there, or a copy of it holds it). This module
captures that register at the interrupt when a sample lands on one of those instructions, as
``goal:REG`` hotlists, and nothing else: the candidate is observed wherever a sample falls in its
live range, not only where it is read, and no other (point, register) costs anything.

Dynamic elimination (the paper's section 4.4) happens where the collector flushes: a candidate whose
top value can no longer reach the probability rule (3) asks of it (with two standard errors of
margin: the counts are sampled) is switched off; its captures stop and its hotlists are kept as
they are.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from cyclescope.db.hotlist import EXACT_PREFIX
from cyclescope.errors import DataError
from cyclescope.images.disasm import MemOperand
from cyclescope.values.api import BaseModule, Capture, FormatContext, Value
from cyclescope.values.insn import REG_VIEWS, InsnDetail, RegView

if TYPE_CHECKING:
    from cyclescope.db.values import NamedHotlists

PLAN_VERSION = 3
READS_VERSIONS = (2, 3)  # 2: plans without probe sites
KIND = "goal:"
EXACT_KIND = EXACT_PREFIX  # values/probes.py: every execution of a probed point
MIN_VALUES = 64  # values a candidate must have before it may be switched off


@dataclass(frozen=True)
class ProbeSpec:
    """Where a candidate can be captured at every execution (values/probes.py): the instruction just
    after its definition (an argument: the procedure's entry), in its file, and how often it ran."""

    at: int  # image offset as samples key it (one of the point's ``at``)
    reg: str
    path: str
    file_offset: int
    build_id: str | None
    rate: float  # executions per CPU-second of the profiled programs, in the plan's profile
    rate_confidence: str = "high"  # calc's confidence in the count the rate comes from
    emulated: bool = False  # the instruction is one the kernel emulates at a hit (images/disasm.uprobe_emulated)


@dataclass
class GoalPoint:
    """One kept candidate: where its value lives, and the probability its top value needs."""

    image: str  # image key
    procedure: str
    what: str
    min_prob: float
    at: list[tuple[int, str]]  # (instruction address = image offset, 64-bit register)
    on: bool = True
    probe: ProbeSpec | None = None
    exact: bool = False  # its probe is open: the samples need not capture it
    mems: tuple[MemOperand, MemOperand] | None = None  # load avoidance: the two addresses compared


@dataclass
class Plan:
    points: list[GoalPoint]
    doc: dict[str, Any] = field(default_factory=dict)


def read_plan(path: str | Path) -> Plan:
    """A plan written by `specialize --plan`; DataError with a one-line reason."""
    try:
        doc = json.loads(Path(path).read_text())
    except OSError as e:
        raise DataError(f"{path}: {e.strerror}") from None
    except ValueError as e:
        raise DataError(f"{path}: not a plan (`cyclescope specialize --plan FILE` writes one): {e}") from None
    if not isinstance(doc, dict) or doc.get("version") not in READS_VERSIONS or not isinstance(doc.get("points"), list):
        raise DataError(f"{path}: not a plan of this version (write it again with `cyclescope specialize --plan`)")
    points = []
    for p in doc["points"]:
        try:
            at = [(int(a), str(r)) for a, r in p["at"]]
            pr = p.get("probe")
            probe = None
            if pr is not None and operands(str(pr["reg"])):
                probe = ProbeSpec(int(pr["at"]), str(pr["reg"]), str(pr["path"]), int(pr["file_offset"]),
                                  str(pr["build_id"]) if pr.get("build_id") else None, float(pr["rate"]),
                                  str(pr.get("rate_confidence", "high")), bool(pr.get("emulated", False)))
            mems = None
            if p.get("mems") is not None:
                m1, m2 = (MemOperand(str(b), str(i), int(sc), int(d), int(sz)) for b, i, sc, d, sz in p["mems"])
                if not all(r in REG_VIEWS for x in (m1, m2) for r in (x.base, x.index) if r):
                    raise ValueError(p["mems"])
                mems = (m1, m2)
            points.append(GoalPoint(str(p["image"]), str(p.get("procedure", "")), str(p.get("what", "")),
                                    float(p["min_prob"]),
                                    [(a, r) for a, r in at if operands(r) or (mems and r.startswith(SAME))],
                                    probe=probe, mems=mems))
        except (KeyError, TypeError, ValueError):
            raise DataError(f"{path}: a point lacks image, min_prob or at (instruction, register) pairs, "
                            "or its probe site is malformed") from None
    return Plan(points, doc)


SAME = "same-as-"  # load avoidance's expression: address(M1) - address(M2), named by both addresses


def operands(what: str) -> tuple[RegView] | tuple[RegView, RegView] | None:
    """The register views a plan's ``what`` names: one register ("rdx", "edx"), or the difference of
    two as a ``cmp`` reads them ("edi-esi"); None if it names neither."""
    a, sep, b = what.partition("-")
    if not sep:
        return (REG_VIEWS[a],) if a in REG_VIEWS else None
    if a in REG_VIEWS and b in REG_VIEWS:
        return REG_VIEWS[a], REG_VIEWS[b]
    return None


def kind_of(what: str) -> str:
    """The hotlist kind's name after ``goal:``/``exact:``: the 64-bit register(s)."""
    ops = operands(what)
    if ops is None:
        return what
    return "-".join(v.full for v in ops)


def share_se(share: float, n: float) -> float:
    """The standard error of a share of ``n`` sampled values (at least that of one value in n, so
    that a share of 1 from few values is not taken as certain)."""
    return math.sqrt(max(share * (1 - share), 1.0 / n) / n)


def top_upper(top: float, n: float) -> float:
    """The top value's share plus two standard errors (a sampled count's margin)."""
    if n <= 0:
        return 1.0
    p = min(1.0, top / n)
    return p + 2.0 * share_se(p, n)


class GoalModule(BaseModule):
    """The `goal` value module: captures only the plan's candidates (see the module's doc).
    Without a plan (reading values back) it only formats ``goal:REG`` values."""

    name = "goal"
    description = "the kept candidates of a goal plan, wherever their value is live (goal:REG)"

    def __init__(self, plan: Plan | None = None) -> None:
        self.goal_plan = plan or Plan([])
        self._at: dict[tuple[str, int], list[tuple[int, str]]] = {}  # (image, address) -> [(point, reg)]
        for i, p in enumerate(self.goal_plan.points):
            for a, r in p.at:
                self._at.setdefault((p.image, a), []).append((i, r))
        self.switched_off = 0
        self._values: dict[tuple[str, int, str], dict[int, float]] = {}
        self._n: dict[tuple[str, int, str], float] = {}

    def plan_in(self, image: str, insn: InsnDetail) -> Sequence[Capture]:
        return self.plan_at(image, insn.address)

    def plan_at(self, image: str, address: int) -> Sequence[Capture]:
        """The captures at ``address`` of ``image``: registers, their differences and addresses
        formed from them, none needing the instruction itself (values/api.py)."""
        points = self.goal_plan.points
        here = {r: points[i] for i, r in self._at.get((image, address), ())
                if points[i].on and not points[i].exact}
        out = []
        for r in sorted(here):
            if r.startswith(SAME):
                mems = here[r].mems
                if mems is not None:
                    out.append(Capture(KIND + r, "addrdiff", mems=mems))
                continue
            ops = operands(r)
            if ops is None:
                continue
            if len(ops) == 1:
                out.append(Capture(KIND + ops[0].full, "reg", REG_VIEWS[ops[0].full]))
            else:
                out.append(Capture(KIND + kind_of(r), "diff", ops[0], reg2=ops[1]))
        return out

    def only_at(self) -> dict[str, list[int]]:
        """Image key -> the offsets where this module captures anything (the points switched on and
        not probed): samples elsewhere are not looked at."""
        out: dict[str, list[int]] = {}
        for p in self.goal_plan.points:
            if p.on and not p.exact:
                out.setdefault(p.image, []).extend(a for a, _ in p.at)
        return out

    def format(self, kind: str, value: Value, ctx: FormatContext) -> str | None:
        if not kind.startswith((KIND, EXACT_KIND)):
            return None
        from cyclescope.values.modules import fmt_int

        return fmt_int(value.v0)

    def observe(self, named: NamedHotlists) -> list[int]:
        """Adds a flush's ``goal:`` hotlists to the running tallies, then applies rule (3)."""
        lists = named.lists
        for i in range(len(lists)):
            kind = named.kinds[int(lists.keys["kind"][i])]
            if not kind.startswith((KIND, EXACT_KIND)):
                continue
            key = (named.images[int(lists.keys["image"][i])], int(lists.keys["offset"][i]), kind.partition(":")[2])
            vals = self._values.setdefault(key, {})
            rows = np.flatnonzero(lists.hot == i)
            p = float(lists.p[i]) or 1.0
            for r in rows.tolist():
                v = int(lists.values[r]["v0"])
                vals[v] = vals.get(v, 0.0) + float(lists.counts[r]) / p
            if len(vals) > 4 * MIN_VALUES:  # the running tally stays small: the rare values go to "other"
                for v in sorted(vals, key=vals.__getitem__)[: len(vals) - MIN_VALUES]:
                    del vals[v]
            self._n[key] = self._n.get(key, 0.0) + float(lists.total[i])
        tops = {k: (max(v.values(), default=0.0), self._n[k]) for k, v in self._values.items()}
        return self.prune(tops)

    def prune(self, tops: dict[tuple[str, int, str], tuple[float, float]]) -> list[int]:
        """Rule (3) at a flush: ``tops`` maps (image, address, register) to (top value's estimated
        count, values seen) over what has been captured; a candidate whose best observation point
        has seen MIN_VALUES values and whose top share cannot reach its min_prob, even two
        standard errors up, is switched off. Returns the points switched off now."""
        out = []
        for i, p in enumerate(self.goal_plan.points):
            if not p.on:
                continue
            seen = [tops[k] for a, r in p.at if (k := (p.image, a, kind_of(r))) in tops]
            if not seen:
                continue
            top, n = max(seen, key=lambda t: t[1])
            if n >= MIN_VALUES and top_upper(top, n) < p.min_prob:
                p.on = False
                out.append(i)
        self.switched_off += len(out)
        return out
