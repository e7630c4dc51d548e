"""DCPI's dcpicalc pipeline for one procedure: disassemble -> CFG -> classes ->
static model -> frequencies -> CPI -> culprits. Each step is a pure function of
the previous steps' outputs (see the modules it calls); this module chains
them and carries the units.

Units. S_i are samples of the cycles event. With a cycles event, the mean
period P is in cycles. With cpu-clock it is in nanoseconds, converted with
the core clock measured while recording (collect/clock.py). F_b is
executions per period, so a block ran F_b * P times, and instruction i spent
S_i / F_b cycles per execution (its CPI).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from cyclescope.analysis.anchors import NEAR_BYTES, AnchorStats, near_samples
from cyclescope.analysis.cfg import CFG, ENTRY, Edge, build_cfg
from cyclescope.analysis.confidence import SURETY
from cyclescope.analysis.culprits import Stall, StaticStall, dynamic_culprits, static_stalls
from cyclescope.analysis.equivalence import Classes, cycle_equivalence
from cyclescope.analysis.frequency import MEASURED, Frequencies, Measured, estimate_frequencies
from cyclescope.analysis.loopcount import LoopStats, loop_executions
from cyclescope.analysis.loops import Loop
from cyclescope.analysis.paths import PathBlock
from cyclescope.analysis.progress import (
    HEAVY_TAIL,
    NARGS,
    ProgressStats,
    entries_from_progress,
    point_address,
    value_name,
)
from cyclescope.analysis.schedule import BlockModel, InsnModel, ProcedureModel, model_blocks, model_key
from cyclescope.analysis.skid import skidded
from cyclescope.analysis.trips import MIN_HITS, ScaleStats
from cyclescope.images.cache import Cache
from cyclescope.images.disasm import Insn, InsnInfo, insn_info


@dataclass
class Calc:
    name: str
    start: int
    end: int
    events: list[str]
    cycles_event: str
    period_cycles: float | None  # P in cycles (None: clock unknown for a time-based event)
    cfg: CFG
    classes: Classes
    model: ProcedureModel
    infos: list[InsnInfo]
    samples: np.ndarray  # (n_insns, n_events)
    freq: Frequencies
    cpi: list[float | None]  # per instruction: S_i / F_b
    dyn: list[float]  # dynamic stall cycles per execution: max(0, CPI - M_i)
    gain: list[float]  # negative stall: M_i - CPI where samples fall short of the model
    static: list[StaticStall]
    culprits: list[Stall | None]
    notes: list[str] = field(default_factory=list)
    evidence: dict[int, str] = field(default_factory=dict)  # block -> what its measured count rests on

    def executions(self, block: int) -> float | None:
        f = self.freq.block[block]
        if f is None or self.period_cycles is None:
            return None
        return f * self.period_cycles


def model_procedure(blocks: Sequence[Sequence[Insn]], cache: Cache | None, key: str | None,
                    mcpu: str | None = None) -> ProcedureModel:
    """llvm-mca's model of the blocks, cached per image and code."""
    import pyarrow as pa

    from cyclescope.analysis.schedule import host_mcpu

    mcpu = mcpu or host_mcpu()
    name = f"mca-{model_key(blocks, mcpu)}"
    if cache is not None and key is not None:
        t = cache.load(key, name)
        if t is not None:
            d = t.to_pydict()
            by_block: dict[int, list[InsnModel]] = {}
            for b, m, lat, wo, wr, report, own in zip(d["block"], d["m"], d["latency"], d["wait_operands"],
                                                    d["wait_resources"], d["replaced"], d["own"], strict=True):
                by_block.setdefault(b, []).append(InsnModel(m, lat, wo, wr, report, own))
            models = [BlockModel(by_block.get(b, []), sum(i.m for i in by_block.get(b, [])))
                      for b in range(len(blocks))]
            notes = (t.schema.metadata or {}).get(b"notes", b"").decode()
            return ProcedureModel(mcpu, models, [n for n in notes.split("\n") if n])
    pm = model_blocks(blocks, mcpu)
    if cache is not None and key is not None:
        rows = [(b, im) for b, bm in enumerate(pm.blocks) for im in bm.insns]
        t = pa.table({
            "block": [b for b, _ in rows], "m": [im.m for _, im in rows], "latency": [im.latency for _, im in rows],
            "wait_operands": [im.wait_operands for _, im in rows],
            "wait_resources": [im.wait_resources for _, im in rows], "replaced": [im.replaced for _, im in rows],
            "own": [im.own for _, im in rows],
        }).replace_schema_metadata({b"notes": "\n".join(pm.notes).encode()})
        cache.save(key, name, t)
    return pm


