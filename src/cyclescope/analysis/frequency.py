"""Estimating how often each block ran, from CYCLES samples alone (DCPI 6.1.3-6.1.5).

F is executions per sampling period: an instruction i with samples S_i and
static cycles M_i (schedule.py) that suffers no dynamic stall has
S_i = F * M_i. Per frequency class (equivalence.py), the issue points
(instructions with M_i > 0) give ratios S_i / M_i; dynamic stalls only
raise them, so F is estimated from a cluster of the smallest ratios
(max <= 1.5 min), discarding anomalous clusters: too few of the class's
issue points, or an F that would imply an unreasonable stall elsewhere.
When the class has few samples, F = sum S / sum M. The dependence-window
refinement replaces S_i / M_i by the ratio over the instructions since the
one i depends on, which dynamic stalls in between cannot shrink.

Classes without estimates get values from the flow constraints (a block's
frequency equals the sum over its in-edges and over its out-edges) by
local propagation: linear time, every new value copied to its whole class,
never negative. Where the estimates violate the constraints, a global
repair finds the circulation closest to them (minimum-cost flow, as LLVM's
profile inference does), weighting each estimate by its confidence.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from cyclescope.analysis.cfg import CFG, ENTRY, EXIT
from cyclescope.analysis.confidence import SURETY
from cyclescope.analysis.equivalence import Classes, cyclic_blocks
from cyclescope.analysis.estimators import ESTIMATORS  # how a stalled class's F is set; see estimate_class
from cyclescope.analysis.schedule import ProcedureModel
from cyclescope.images.disasm import InsnInfo

CLUSTER_SPREAD = 1.5  # DCPI: max ratio in a cluster <= 1.5 * min
MIN_FRACTION = 0.25  # a cluster needs at least this share of the class's issue points
FEW_SAMPLES = 40  # below this, F = sum S / sum M over the class
MAX_STALL = 600.0  # cycles: more than any plausible miss per execution
CONFIDENCE_WEIGHT = {"high": 8, "medium": 3, "low": 1}
# Counts measured rather than modelled (loop counters, trip counts, exact entry counts): the repair
# moves them last.
MEASURED = ("loop-counter", "loop-trips", "trip-window", "anchor", "progress", "paths")
MEASURED_WEIGHT = {"high": 256, "medium": 32, "low": 8}
SHAPE_EXCESS = 0.2  # a block whose samples exceed the model's shape by less than this is stall-free
MIN_BLOCK_M = 1.5  # cycles of (skidded) model a block needs for its ratio to mean anything
MIN_BLOCK_POINTS = 3  # instructions carrying model cycles: with fewer, any shape "fits"
MIN_BLOCK_SAMPLES = 20
TINY_CLASS_M = 0.5  # model cycles: an acyclic class resting on less gets no issue-point estimate
FAR_BELOW = 4  # the repair: a model's estimate pulls twice as hard on flow below a quarter of it


def shape_excess(s: Sequence[float], m: Sequence[float]) -> float:
    """Share of a block's samples beyond what its model's shape explains at F = sum S / sum M.

    Near 0: samples spread over the instructions as the model says; the block
    ran without dynamic stalls and sum S / sum M is its frequency. Large: a
    stall dominates, and on an out-of-order core the other instructions'
    static cycles are hidden in its shadow, so no ratio in the block is F.
    """
    total_s, total_m = float(sum(s)), float(sum(m))
    if total_s <= 0 or total_m <= 0:
        return 1.0
    f = total_s / total_m
    return sum(max(0.0, float(x) - f * float(y)) for x, y in zip(s, m, strict=True)) / total_s


@dataclass
class ClassEstimate:
    value: float | None
    confidence: str  # high, medium, low
    method: str  # issue-points, sum-ratio, propagated, repaired, none
    points_used: int = 0
    points: int = 0
    spread: float = 0.0  # max/min of the ratios used


@dataclass
class Frequencies:
    block: list[float | None]  # F per block (None: no estimate)
    edge: list[float | None]
    block_confidence: list[str]
    block_method: list[str]
    classes: dict[int, ClassEstimate]
    violations: int  # blocks whose flow constraint the estimates violated before repair
    repaired: bool
    notes: list[str] = field(default_factory=list)


def dependence_windows(infos: Sequence[InsnInfo]) -> list[int]:
    """For each instruction of a block, the index of the nearest earlier one it depends on (-1: none)."""
    last_writer: dict[str, int] = {}
    out = []
    for k, info in enumerate(infos):
        dep = -1
        for r in info.reads:
            if r in ("rip", "rsp") or r not in last_writer:
                continue
            dep = max(dep, last_writer[r])
        out.append(dep)
        for r in info.writes:
            last_writer[r] = k
    return out


def issue_point_ratios(samples: Sequence[float], ms: Sequence[float], deps: Sequence[int]) -> list[tuple[float, float]]:
    """(sum S, sum M) per issue point of one block, with the dependence-window refinement."""
    out = []
    for i, m in enumerate(ms):
        if m <= 0:
            continue
        j = deps[i] if i < len(deps) else -1
        if j >= 0 and j < i - 1:
            s = sum(samples[j + 1 : i + 1])
            mm = sum(ms[j + 1 : i + 1])
        else:
            s, mm = samples[i], m
        out.append((float(s), float(mm)))
    return out


def estimate_class(points: list[tuple[float, float]], class_samples: float,
                   all_insns: list[tuple[float, float]],
                   blocks: Sequence[tuple[Sequence[float], Sequence[float]]] = (),
                   estimator: str = "dcpi") -> ClassEstimate:
    """F for one class from its issue points' (S, M), all its instructions' (S, M), and its blocks' (S, M) arrays.

    Blocks that pass the shape test give F = sum S / sum M, in high confidence:
    measured on this machine, 96% of such blocks' samples were within 15%.
    Otherwise DCPI's issue-point clusters give an estimate; on an out-of-order
    core they underestimate stalled code (the static cycles they rely on are
    hidden under the stall), so it is low confidence.

    With ``estimator="geomean"`` that issue-point F is replaced by the
    geometric mean of itself and the class's sum S / sum M over all its
    instructions, an upper bound (stalls only add samples). Measured against
    callgrind on pointer-chasing code (SQLite's clang build) the issue-point
    rule is about 0.6 of the exact count and the geometric mean about 0.7,
    and sample profiles made with it gained more on three of five programs
    (the default of ``export llvm-sample`` and ``optimize``); on code with few
    stalls it moves estimates up (bzip2's median estimate/exact 1.13 -> 1.45),
    so calc's own reports keep DCPI's rule (docs/benchmarks.md).
    """
    if estimator not in ESTIMATORS:
        raise ValueError(f"unknown estimator {estimator!r} (one of {', '.join(ESTIMATORS)})")
    clean = [(sum(s), sum(m)) for s, m in blocks
             if sum(m) >= MIN_BLOCK_M and sum(1 for x in m if x > 0) >= MIN_BLOCK_POINTS
             and sum(s) >= MIN_BLOCK_SAMPLES and shape_excess(s, m) < SHAPE_EXCESS]
    if clean:
        cs, cm = sum(x for x, _ in clean), sum(y for _, y in clean)
        conf = "high" if cs >= 150 else "medium"
        return ClassEstimate(cs / cm, conf, "clean-blocks", len(clean), len(blocks), 1.0)
    est = _issue_point_estimate(points, class_samples, all_insns)
    if estimator == "geomean" and est.method == "issue-points" and est.value:
        total_s, total_m = sum(s for s, _ in all_insns), sum(m for _, m in all_insns)
        upper = total_s / total_m if total_m > 0 else est.value
        est.value = math.sqrt(est.value * max(upper, est.value))
    if est.method == "issue-points" and est.confidence == "high":
        est.confidence = "medium" if not blocks else "low"
    elif blocks and est.method == "issue-points":
        est.confidence = "low"
    return est


def _issue_point_estimate(points: list[tuple[float, float]], class_samples: float,
                          all_insns: list[tuple[float, float]]) -> ClassEstimate:
    """DCPI 6.1.3: a cluster of the smallest S/M ratios, with its rules against anomalies."""
    n = len(points)
    if n == 0:
        return ClassEstimate(None, "low", "none")
    if class_samples < FEW_SAMPLES:
        return _sum_ratio(points, class_samples, all_insns)
    ratios = sorted(((s / m if m else math.inf), s, m) for s, m in points)
    need = max(1, math.ceil(MIN_FRACTION * n))
    for start in range(n):
        r0 = ratios[start][0]
        cluster = [x for x in ratios[start:] if x[0] <= CLUSTER_SPREAD * r0 + 1e-12]
        if len(cluster) < need:
            continue
        cs = sum(x[1] for x in cluster)
        cm = sum(x[2] for x in cluster)
        f = cs / cm if cm else 0.0
        if f <= 0:
            continue
        if any(s / f - m > MAX_STALL for s, m in all_insns):
            continue  # F this small would mean a stall nothing can cause
        spread = cluster[-1][0] / cluster[0][0] if cluster[0][0] > 0 else math.inf
        conf = "high" if len(cluster) >= 3 and cs >= 200 and len(cluster) >= 0.4 * n else (
            "medium" if len(cluster) >= 2 or cs >= 100 else "low")
        return ClassEstimate(f, conf, "issue-points", len(cluster), n, spread)
    return _sum_ratio(points, class_samples, all_insns)


def _sum_ratio(points: list[tuple[float, float]], class_samples: float,
               all_insns: list[tuple[float, float]]) -> ClassEstimate:
    """DCPI's fallback: sum S / sum M over the issue points; where none of the class's samples fell on
    an issue point, over all its instructions. A class with samples ran, and an F of 0 is the skid's
    doing: the model (moved by the skid) often puts a short block's cycles on its closing jump, whose
    samples land in the next block (bzip2's mainGtU, a chain of 6-instruction blocks comparing a
    byte each: every issue point a `jne` without samples, the twelve blocks' 507 samples on the others,
    F = 0, and the repair set 12 of them at a thousandth of their exact counts)."""
    n = len(points)
    s = sum(s for s, _ in points)
    if s <= 0 < class_samples:
        all_m = sum(m for _, m in all_insns)
        return ClassEstimate(class_samples / all_m if all_m else None, "low", "sum-ratio", n, n)
    total_m = sum(m for _, m in points)
    return ClassEstimate(s / total_m if total_m else None, "low", "sum-ratio", n, n)


@dataclass(frozen=True)
class Measured:
    """A block's frequency measured by other means than the model (a loop counter)."""

    value: float  # F: executions per period
    confidence: str
    method: str  # one of MEASURED
    why: str = ""
    low_bias: bool = False  # known to run low (a short entry's anchor: its traps' disturbance)


def estimate_frequencies(cfg: CFG, classes: Classes, model: ProcedureModel, samples: Sequence[float] | np.ndarray,
                         infos: Sequence[InsnInfo] | None = None, repair: bool = True,
                         estimator: str = "dcpi", measured: dict[int, Measured] | None = None) -> Frequencies:
    """Block and edge frequencies for a procedure; ``samples`` is S_i per instruction of cfg.insns.

    ``measured``: blocks whose frequency was measured (loop counters); their class takes it,
    whatever the model says, and the repair moves them last.

    ``estimator`` chooses how classes without a clean block get F (estimate_class).

    A class that runs at most once per call (none of its blocks on a cycle) and whose instructions
    the model gives less than TINY_CLASS_M cycles gets no issue-point estimate: its flow is left to
    the equations. Such classes are mostly a `ret` or a load and a `ret` after a hard-to-predict
    branch; the branch's recovery lands on them and S_i / M_i over a few hundredths of a cycle is
    out by 10-100x (on SQLite's clang build 7 of 8 such classes were off by more than 3x, and one,
    in vdbeRecordCompareInt, put that function at 16% of the profile against 1.5% exact). On a
    loop the same estimates are often the only ones (gzip's longest_match), so loops keep them."""
    members = classes.members()
    estimates: dict[int, ClassEstimate] = {}
    cyclic = cyclic_blocks(cfg)
    by_class: dict[int, list[Measured]] = {}
    for b, m in (measured or {}).items():
        by_class.setdefault(classes.block[b], []).append(m)
    for c, (blocks, _edges) in members.items():
        if c in by_class:
            # The surest measurement of the class; between equally sure ones, a direct one before a
            # trip window's (a ratio to another measured block, whose class may be this one: an
            # entry and the exit block after its loop), then the largest.
            best = sorted(by_class[c], key=lambda m: (-SURETY.get(m.confidence, 0), m.method == "trip-window",
                                                      -m.value))[0]
            estimates[c] = ClassEstimate(best.value, best.confidence, best.method, 0, 0, 1.0)
            continue
        points: list[tuple[float, float]] = []
        all_insns: list[tuple[float, float]] = []
        per_block: list[tuple[list[float], list[float]]] = []
        class_samples = 0.0
        for b in blocks:
            blk = cfg.blocks[b]
            bm = model.blocks[b].insns
            s = [float(samples[k]) for k in range(blk.first, blk.last + 1)]
            ms = [im.m for im in bm]
            deps = dependence_windows(infos[blk.first : blk.last + 1]) if infos is not None else [-1] * len(s)
            points += issue_point_ratios(s, ms, deps)
            all_insns += list(zip(s, ms, strict=True))
            per_block.append((s, ms))
            class_samples += sum(s)
        est = estimate_class(points, class_samples, all_insns, per_block, estimator)
        if (est.method == "issue-points" and sum(m for _, m in all_insns) < TINY_CLASS_M
                and not any(b in cyclic for b in blocks)):
            est = ClassEstimate(None, "low", "too-few-cycles", 0, len(points))
        estimates[c] = est
    nb, ne = len(cfg.blocks), len(cfg.edges)
    block: list[float | None] = [None] * nb
    edge: list[float | None] = [None] * ne
    conf = ["low"] * nb
    method = ["none"] * nb
    for c, est in estimates.items():
        bs, es = members[c]
        if est.value is None:
            for b in bs:
                method[b] = est.method  # why there is none (propagation may still give one)
            continue
        for b in bs:
            block[b], conf[b], method[b] = est.value, est.confidence, est.method
        for e in es:
            edge[e] = est.value
    _propagate(cfg, classes, members, block, edge, conf, method)
    violations = _violations(cfg, block, edge)
    result = Frequencies(block, edge, conf, method, estimates, violations, False)
    floors = sample_floors(cfg, samples)
    below = any(block[b] is not None and block[b] < f * (1 - 1e-9) for b, f in floors.items())  # type: ignore[operator]
    # A block with samples enough for a floor and no estimate (the model gives its instructions no
    # cycles, so no issue point, and the flow alone does not decide a branch): the repair gives it
    # the flow that meets the others' estimates. difference.c's mix: its hottest block (781 of
    # 2,271 samples) had "no frequency estimate", and calc tallied 1,455 of the samples.
    unknown = any(block[b] is None for b in floors)
    if repair and (violations or below or unknown):
        _repair(cfg, classes, result, floors)
    for b in cfg.unreachable:
        result.block[b] = 0.0
    return result


def _propagate(cfg: CFG, classes: Classes, members: dict[int, tuple[list[int], list[int]]],
               block: list[float | None], edge: list[float | None], conf: list[str], method: list[str]) -> None:
    """Local propagation over the flow equations; new values go to the whole class."""
    live = [b for b in range(len(cfg.blocks)) if b not in cfg.unreachable]
    ins = {b: [e.id for e in cfg.in_edges(b)] for b in live}
    outs = {b: [e.id for e in cfg.out_edges(b)] for b in live}
    virt = set(classes.virtual_exits)

    def set_edge(e: int, v: float, src_conf: str) -> bool:
        if edge[e] is not None:
            return False
        v = max(0.0, v)
        c = classes.edge[e]
        if c >= 0:
            bs, es = members[c]
            for x in es:
                edge[x] = v
            for b in bs:
                if block[b] is None:
                    block[b], conf[b], method[b] = v, _down(src_conf), "propagated"
        else:
            edge[e] = v
        return True

    def set_block(b: int, v: float, src_conf: str) -> bool:
        if block[b] is not None:
            return False
        v = max(0.0, v)
        c = classes.block[b]
        bs, es = members.get(c, ([b], []))
        for x in bs:
            if block[x] is None:
                block[x], conf[x], method[x] = v, _down(src_conf), "propagated"
        for x in es:
            if edge[x] is None:
                edge[x] = v
        return True

    changed = True
    rounds = 0
    while changed and rounds < 4 * len(live) + 8:
        changed = False
        rounds += 1
        for b in live:
            for side in (ins[b], outs[b] if b not in virt else None):
                if side is None:
                    continue  # an infinite loop's virtual exit carries unknown flow: no equation on that side
                known = [edge[e] for e in side if edge[e] is not None]
                unknown = [e for e in side if edge[e] is None]
                fb = block[b]
                if fb is not None and len(unknown) == 1:
                    changed |= set_edge(unknown[0], fb - sum(known), conf[b])  # type: ignore[arg-type]
                elif fb is None and not unknown and side:
                    changed |= set_block(b, sum(known), "medium")  # type: ignore[arg-type]


def _down(c: str) -> str:
    return {"high": "medium", "medium": "low"}.get(c, "low")


def _violations(cfg: CFG, block: list[float | None], edge: list[float | None], tol: float = 0.10) -> int:
    bad = 0
    for b in range(len(cfg.blocks)):
        if b in cfg.unreachable or block[b] is None:
            continue
        fb = block[b]
        assert fb is not None
        for side in (cfg.in_edges(b), cfg.out_edges(b)):
            vals = [edge[e.id] for e in side]
            if side and all(v is not None for v in vals):
                s = sum(v for v in vals if v is not None)
                if abs(s - fb) > tol * max(fb, s, 1.0):
                    bad += 1
                    break
    return bad


def sample_floors(cfg: CFG, samples: Sequence[float] | np.ndarray) -> dict[int, float]:
    """The least F each block with samples can have: it ran, and an execution of it takes at most
    MAX_STALL cycles an instruction, so F >= its samples / (instructions x MAX_STALL), with the
    samples taken three standard deviations low (s - 3 sqrt(s): a block run a thousand times
    can take one sample of a million cycles; under 10 samples there is no floor). A weak bound (a
    stalled block runs tens of times more often), but it keeps the repair from routing a loop's
    flow around a block that holds thousands of samples: on bench/accuracy.py's ten programs 6% of
    the samples sat on blocks the repair had set to zero executions (zstd's DUBT loop: 2,800
    samples on one block, "~0 executions", 0.00 CPI)."""
    out: dict[int, float] = {}
    for blk in cfg.blocks:
        if blk.id in cfg.unreachable:
            continue
        s = float(np.sum(samples[blk.first : blk.last + 1]))
        low = s - 3.0 * s**0.5
        if low > 0:
            out[blk.id] = low / ((blk.last - blk.first + 1) * MAX_STALL)
    return out


def _repair(cfg: CFG, classes: Classes, fr: Frequencies, floors: dict[int, float] | None = None) -> None:
    """The circulation closest to the estimates: min sum w |x - estimate| (network simplex), with
    every block at or above its floor (sample_floors). A block the floor holds up is method "floor"
    (low confidence): its count is a lower bound, not an estimate.

    The cost is linear, so where estimates disagree with the flow the solution is a vertex: a
    branch whose arms' estimates both exceed what reaches it sent all of it down one arm and left
    the other at its floor, thousands of times below its exact count. A model's estimate (not a
    measured count) therefore costs twice as much per unit once the flow falls below 1/FAR_BELOW
    of it: a convex cost, which splits such a branch by the arms' estimates before starving one.
    Measured counts keep the linear cost: the model's estimates are off by up to 10 times where
    they stall, and a dearer pull let them move measured counts (a set of recordings whose xz count
    rested on moving arguments: 46.6% of the accuracy suite's samples within 15% -> 36.2% with 8
    times the pull far below). Over six kept sets of recordings (docs/benchmarks.md): samples off
    by over 10 times 4.8-9.1% -> 3.4-5.8%, within 2x +2.8 points, within 15% +0.4 (-2.5 to +2.1)."""
    import math

    import networkx as nx

    known = [v for v in fr.block + fr.edge if v is not None and v > 0]
    if not known:
        return
    # Network simplex works in integers: counts are scaled so that the smallest estimate keeps
    # three digits (and the largest six at least). Scaling the largest alone to 10^6 left an outer
    # loop of 1,500 passes around an inner loop of 10^8 iterations with one or two digits: the
    # repair moved its measured count by a unit, 10%, and it was no longer a measurement.
    scale = min(max(1_000_000 / max(known), 1_000 / min(known)), 10**13 / max(known))
    big = 10**16
    g = nx.DiGraph()
    arcs: dict[tuple[str, int], tuple[str, str]] = {}

    def node_in(b: int) -> str:
        return "ENTRY" if b == ENTRY else "EXIT" if b == EXIT else f"i{b}"

    def node_out(b: int) -> str:
        return "ENTRY" if b == ENTRY else "EXIT" if b == EXIT else f"o{b}"

    def add_measured(u: str, v: str, tag: str, est: float | None, w: int, model: bool = False) -> None:
        # Flow u -> mid -> v; with an estimate, the cost w * |x - est|: arcs rewarding flow up to
        # est and one charging beyond it. The flow is read back on u -> mid. A model's estimate
        # (``model``) rewards the first quarter of its flow twice as much (FAR_BELOW): see _repair.
        mid = f"{tag}m"
        g.add_edge(u, mid, capacity=big, weight=0)
        if est is None:
            g.add_edge(mid, v, capacity=big, weight=0)
            return
        e = max(0, round(est * scale))
        segments = [(e // FAR_BELOW, -2 * w), (e - e // FAR_BELOW, -w)] if model else [(e, -w)]
        for k, (cap, weight) in enumerate(segments):
            if cap > 0:
                g.add_edge(mid, f"{tag}r{k}", capacity=cap, weight=weight)
                g.add_edge(f"{tag}r{k}", v, capacity=big, weight=0)
        x = f"{tag}x"
        g.add_edge(mid, x, capacity=big, weight=w)
        g.add_edge(x, v, capacity=big, weight=0)

    lower: dict[int, int] = {}  # block -> its floor in scaled units (a lower bound on its arc)
    for b in range(len(cfg.blocks)):
        if b in cfg.unreachable:
            continue
        if fr.block_method[b] in MEASURED:
            w = MEASURED_WEIGHT.get(fr.block_confidence[b], 8)
        else:
            w = CONFIDENCE_WEIGHT.get(fr.block_confidence[b], 1) if fr.block_method[b] != "propagated" else 1
        add_measured(node_in(b), node_out(b), f"b{b}", fr.block[b], w, fr.block_method[b] not in MEASURED)
        arcs[("b", b)] = (node_in(b), f"b{b}m")
        if floors and floors.get(b, 0.0) > 0:
            lower[b] = math.ceil(floors[b] * scale)
    for e in cfg.edges:
        if (e.src >= 0 and e.src in cfg.unreachable) or (e.dst >= 0 and e.dst in cfg.unreachable):
            continue
        tag = f"e{e.id}"
        add_measured(node_out(e.src), node_in(e.dst), tag, None, 0)
        arcs[("e", e.id)] = (node_out(e.src), f"{tag}m")
    for b in classes.virtual_exits:
        g.add_edge(node_out(b), f"v{b}", capacity=big, weight=0)
        g.add_edge(f"v{b}", "EXIT", capacity=big, weight=0)
    g.add_edge("EXIT", "ENTRY", capacity=big, weight=0)
    # A lower bound l on the arc u -> mid: l of its flow is fixed, u receives it from the rest of
    # the network and mid sends it on (node demands), and the arc carries what is beyond it.
    for b, lo in lower.items():
        u, mid = arcs[("b", b)]
        g.nodes[u]["demand"] = g.nodes[u].get("demand", 0) + lo
        g.nodes[mid]["demand"] = g.nodes[mid].get("demand", 0) - lo
    flow = None
    while flow is None:
        try:
            _, flow = nx.network_simplex(g)
        except (nx.NetworkXUnfeasible, nx.NetworkXUnbounded, nx.NetworkXError) as err:
            if not lower:
                fr.notes.append(f"global repair failed: {err}")
                return
            # Floors the flow cannot meet (a block off every path to the exit): repair without them.
            for b in lower:
                u, mid = arcs[("b", b)]
                g.nodes[u]["demand"] = g.nodes[mid]["demand"] = 0
            lower = {}
    held = 0
    for (kind, i), (u, v) in arcs.items():
        x = (flow[u][v] + (lower.get(i, 0) if kind == "b" else 0)) / scale
        if kind == "b":
            old = fr.block[i]
            if i in lower and flow[u][v] <= max(1, lower[i] // 100):
                # Held up by its floor (the estimates would have it lower, or gave it nothing): a
                # lower bound, not an estimate.
                fr.block[i], fr.block_method[i], fr.block_confidence[i] = x, "floor", "low"
                held += 1
                continue
            # A measured count the repair moved by less than 10% still rests on its measurement.
            kept = fr.block_method[i] in MEASURED and old is not None and abs(old - x) <= 0.1 * max(old, x)
            if not kept and (old is None or abs(old - x) > 1e-9 * max(1.0, x)):
                fr.block_method[i] = "repaired" if old is not None else "propagated"
                if old is None or abs(old - x) > 0.1 * max(old, x):
                    fr.block_confidence[i] = _down(fr.block_confidence[i])
            fr.block[i] = x
        else:
            fr.edge[i] = x
    fr.repaired = True
    if held:
        fr.notes.append(f"{held} block(s) with samples only at their floor (samples / (instructions x "
                        f"{MAX_STALL:.0f} cycles)): the estimates left them no flow; their counts are lower bounds")
