"""`cyclescope calc`: instruction frequency, CPI and stall culprits from samples alone."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from cyclescope.cli.base import (
    Command,
    add_output_options,
    add_selection_options,
    eprint,
    open_db,
    open_selection,
    register,
    selection,
)
from cyclescope.errors import NotFoundError, UsageError
from cyclescope.report.render import is_tty, write_json, write_table

# analysis.frequency.ESTIMATORS, here so that the command line does not import numpy and capstone to parse options
ESTIMATORS = ("dcpi", "geomean")
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

if TYPE_CHECKING:
    from cyclescope.analysis.calc import Calc
    from cyclescope.analysis.loopcount import LoopStats
    from cyclescope.binaries.symbolize import Symbolizer
    from cyclescope.db.query import ProfileSet
    from cyclescope.report.listing import Target


def cycles_event(ps: ProfileSet, wanted: str | None) -> str:
    evs = ps.event_names
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


def period_cycles(ps: ProfileSet, ev: str) -> float | None:
    """P in cycles. For a clock event: (mean period - what a sample cost) * measured clock."""
    meta = ps.events[ev]
    if not meta.time_based:
        return meta.mean_period
    if not ps.clock_ghz:
        return None
    return max(1.0, meta.mean_period - meta.overhead_ns) * ps.clock_ghz


def calc_target(ps: ProfileSet, target: Target, sym: Symbolizer, event: str, mcpu: str | None,
                estimator: str = CALC_ESTIMATOR, evidence: bool = True) -> Calc:
    """calc of one procedure of the selection; ``evidence=False``: from the samples and the model
    alone (the first design, DCPI's), leaving out loop counters."""
    import numpy as np

    from cyclescope.analysis.calc import calc_procedure
    from cyclescope.db.query import query_counts
    from cyclescope.images.cache import Cache
    from cyclescope.images.disasm import read_code
    from cyclescope.images.elf import apply_relative, read_load_info
    from cyclescope.report.listing import counts_at
    from cyclescope.report.prof import counts_by_image

    info = target.info
    b = sym.binary(info)
    if b.path is None:
        raise NotFoundError(b.problem or f"{info.path}: no code available for {target.name}")
    events = ps.event_names
    per_image = counts_by_image(query_counts(ps, images=[info.key]))
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

    stats = loop_stats(ps, info.key, target.start, target.end) if evidence else {}
    return calc_procedure(target.name, target.start, target.end, code, counts, events, event,
                          period_cycles(ps, event), name_at, read, Cache(), info.key, mcpu, estimator,
                          stats, ps.events[event].mean_period)


def loop_stats(ps: ProfileSet, image_key: str, start: int, end: int) -> dict[int, LoopStats]:
    """The loop counters' tallies of the selection for the loops headed in [start, end)."""
    from cyclescope.analysis.loopcount import LoopStats
    from cyclescope.db.tallies import LOOPS, load_tally

    memo = ps.memo.get((False, ("loops", image_key)))
    if memo is None:
        sel = load_tally(ps.db, LOOPS, ps.epochs, ps.hosts or None, {image_key})
        for c in sel.corrupt:
            if f"skipping {c}" not in ps.warnings:
                ps.warnings.append(f"skipping {c}")
                eprint(f"cyclescope calc: skipping {c} (loop counts from it are left out)")
        memo = sel.table
        ps.memo[(False, ("loops", image_key))] = memo
    d = memo.to_pydict()
    out = {}
    for i, h in enumerate(d["header"]):
        if start <= h < end:
            out[int(h)] = LoopStats(
                own=int(d["own"][i]), own_period=float(d["own_period"][i]), followed=int(d["followed"][i]),
                next_own=int(d["next_own"][i]), pairs=int(d["pairs"][i]), iterations=float(d["iterations"][i]),
                pair_period=float(d["pair_period"][i]), mismatched=int(d["mismatched"][i]),
                rejected=int(d["rejected"][i]), trip_samples=int(d["trip_samples"][i]),
                inv_trip=float(d["inv_trip"][i]))
    return out


@register
class CalcCommand(Command):
    name = "calc"
    help = "instruction frequency, CPI and stall culprits of a procedure, from samples alone (dcpicalc)"
    description = (
        "Estimates how many times each basic block ran and how many cycles each instruction spent per\n"
        "execution, from nothing but CYCLES (or cpu-clock) samples and the binary: CFG, frequency\n"
        "equivalence classes, a static model of the CPU (llvm-mca), the ratios S_i/M_i of issue\n"
        "points, flow propagation and repair. Then explains stalls: static reasons from the model and\n"
        "dynamic culprits that could not be ruled out (I-cache, D-cache, DTLB, mispredicts, dividers,\n"
        "store buffer). DCPI's dcpicalc, Figures 2 and 4 of the SOSP paper."
    )
    epilog = (
        "examples:\n  cyclescope calc hot\n  cyclescope calc                      # the 20 hottest procedures\n"
        "  cyclescope calc --image ./prog --limit 10\n"
        "  cyclescope calc hot --json"
    )

    def add_arguments(self, p: argparse.ArgumentParser) -> None:
        p.add_argument("procedure", nargs="?", metavar="PROCEDURE|0xSTART-0xEND",
                       help="what to analyze (default: the procedures with most samples, one line each)")
        p.add_argument("--all", action="store_true", help="with --image: every procedure with samples in it")
        p.add_argument("--cycles-event", metavar="EVENT",
                       help="the event whose samples measure time (default: cycles, else cpu-clock)")
        p.add_argument("--mcpu", metavar="CPU", help="llvm-mca CPU model (default: this machine's)")
        p.add_argument("--estimator", choices=ESTIMATORS, default=CALC_ESTIMATOR,
                       help=ESTIMATOR_HELP + f" (default: {CALC_ESTIMATOR})")
        p.add_argument("--hot", action="store_true", help="only blocks with samples")
        p.add_argument("--limit", "-n", type=int, default=None, metavar="N",
                       help="without a procedure: the N procedures with most samples (default: 20; with --image, "
                            "all of them in a pipe; 0: all)")
        add_selection_options(p)
        add_output_options(p)

    def run(self, args: argparse.Namespace) -> int:
        from cyclescope.binaries.symbolize import Symbolizer
        from cyclescope.cli.listing import image_totals, resolve_target
        from cyclescope.report.calc import calc_table, calc_to_json, summarize

        db = open_db(args)
        sel = selection(args)
        ps = open_selection(args, db, sel)
        sym = Symbolizer(db)
        ev = cycles_event(ps, args.cycles_event)
        if args.procedure:
            target, notes = resolve_target(ps, args.procedure, list(sel.images), sym)
            c = calc_target(ps, target, sym, ev, args.mcpu, args.estimator)
            c.notes = notes + c.notes
            s = summarize(c)
            tot = sum(image_totals(ps).values())
            s.share_of_all = 100.0 * s.samples / tot if tot else None
            if args.json:
                write_json(calc_to_json(c, s))
            else:
                write_table(calc_table(c, s, hot_only=args.hot))
            return 0
        return self._many(ps, sym, ev, args)

    def _many(self, ps: ProfileSet, sym: Symbolizer, ev: str, args: argparse.Namespace) -> int:
        """The procedures with most samples (of --image's images, or of all), each through calc."""
        import time

        from cyclescope.cli.prof import prof_report
        from cyclescope.errors import CycleScopeError
        from cyclescope.report.calc import calc_to_json, image_table, summarize
        from cyclescope.report.listing import Target

        rep = prof_report(ps, False)
        i = rep.events.index(ev)
        rows = [r for r in rep.rows if r.start is not None and r.counts[i] > 0]
        # The kernel's code is not in the database: its procedures cannot be analyzed.
        no_code = [r for r in rows if ps.images[r.image_key].kind not in ("elf", "vdso")]
        rows = [r for r in rows if ps.images[r.image_key].kind in ("elf", "vdso")]
        if not rows:
            problems = sorted({sym.problems[k] for k in ps.images if k in sym.problems})
            nosym = [r.image for r in rep.rows if r.start is None and r.counts[i] > 0]
            raise NotFoundError("no procedure with samples to analyze"
                                + (f": {problems[0]}" if problems else
                                   f": {nosym[0]} has no symbol table (stripped?); give an address range "
                                   "0xSTART-0xEND instead of a procedure" if nosym else ""))
        if args.limit is not None and args.limit < 0:
            raise UsageError("--limit must be 0 (every procedure) or more")
        # Over an image, every procedure in a pipe; over everything, the 20 hottest unless asked.
        limit = args.limit if args.limit is not None else (20 if is_tty(sys.stdout) or not ps.selection.images else 0)
        hidden = len(rows) - limit if limit and len(rows) > limit else 0
        if limit:
            rows = rows[:limit]
        t0 = time.perf_counter()
        results = []
        failures = []
        for r in rows:
            info = ps.images[r.image_key]
            table = sym.table(info)
            k = table.names.index(r.procedure) if r.procedure in table.names else -1
            if k < 0:
                continue
            tgt = Target(info, r.procedure, int(table.starts[k]), int(table.ends[k]))
            try:
                c = calc_target(ps, tgt, sym, ev, args.mcpu, args.estimator)
            except CycleScopeError as e:
                failures.append(f"{r.procedure}: {e}")
                continue
            results.append((r.procedure, c, summarize(c)))
        secs = time.perf_counter() - t0
        if args.json:
            write_json({"procedures": [calc_to_json(c, s) for _, c, s in results], "failures": failures,
                        "analysis_seconds": round(secs, 3), "not_shown": hidden})
            return 0
        out = image_table(results, float(rep.totals[i]))
        out.footer += [f"note: {f}" for f in failures]
        if no_code:
            out.footer.append(f"note: {len(no_code)} kernel procedure(s) with samples left out (no code to analyze)")
        out.footer.append(f"{len(results)} procedures analyzed in {secs:.1f} s"
                          + (f"; {hidden} more with fewer samples not analyzed (--limit 0: all)" if hidden else ""))
        write_table(out)
        return 0