def calc_procedure(
    name: str,
    start: int,
    end: int,
    code: bytes,
    counts: dict[int, np.ndarray],
    events: list[str],
    cycles_event: str,
    period_cycles: float | None,
    name_at: Callable[[int], str | None] = lambda a: None,
    read: Callable[[int, int], bytes | None] = lambda a, n: None,
    cache: Cache | None = None,
    cache_key: str | None = None,
    mcpu: str | None = None,
    estimator: str = "dcpi",
    loop_stats: dict[int, LoopStats] | None = None,
    mean_period: float = 0.0,
    anchor: AnchorStats | None = None,
    outcomes: dict[int, dict[int, float]] | None = None,
    trips: dict[int, tuple[int, int, int]] | None = None,
    progress: dict[int, ProgressStats] | None = None,
    scale: dict[int, tuple[AnchorStats, ScaleStats]] | None = None,
) -> Calc:
    from cyclescope.images.disasm import disassemble

    insns = disassemble(code, start)
    infos = insn_info(code, start)
    if len(infos) != len(insns):  # capstone's detail and lite modes disagree: keep them aligned
        infos = (infos + [InsnInfo(frozenset(), frozenset(), False, False, frozenset(), "other")] * len(insns))[
            : len(insns)]
    cfg = build_cfg(insns, start, end, name_at, read, infos)
    classes = cycle_equivalence(cfg)
    blocks = [insns[b.first : b.last + 1] for b in cfg.blocks]
    raw = model_procedure(blocks, cache, cache_key, mcpu)
    # Samples land after the instruction the model says retirement waits on (skid.py): compare
    # them with the model moved by the skid. Block totals (best-case cycles) stay the model's.
    model_blocks_skid = []
    for b in cfg.blocks:
        bm = raw.blocks[b.id]
        wraps = any(cfg.edges[e].src == b.id for e in b.preds)
        moved = skidded([im.m for im in bm.insns], insns[b.first : b.last + 1], infos[b.first : b.last + 1], wraps)
        model_blocks_skid.append(BlockModel(
            [InsnModel(m, im.latency, im.wait_operands, im.wait_resources, im.replaced, im.own)
             for m, im in zip(moved, bm.insns, strict=True)],
            bm.cycles))
    model = ProcedureModel(raw.mcpu, model_blocks_skid, raw.notes)
    ev = events.index(cycles_event)
    starts = np.array([i.address for i in insns], np.uint64)
    samples = np.zeros((len(insns), len(events)), np.float64)
    for off, c in counts.items():
        if not start <= off < end or not len(insns):
            continue
        k = int(np.searchsorted(starts, np.uint64(off), side="right")) - 1
        if k >= 0:
            samples[k] += c
    s_cyc = samples[:, ev]
    loops = _loops(cfg, infos) if loop_stats or outcomes or trips else []
    measured, mnotes = _measured(cfg, loops, s_cyc, loop_stats or {}, mean_period, period_cycles)
    if anchor is not None:
        mnotes += _anchored(cfg, s_cyc, anchor, period_cycles, measured)
    if scale:
        mnotes += _scaled(cfg, s_cyc, scale, period_cycles, measured, anchor)
    if progress:
        mnotes += _progressed(cfg, progress, period_cycles, measured, infos, loops)
    freq = estimate_frequencies(cfg, classes, model, s_cyc, infos, estimator=estimator, measured=measured)
    if trips:  # loop headers from their exact ratios to a measured point counted in the same windows
        by_ratio, rnotes = _by_ratios(cfg, trips, measured, freq)
        done = tuple(f"loop at {cfg.blocks[b].start:#x}:" for b in by_ratio)
        mnotes = [n for n in mnotes if not n.startswith(done)] + rnotes
        if by_ratio:
            measured = {**measured, **by_ratio}
            freq = estimate_frequencies(cfg, classes, model, s_cyc, infos, estimator=estimator, measured=measured)
    by_trips = _by_trips(cfg, loops, loop_stats or {}, freq, measured, s_cyc)
    if by_trips:  # inner loops: their entries (from the first pass) times their mean trip count
        measured = {**measured, **by_trips}
        freq = estimate_frequencies(cfg, classes, model, s_cyc, infos, estimator=estimator, measured=measured)
    if outcomes:  # the shape of the counts from sampled branch outcomes, scaled by the best evidence
        by_paths, pnotes = _paths(cfg, classes, freq, measured, s_cyc, _forward(cfg, loops, outcomes))
        mnotes += pnotes
        if by_paths:
            measured = {**by_paths, **measured}
            freq = estimate_frequencies(cfg, classes, model, s_cyc, infos, estimator=estimator, measured=measured)
    ms: list[float] = [im.m for b in cfg.blocks for im in model.blocks[b.id].insns]
    cpi: list[float | None] = []
    dyn: list[float] = []
    gain: list[float] = []
    for k in range(len(insns)):
        f = freq.block[cfg.block_of[k]]
        if f is None or f <= 0:
            cpi.append(None)
            dyn.append(0.0)
            gain.append(0.0)
            continue
        ck = float(s_cyc[k]) / f
        cpi.append(ck)
        dyn.append(max(0.0, ck - ms[k]))
        gain.append(max(0.0, ms[k] - ck))
    statics = static_stalls(cfg, raw, infos)
    event_cols = {e: samples[:, i] for i, e in enumerate(events) if e != cycles_event}
    culprits = dynamic_culprits(cfg, infos, dyn, freq.block, freq.edge, event_cols,
                                steady=_steady_branches(cfg, loops, freq, loop_stats or {}))
    notes = list(cfg.notes) + list(model.notes) + mnotes + list(freq.notes)
    if period_cycles is None:
        notes.append("the core clock was not measured while recording: CPI and frequencies are relative only")
    evidence = {b: m.why for b, m in measured.items() if m.why and freq.block_method[b] == m.method}
    return Calc(name, start, end, events, cycles_event, period_cycles, cfg, classes, model, infos, samples, freq,
                cpi, dyn, gain, statics, culprits, notes, evidence)


