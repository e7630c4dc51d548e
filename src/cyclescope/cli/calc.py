"""`cyclescope calc`: instruction frequency, CPI and stall culprits from samples alone."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from cyclescope.app.calc import CALC_ESTIMATOR, ESTIMATOR_HELP, ESTIMATORS, calc_target, cycles_event
from cyclescope.cli.base import Command, add_output_options, add_selection_options, open_profile, register, selection
from cyclescope.errors import UsageError
from cyclescope.report.render import is_tty, write_json, write_table

if TYPE_CHECKING:
    from cyclescope.app.profile import Profile


@register
class CalcCommand(Command):
    name = "calc"
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
        p.add_argument("--paths-from", metavar="DB",
                       help="branch outcomes from another database's recordings of the same binaries (`record "
                            "--values edges --interpret 16`); default: the selection's own, if it has any")
        p.add_argument("--hot", action="store_true", help="only blocks with samples")
        p.add_argument("--limit", "-n", type=int, default=None, metavar="N",
                       help="without a procedure: the N procedures with most samples (default: 20; with --image, "
                            "all of them in a pipe; 0: all)")
        add_selection_options(p)
        add_output_options(p)

    def run(self, args: argparse.Namespace) -> int:
        from cyclescope.app.procedures import resolve_target
        from cyclescope.report.calc import calc_table, calc_to_json, summarize

        sel = selection(args)
        p = open_profile(args, sel=sel)
        ev = cycles_event(p, args.cycles_event)
        paths = _paths_profile(args.paths_from)
        if args.procedure:
            target, notes = resolve_target(p, args.procedure, list(sel.images))
            c = calc_target(p, target, ev, args.mcpu, args.estimator, outcomes_from=paths)
            c.notes = notes + c.notes
            s = summarize(c)
            tot = sum(p.image_totals().values())
            s.share_of_all = 100.0 * s.samples / tot if tot else None
            if args.json:
                write_json(calc_to_json(c, s))
            else:
                write_table(calc_table(c, s, hot_only=args.hot))
            return 0
        return self._many(p, ev, args, paths)

    def _many(self, p: Profile, ev: str, args: argparse.Namespace, paths: Profile | None) -> int:
        """The procedures with most samples (of --image's images, or of all), each through calc."""
        import time

        from cyclescope.app.procedures import procedure_target, procedures_with_samples
        from cyclescope.errors import CycleScopeError
        from cyclescope.report.calc import calc_to_json, image_table, summarize

        profile_set = p.profile_set
        rows, no_code, total = procedures_with_samples(p, ev)
        if args.limit is not None and args.limit < 0:
            raise UsageError("--limit must be 0 (every procedure) or more")
        # Over an image, every procedure in a pipe; over everything, the 20 hottest unless asked.
        default_limit = 20 if is_tty(sys.stdout) or not profile_set.selection.images else 0
        limit = args.limit if args.limit is not None else default_limit
        hidden = len(rows) - limit if limit and len(rows) > limit else 0
        if limit:
            rows = rows[:limit]
        t0 = time.perf_counter()
        results = []
        failures = []
        for r in rows:
            tgt = procedure_target(p, r.image_key, r.procedure)
            if tgt is None:
                continue
            try:
                c = calc_target(p, tgt, ev, args.mcpu, args.estimator, outcomes_from=paths)
            except CycleScopeError as e:
                failures.append(f"{r.procedure}: {e}")
                continue
            results.append((r.procedure, c, summarize(c)))
        secs = time.perf_counter() - t0
        if args.json:
            write_json({"procedures": [calc_to_json(c, s) for _, c, s in results], "failures": failures,
                        "analysis_seconds": round(secs, 3), "not_shown": hidden})
            return 0
        out = image_table(results, float(total))
        out.footer += [f"note: {f}" for f in failures]
        if no_code:
            out.footer.append(f"note: {len(no_code)} kernel procedure(s) with samples left out (no code to analyze)")
        out.footer.append(f"{len(results)} procedures analyzed in {secs:.1f} s"
                          + (f"; {hidden} more with fewer samples not analyzed (--limit 0: all)" if hidden else ""))
        write_table(out)
        return 0


def _paths_profile(path: str | None) -> Profile | None:
    """The profile whose branch outcomes calc uses (--paths-from): every epoch of that database."""
    if path is None:
        return None
    from cyclescope.app.profile import open_profile as open_app_profile
    from cyclescope.db.layout import Database
    from cyclescope.db.query import Selection

    return open_app_profile(Database.open(path), Selection(epochs="all"))
