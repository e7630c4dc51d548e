"""calc over a profile: per-instruction execution counts, CPI and stall culprits of a procedure."""

from __future__ import annotations

from typing import TYPE_CHECKING

from cyclescope.analysis.estimators import ESTIMATORS as ESTIMATORS  # for the command lines' options
from cyclescope.errors import NotFoundError

if TYPE_CHECKING:
    from cyclescope.analysis.calc import Calc
    from cyclescope.app.profile import Profile
    from cyclescope.report.listing import Target

ESTIMATOR_HELP = ("how calc sets a stalled class's execution count: dcpi, the cluster of the smallest "
                  "sample/model-cycle ratios (DCPI's rule), or geomean, the geometric mean of that and the "
                  "class's sum-of-samples ratio, its upper bound (higher on pointer-chasing code, where DCPI's "
                  "rule underestimates; see docs/benchmarks.md)")
# For sample profiles (export llvm-sample, optimize): across bzip2, gzip, xz, Lua and SQLite, three
# recordings each, the geometric mean's profiles reached more of instrumented PGO's gain on three
# and never lost much (docs/benchmarks.md). calc's own reports use it too: with loop counters taking
# the stall-free loops DCPI's rule got right, the geometric mean's counts were closer to exact ones
# on ten programs (35.8% of samples within 15% against 28.4%; bench/accuracy.py).
CALC_ESTIMATOR = "geomean"
PROFILE_ESTIMATOR = "geomean"


def cycles_event(p: Profile, wanted: str | None) -> str:
    """The event whose samples calc reads as cycles: ``wanted``, else cycles or a clock, else the first."""
    profile_set = p.profile_set
    evs = profile_set.event_names
    if wanted:
        if wanted not in evs:
            raise NotFoundError(f"no samples of {wanted}; recorded: {', '.join(evs)}")
        return wanted
    for pref in ("cycles", "cycles:u", "cpu-clock", "task-clock"):
        if pref in evs:
            return pref
    if not evs:
        raise NotFoundError("no samples in the selection")
    return evs[0]


def period_cycles(p: Profile, ev: str) -> float | None:
    """P in cycles. For a clock event: (mean period - what a sample cost) * measured clock."""
    profile_set = p.profile_set
    meta = profile_set.events[ev]
    if not meta.time_based:
        return meta.mean_period
    if not profile_set.clock_ghz:
        return None
    return max(1.0, meta.mean_period - meta.overhead_ns) * profile_set.clock_ghz


def calc_target(p: Profile, target: Target, event: str, mcpu: str | None = None,
                estimator: str = CALC_ESTIMATOR, evidence: bool = True, paths: bool = True,
                outcomes_from: Profile | None = None, trip_windows: bool = True) -> Calc:
    """calc of one procedure of the selection; ``evidence=False``: from the samples and the model
    alone (the first design, DCPI's), leaving out loop counters, anchors and paths; ``paths=False``:
    leaving out the paths only; ``trip_windows=False``: leaving out what the trip windows measured
    only (their ratios, and how far arguments move per entry: bench/accuracy.py's comparison);
    ``outcomes_from``: the branch outcomes of another profile's recordings of the same binary (say,
    `record --values edges --exact interpret` of the same program) instead of the selection's own."""
    import numpy as np

    from cyclescope.analysis.calc import calc_procedure
    from cyclescope.db.query import query_counts
    from cyclescope.images.cache import Cache
    from cyclescope.images.disasm import read_code
    from cyclescope.images.elf import apply_relative, read_load_info
    from cyclescope.report.listing import counts_at
    from cyclescope.report.prof import counts_by_image

    profile_set, sym = p.profile_set, p.sym
    info = target.info
    b = sym.binary(info)
    if b.path is None:
        raise NotFoundError(b.problem or f"{info.path}: no code available for {target.name}")
    events = profile_set.event_names
    per_image = counts_by_image(query_counts(profile_set, images=[info.key]))
    off, ev, cnt = per_image.get(info.key, (np.zeros(0, np.uint64), np.zeros(0, object), np.zeros(0, np.int64)))
    counts = counts_at(events, sym.offsets_to_vaddr(info, off), ev, cnt)
    elf = read_load_info(b.path)
    code = read_code(b.path, target.start, target.end, elf)
    table = sym.table(info)

    def name_at(addr: int) -> str | None:
        i = int(table.lookup(np.array([addr], np.uint64))[0])
        return table.names[i] if i >= 0 else None

    def read(addr: int, n: int) -> bytes | None:
        try:
            data = read_code(b.path or "", addr, addr + n, elf)
            # A table of code addresses in a PIE is zeros in the file until relocated.
            return apply_relative(b.path or "", addr, data) if elf.elf_type == "ET_DYN" else data
        except Exception:  # an address outside the file (no table there), or unreadable relocations
            return None

    stats = p.loop_stats(info.key, target.start, target.end) if evidence else {}
    anchor = p.anchor_stats(info.key, target.start) if evidence else None
    trips = p.trip_counts(info.key, target.start) if evidence and trip_windows else None
    progress = p.progress_stats(info.key, target.start) if evidence and trip_windows else None
    scale = p.scale_points(info.key, target.start, target.end) if evidence and trip_windows else None
    outcomes = None
    if evidence and paths:
        if outcomes_from is None:
            outcomes = p.branch_outcomes(info)
        else:
            same = [i for i in outcomes_from.images.values()
                    if info.build_id and i.build_id == info.build_id and i.kind == info.kind]
            outcomes = outcomes_from.branch_outcomes(same[0]) if same else None
    return calc_procedure(target.name, target.start, target.end, code, counts, events, event,
                          period_cycles(p, event), name_at, read, Cache(), info.key, mcpu, estimator,
                          stats, profile_set.events[event].mean_period, anchor, outcomes, trips, progress,
                          scale)