def _loops(cfg: CFG, infos: Sequence[InsnInfo]) -> list[Loop]:
    from cyclescope.analysis.loops import find_loops

    return find_loops(cfg, infos)


def _steady_branches(cfg: CFG, loops: list[Loop], freq: Frequencies,
                     stats: dict[int, LoopStats]) -> dict[int, frozenset[int]]:
    """The branches going back to measured loop headers whose loops run many iterations an entry,
    each with its loop's blocks: a loop counted from pairs of samples runs for periods at a time,
    one counted from trips (in registers, or its header's runs in trip windows against its entries)
    says how long it runs."""
    from cyclescope.analysis.culprits import STEADY_TRIPS

    out: dict[int, frozenset[int]] = {}
    block_at = {b.start: b.id for b in cfg.blocks}
    for lp in loops:
        h = block_at.get(lp.header)
        st = stats.get(lp.header)
        if h is None:
            continue
        method = freq.block_method[h]
        if method == "trip-window":  # counted exactly: its runs per entry from the flow
            entries = sum(freq.edge[e.id] or 0.0 for e in cfg.in_edges(h) if e.src < 0 or e.src not in lp.blocks)
            trips = (freq.block[h] or 0.0) / entries if entries > 0 else 0.0
        elif st is not None and method == "loop-counter":
            trips = float("inf")
        elif st is not None and method == "loop-trips":
            trips = st.mean_trip or 0.0
        else:
            continue
        if trips < STEADY_TRIPS:
            continue
        for e in cfg.in_edges(h):
            if e.src >= 0 and e.src in lp.blocks:
                a = cfg.insns[cfg.blocks[e.src].last].address
                out[a] = out.get(a, frozenset()) | frozenset(lp.blocks)
    return out


def _entry_flow(cfg: CFG, e: Edge, freq: Frequencies, s_cyc: np.ndarray) -> float | None:
    """The flow on edge ``e`` into a loop: the first pass's, or, where it left the edge open, its
    source's frequency less its other known out-edges when those other ways out were never sampled
    (the usual guard before a loop: a test of an empty range whose other side never runs)."""
    if freq.edge[e.id] is not None:
        return freq.edge[e.id]
    if e.src < 0 or freq.block[e.src] is None:
        return None
    rest = 0.0
    for o in cfg.out_edges(e.src):
        if o.id == e.id:
            continue
        if freq.edge[o.id] is not None:
            rest += freq.edge[o.id] or 0.0
        elif o.dst >= 0 and float(s_cyc[cfg.blocks[o.dst].first : cfg.blocks[o.dst].last + 1].sum()) > 0:
            return None  # the other way out ran: the split is unknown
    return max(0.0, (freq.block[e.src] or 0.0) - rest)


def _by_trips(cfg: CFG, loops: list[Loop], stats: dict[int, LoopStats], freq: Frequencies,
              measured: dict[int, Measured], s_cyc: np.ndarray) -> dict[int, Measured]:
    """Headers of loops whose samples gave their executions' trip counts (their counter's start and
    end in registers) and whose pairs gave no count: the header runs (entries) x (mean trip) times,
    the entries being the flow into the header from outside the loop as the first pass put it."""
    out: dict[int, Measured] = {}
    block_at = {b.start: b.id for b in cfg.blocks}
    for lp in loops:
        st = stats.get(lp.header)
        h = block_at.get(lp.header)
        if st is None or h is None or h in measured or st.mean_trip is None:
            continue
        entries = [e for e in cfg.in_edges(h) if e.src < 0 or e.src not in lp.blocks]
        flows = [_entry_flow(cfg, e, freq, s_cyc) for e in entries]
        if not entries or any(f is None for f in flows):
            continue
        # The entries must rest on something: a measured count (an outer loop's) or a high-confidence
        # one. A model's guess at a loop's entry times its trip count is no better than the model.
        srcs = [e.src for e in entries if e.src >= 0]
        if not srcs or not all(freq.block_confidence[b] == "high" or freq.block_method[b] in MEASURED
                               for b in srcs):
            continue
        f = sum(x for x in flows if x is not None) * st.mean_trip
        if f <= 0:
            continue
        conf = "high" if st.trip_samples >= 100 else "medium"
        out[h] = Measured(f, conf, "loop-trips", f"{st.mean_trip:,.1f} header runs per entry from "
                                                 f"{st.trip_samples:,} samples' registers")
    return out


_RANK = SURETY
_BY_RANK = {v: k for k, v in _RANK.items()}


def _by_ratios(cfg: CFG, trips: dict[int, tuple[int, int, int]], measured: dict[int, Measured],
               freq: Frequencies) -> tuple[dict[int, Measured], list[str]]:
    """Blocks whose first instruction the trip windows counted (analysis/trips.py: the procedure's
    entry, loop headers and hot blocks, all counted together in each window; ``trips``: point ->
    hits, windows, the entry's hits in them): each gets the count of the best counted block with a
    measured count (an anchor, a loop counter; else a high-confidence one) times the exact ratio
    of their runs per entry in the windows that counted each (a block near the share that makes it
    a point may be one in some runs and not in others). The ratio's error goes as 1/sqrt of the
    rarer point's hits (the trials: a loop's entries, each running some trips): MIN_HITS to be
    used, MEDIUM_HITS and HIGH_HITS for medium and high confidence (about 10% and 3% where the trips
    vary as much as their mean), with MEDIUM_WINDOWS and HIGH_WINDOWS windows (a ratio changes with
    a program's phases, and one window sees one); the result is no surer than the count it scales.
    Blocks already measured as surely keep their count; trip counts from registers come after
    (_by_trips) and leave the blocks counted here alone: their estimator is biased, the ratio is
    not."""
    from cyclescope.analysis.trips import HIGH_HITS, HIGH_WINDOWS, MEDIUM_HITS, MEDIUM_WINDOWS, MIN_HITS

    block_at = {b.start: b.id for b in cfg.blocks}
    entry = _entry_block(cfg)
    own = trips.get(cfg.blocks[entry].start) if entry is not None else None  # the entry's hits (older tallies)
    pts: dict[int, tuple[int, int, float]] = {}  # block -> hits, windows, runs per entry
    for a, (h, w, eh) in trips.items():
        if a in block_at:
            per = h / eh if eh > 0 else h / own[0] if own is not None and own[0] > 0 else float(h)
            pts[block_at[a]] = (h, w, per)
    windows = max((w for _, w, _ in trips.values()), default=0)
    refs = []
    for b, (h, _w, _per) in pts.items():
        if h < MIN_HITS:
            continue
        m = measured.get(b)
        if m is not None:
            refs.append((_RANK[m.confidence], 1, h, b, m.value, m.confidence, m.method))
        elif freq.block[b] is not None and freq.block_confidence[b] == "high" and (freq.block[b] or 0.0) > 0:
            refs.append((2, 0, h, b, float(freq.block[b] or 0.0), "high", freq.block_method[b]))
    if not refs:
        if pts:
            return {}, [f"trip windows counted {len(pts)} points ({windows:,} windows) but none of them has a "
                        "measured count to scale the ratios by; their counts are the model's"]
        return {}, []
    rank, _, h0, b0, f0, conf0, how = max(refs)
    _, w0, per0 = pts[b0]
    out: dict[int, Measured] = {}
    for b, (h, w, per) in pts.items():
        if b == b0 or h <= 0 or per0 <= 0:
            continue
        n = min(h, h0)
        if n < MIN_HITS:
            continue
        both = min(w, w0)
        surety = (2 if n >= HIGH_HITS and both >= HIGH_WINDOWS else
                  1 if n >= MEDIUM_HITS and both >= MEDIUM_WINDOWS else 0)
        r = min(rank, surety)
        m = measured.get(b)
        if m is not None and _RANK[m.confidence] >= r:
            continue
        out[b] = Measured(f0 * per / per0, _BY_RANK[r], "trip-window",
                          f"{per / per0:,.4g} runs per run of {cfg.blocks[b0].start:#x} ({h:,} against {h0:,}, counted "
                          f"beside the entry in {w:,} and {w0:,} windows), whose count is {how} ({conf0} confidence)")
    return out, []


def _measured(cfg: CFG, loops: list[Loop], s_cyc: np.ndarray, stats: dict[int, LoopStats],
              mean_period: float, period_cycles: float | None) -> tuple[dict[int, Measured], list[str]]:
    """Header frequencies the loop counters measured (F = executions / P), and notes on loops with
    counts that could not be used."""
    if not stats or not period_cycles:
        return {}, []
    out: dict[int, Measured] = {}
    notes: list[str] = []
    block_at = {b.start: b.id for b in cfg.blocks}
    for lp in loops:
        st = stats.get(lp.header)
        if st is None or lp.header not in block_at:
            continue
        loop_samples = float(sum(s_cyc[k] for b in lp.blocks for k in range(cfg.blocks[b].first,
                                                                             cfg.blocks[b].last + 1)))
        est = loop_executions(st, loop_samples, mean_period, lp.calls)
        if est is None:
            if st.next_own >= 20 and st.same < 0.5 and st.mean_trip is None:
                notes.append(f"loop at {lp.header:#x}: executions mostly shorter than a sampling period "
                             f"({100 * st.same:.0f}% of pairs in one); its count is the model's")
            continue
        out[block_at[lp.header]] = Measured(est.executions / period_cycles, est.confidence, "loop-counter", est.why)
    return out, notes


def _forward(cfg: CFG, loops: list[Loop], outcomes: dict[int, dict[int, float]]) -> dict[int, dict[int, float]]:
    """The outcomes of the branches that neither close nor leave a loop: a loop's count goes as
    1/(1-p) of its back branch's probability, so that a few percent of bias in p (measured: 0.80 to
    0.88 observed against 0.94 exact, ZSTD's match loop, with the memory of the stopped thread)
    make it wrong by half; those branches keep calc's split, which the loop counters and trip
    counts measure."""
    block_at = {b.start: b.id for b in cfg.blocks}
    loop_edges: set[tuple[int, int]] = set()
    for lp in loops:
        h = block_at.get(lp.header)
        for b in lp.blocks:
            for e in cfg.out_edges(b):
                if e.dst == h or e.dst < 0 or e.dst not in lp.blocks:
                    loop_edges.add((b, e.dst))
    skip = {cfg.insns[cfg.blocks[b].last].address for b, _ in loop_edges}
    return {a: o for a, o in outcomes.items() if a not in skip}


def path_blocks(cfg: CFG, freq: Frequencies) -> list[PathBlock]:
    """The procedure's blocks as the paths' flow equations take them (analysis/paths.py): their
    instructions' addresses, their successors (-1 out of the procedure) and calc's count of each
    of those edges."""
    return [PathBlock([cfg.insns[i].address for i in range(b.first, b.last + 1)],
                      [cfg.edges[e].dst if cfg.edges[e].dst >= 0 else -1 for e in b.succs],
                      [freq.edge[e] for e in b.succs]) for b in cfg.blocks]


MIN_PATH_BRANCHES = 1  # observed branches a procedure needs before its counts are shaped by them


def _paths(cfg: CFG, classes: Classes, freq: Frequencies, measured: dict[int, Measured], s_cyc: np.ndarray,
           outcomes: dict[int, dict[int, float]]) -> tuple[dict[int, Measured], list[str]]:
    """Block frequencies from the branch probabilities of sampled paths (analysis/paths.py: the
    flow equations per entry), scaled to the procedure's measured counts, and added as estimates
    of method ``paths`` to every class the measurements and the model's clean blocks leave open.

    The scale is one number for the procedure: the sample-weighted median of measured / shaped
    over the blocks with a measured count (anchor, loop counter, trip count); else over the
    blocks in high confidence (the model's clean blocks); else calc's own total over the
    instructions the paths reach, the model's scale. Classes measured or clean keep their
    estimates and the repair reconciles the rest with them.

    Low confidence, whatever the scale: on bench/accuracy.py's ten programs the counts that rest on
    paths were closer to the exact ones than the model's repair had put them (gzip: 3% of samples
    within 15% -> 66-71%), but 8% of their samples were within 15% (docs/benchmarks.md). Sampled
    outcomes are biased, not only noisy: a branch is seen when a sample lands before it, and the
    time before it differs with the way it goes (ZSTD's `DUBT` loop: a branch taken 22% of the
    time by callgrind's count was seen taken 8% of the time in 1,131 outcomes, even from the
    stopped thread's exact memory and counting only the sample's own block)."""
    from cyclescope.analysis.paths import block_frequencies

    blocks = path_blocks(cfg, freq)
    seen = sum(1 for b in blocks if b.addresses and len(b.succs) > 1 and b.addresses[-1] in outcomes)
    if seen < MIN_PATH_BRANCHES:
        return {}, []
    if [e.dst for e in cfg.out_edges(ENTRY)] != [0]:
        return {}, []  # the flow equations count per entry of block 0
    n_insns = np.array([b.last - b.first + 1 for b in cfg.blocks], float)
    calc_f = np.array([freq.block[b] or 0.0 for b in range(len(cfg.blocks))])
    f = block_frequencies(blocks, outcomes, weights=(calc_f * n_insns).tolist())
    if f is None:
        return {}, [f"{seen} branches observed on sampled paths, but their probabilities leave the flow no way "
                    "out of a loop calc counts as hot: counts kept the model's"]
    bsamp = np.array([float(s_cyc[b.first : b.last + 1].sum()) for b in cfg.blocks])

    def median_ratio(idx: list[int], values: list[float]) -> float | None:
        pairs = sorted((v / f[i], bsamp[i] + 1.0) for i, v in zip(idx, values, strict=True) if f[i] > 0 and v > 0)
        if not pairs:
            return None
        half, acc = sum(w for _, w in pairs) / 2, 0.0
        for r, w in pairs:
            acc += w
            if acc >= half:
                return float(r)
        return float(pairs[-1][0])

    meas = [b for b, m in measured.items() if m.confidence != "low"]
    high = [b for b in range(len(cfg.blocks)) if freq.block_confidence[b] == "high" and freq.block[b]
            and freq.block_method[b] not in MEASURED]
    k, why = median_ratio(meas, [measured[b].value for b in meas]), "measured counts"
    if k is None:
        k, why = median_ratio(high, [freq.block[b] or 0.0 for b in high]), "the model's clean blocks"
    if k is None:
        reached = f > 0
        shaped = float((f * n_insns)[reached].sum())
        k = float((calc_f * n_insns)[reached].sum()) / shaped if shaped > 0 else None
        why = "the model's total"
    if not k:
        return {}, []
    k = float(k)
    keep = {classes.block[b] for b in meas} | {classes.block[b] for b in high}
    out: dict[int, Measured] = {}
    for b in range(len(cfg.blocks)):
        if classes.block[b] in keep or b in cfg.unreachable:
            continue
        if f[b] <= 0 and calc_f[b] > 0:
            continue  # no observed path reaches it, yet its samples say it ran: calc's count stays
        out[b] = Measured(float(f[b]) * k, "low", "paths", f"{seen} branches' outcomes, scaled by {why}")
    return out, []


def _entry_block(cfg: CFG) -> int | None:
    """The block the procedure's entry leads to (None: no blocks)."""
    return next((e.dst for e in cfg.out_edges(ENTRY) if e.dst >= 0), None) if cfg.blocks else None


def _heads_loop(cfg: CFG, block: int) -> bool:
    """Is ``block`` entered from inside the procedure too (an entry count does not give its count)?"""
    return any(e.src >= 0 for e in cfg.in_edges(block))


def _progressed(cfg: CFG, progress: dict[int, ProgressStats], period_cycles: float | None,
                measured: dict[int, Measured], infos: Sequence[InsnInfo] = (), loops: Sequence[Loop] = ()) -> list[str]:
    """The entry block's frequency from an argument that moves forward through the run
    (analysis/progress.py), added to ``measured`` where it is surer than what is there (an anchor
    of a short entry is low confidence: its traps' disturbance makes it low). Notes where it
    cannot be used."""
    entry = _entry_block(cfg)
    if not period_cycles or entry is None:
        return []
    point = None
    if infos and any(a >= NARGS for a in progress):  # named by where it is read
        point = point_address(cfg, infos, [lp.addresses for lp in (loops or _loops(cfg, infos))])
    est, why_not = entries_from_progress(progress, point)
    if est is None:
        return [why_not] if why_not else []
    if _heads_loop(cfg, entry):
        return [f"entry at {cfg.blocks[entry].start:#x} heads a loop: its count from a moving argument "
                f"({est.entries:,.0f} entries) does not give the block's"]
    m = measured.get(entry)
    # A count from the windows' local rates is unbiased where the windows are few; a short entry's
    # anchor runs low (bench/stridetime.py, docs/benchmarks.md): at equal confidence the local rates'.
    fairer = est.local and m is not None and m.low_bias and _RANK[m.confidence] == _RANK[est.confidence]
    if m is not None and _RANK[m.confidence] >= _RANK[est.confidence] and not fairer:
        # Kept, but the other count is said: where both are low (a short entry's anchor runs low, a
        # stride from a few windows high), the exact count was between them on the benchmark.
        return [f"entry count from moving arguments: {value_name(est.arg, point)} gives {est.entries:,.0f} entries "
                f"({est.confidence} confidence); the {m.method}'s {m.value * period_cycles:,.0f} "
                f"({m.confidence} confidence) is kept"
                + (f" ({HEAVY_TAIL})" if est.confidence == "low" and not est.local else "")]
    measured[entry] = Measured(est.entries / period_cycles, est.confidence, "progress", est.why)
    return []


SCALE_OVER_ENTRY = 10.0  # _scaled: a point's cycles a run over an entry's that make its count the surer of two lows
MIN_ANCHOR_HITS = 10  # entries counted in windows before an anchor is used (Poisson error ~ 1/sqrt)
MIN_ANCHOR_SAMPLES = 30  # the procedure's samples in those windows (the ratio's other side)
# The procedure's cycles per entry inside the windows below which an anchor's count is low confidence: each
# trap adds time of its own to the procedure's user time (the instruction run out of line, caches
# and predictors disturbed): 0.16-0.93 us a hit (500-2,800 cycles) over the suite's anchored entries
# (bench/anchorbias.py), so that entries of about 3 us were counted at 0.6-0.75 of the exact count in
# the suite's short runs, and at 0.77-1.07 (xz) and 0.78-0.91 (zstd) in runs of seconds, whose windows
# hold hundreds of samples (bench/anchorlong.py). From 30,000 cycles (10 us at 3 GHz) on, that bias
# stays under 10%. Below, the count is still used (the model's were 1.2-37 times exact on the same
# entries) but not corrected: the bias depends on the procedure.
MIN_ANCHOR_ENTRY_CYCLES = 30_000


def _point_count(cfg: CFG, s_cyc: np.ndarray, a: AnchorStats, at: int,
                 period_cycles: float) -> tuple[float, str, float] | None:
    """An anchor's count of the instruction at ``at`` over the profile (hits per window sample of
    the procedure, times its samples, both without the samples in the probe's first NEAR_BYTES),
    its confidence and the procedure's cycles per hit in the windows; None when the windows saw too
    little."""
    total = float(s_cyc.sum())
    near = near_samples([ins.address for ins in cfg.insns], s_cyc, at)
    n = a.entries(total, near)
    seen = a.samples - a.near
    if n is None or a.hits < MIN_ANCHOR_HITS or seen < MIN_ANCHOR_SAMPLES:
        return None
    per_hit = seen * period_cycles / a.hits
    conf = "high" if a.hits >= 100 and seen >= 200 else "medium"
    return n, "low" if per_hit < MIN_ANCHOR_ENTRY_CYCLES else conf, per_hit


def _scaled(cfg: CFG, s_cyc: np.ndarray, scale: dict[int, tuple[AnchorStats, ScaleStats]],
            period_cycles: float | None, measured: dict[int, Measured], anchor: AnchorStats | None = None) -> list[str]:
    """The entry's count from a scale point (analysis/trips.py, "Scale windows"): where the entry is
    too short for its own anchor, a few rare blocks counted as one point are counted in windows of
    their own (their traps barely disturb the procedure's time) against the procedure's samples,
    and windows of the entry and the point alone give their exact ratio, so the entry runs (the
    point's count) x (entry hits / point hits) times. ``scale``: the point's key (its first site)
    -> (its anchor's tally, the scale windows' tally). The ratio's confidence goes by its hits,
    windows and how far the windows agree (trips.ScaleStats.confidence), the count's by its
    windows' hits and samples as an anchor's. Rare blocks run in bursts, so that on runs of
    seconds, with a few windows of each kind, both sides are noisy (lzip's match finder: 0.13-1.85
    of its exact count over four sets of three runs, before the windows' spread was kept): the
    count replaces the entry's own anchor where it is surer, or as sure (low) where a run of the
    point took SCALE_OVER_ENTRY times an entry's cycles in their windows (lzip's match finder in
    runs of 25 s: the point's 29,456 against the entry's about 1,000; 0.93 of exact, where its own
    anchor gave 0.48: docs/benchmarks.md, "Scale points")."""
    entry = _entry_block(cfg)
    if not period_cycles or entry is None:
        return []
    starts = np.array([ins.address for ins in cfg.insns], np.uint64)
    notes: list[str] = []
    best: tuple[int, int, float, str, float, str] | None = None
    for at, (a, st) in sorted(scale.items()):
        hits, entry_hits, windows = st.hits, st.entry_hits, st.windows
        k = int(np.searchsorted(starts, np.uint64(at), side="right")) - 1
        if k < 0 or int(starts[k]) != at:
            continue
        got = _point_count(cfg, s_cyc, a, at, period_cycles)
        if got is None:
            notes.append(f"scale point at {at:#x}: too little seen in its anchor's windows ({a.hits:,} hits against "
                         f"{a.samples - a.near:,} samples)")
            continue
        n, conf, per_hit = got
        why = (f"{a.hits:,} runs of the scale point at {at:#x} counted exactly in {a.windows:,} windows against "
               f"{a.samples - a.near:,} of the procedure's samples (about {per_hit:,.0f} of its cycles a run)")
        rconf = st.confidence
        if rconf is None or entry_hits <= 0:
            err = st.ratio_error
            why_not = ("too few for the ratio" if hits < MIN_HITS else
                       "whose spread is not known (one window, or a tally older than it)" if err is None else
                       f"which disagree (the ratio's error {100 * err:.0f}%)")
            notes.append(f"scale point at {at:#x}: {hits:,} runs beside {entry_hits:,} entries in {windows:,} scale "
                         f"windows, {why_not}")
            continue
        c = min(conf, rconf, key=lambda x: _RANK[x])
        rank = (_RANK[c], hits)
        if best is None or rank > (_RANK[best[3]], best[1]):
            best = (at, hits, n * entry_hits / hits, c, per_hit,
                    f"{entry_hits / hits:,.4g} entries per run of {at:#x} ({entry_hits:,} against {hits:,} in "
                    f"{windows:,} windows of the two alone), whose count is {n:,.0f}: {why}")
    if best is None:
        return notes
    if _heads_loop(cfg, entry):
        return [*notes, f"entry at {cfg.blocks[entry].start:#x} heads a loop: its count from a scale point "
                        "does not give the block's"]
    m = measured.get(entry)
    # Over an anchor of the entry as sure: where the point's runs are SCALE_OVER_ENTRY times longer
    # than the entry's in its windows (the traps' disturbance, which makes a short entry's count low,
    # goes as one over that time).
    got = _point_count(cfg, s_cyc, anchor, cfg.blocks[entry].start, period_cycles) if anchor is not None else None
    own = got[2] if got is not None and m is not None and m.method == "anchor" else None
    if m is None or _RANK[m.confidence] < _RANK[best[3]] or (
            _RANK[m.confidence] == _RANK[best[3]] and own is not None and best[4] >= SCALE_OVER_ENTRY * own):
        measured[entry] = Measured(best[2] / period_cycles, best[3], "anchor", best[5])
    elif best[3] == "low":
        notes.append(f"scale point at {best[0]:#x}: {best[1]:,} runs beside the entries, in low confidence; the "
                     "entry's own count stands")
    return notes


def _anchored(cfg: CFG, s_cyc: np.ndarray, a: AnchorStats, period_cycles: float | None,
              measured: dict[int, Measured]) -> list[str]:
    """The entry block's frequency from the procedure's exact entry count (analysis/anchors.py),
    added to ``measured`` where it can be: the entry block is entered only from outside (not a loop
    header) and the windows saw enough entries and samples. Notes where it cannot."""
    entry = _entry_block(cfg)
    if not period_cycles or entry is None or entry in measured:
        return []
    if _heads_loop(cfg, entry):
        return [f"entry at {cfg.blocks[entry].start:#x} heads a loop: its exact count ({a.hits:,} entries in "
                f"{a.windows:,} windows) does not give the block's"]
    total = float(s_cyc.sum())
    near = near_samples([ins.address for ins in cfg.insns], s_cyc, cfg.blocks[entry].start)
    seen = a.samples - a.near
    got = _point_count(cfg, s_cyc, a, cfg.blocks[entry].start, period_cycles)
    if got is None:
        return [f"entry count: too little seen in the anchor's windows ({a.hits:,} entries against "
                f"{seen:,} samples); the entry's count is the model's"]
    n, conf, per_entry = got
    why = (f"{a.hits:,} entries counted exactly in {a.windows:,} windows against {seen:,} of the "
           f"procedure's {total - near if a.near else total:,.0f} samples"
           + (f" (leaving out the {a.near:,} in the windows at the entry's first {NEAR_BYTES} bytes, where "
              "traps return)" if a.near else ""))
    if per_entry < MIN_ANCHOR_ENTRY_CYCLES:
        # Still closer than the model on the suite (0.6-0.75 of exact, the model 1.5-19 times), but
        # low by an amount that depends on the procedure: low confidence, said why.
        conf = "low"
        why += (f"; an entry took about {per_entry:,.0f} cycles in the windows, so short that the traps' "
                f"disturbance makes the count low (by 10-40% on the benchmark's entries of a few us)")
    measured[entry] = Measured(n / period_cycles, conf, "anchor", why, low_bias=per_entry < MIN_ANCHOR_ENTRY_CYCLES)
    return []
