"""`cyclescope specialize`: value-based specialization opportunities under the optimizer's
cost-benefit model, and the plan `record --goal` profiles."""

from __future__ import annotations

import argparse
import sys

from cyclescope.analysis.goal import PHI_SHARE
from cyclescope.app.calc import cycles_event
from cyclescope.cli.base import (
    Command,
    add_output_options,
    add_selection_options,
    finite_float,
    open_profile,
    register,
    selection,
)
from cyclescope.errors import UsageError
from cyclescope.report.render import write_json, write_table


@register
class SpecializeCommand(Command):
    name = "specialize"
    description = (
        "Goal-directed value profiling (Watterson and Debray): for every register at every point where it\n"
        "is defined or the procedure is entered, plus register differences and loop trip counts, the\n"
        "cycles that knowing its value would save (the instructions it makes evaluatable, times calc's\n"
        "execution counts, times their latency) against the cost of testing it on every execution.\n"
        "Static elimination keeps only the candidates that could pay in the best case; the value\n"
        "hotlists (record --values, or record --goal PLAN) then say which pay: rule (1) of the paper."
    )
    epilog = (
        "examples:\n  cyclescope specialize                         # the 10 procedures with most samples\n"
        "  cyclescope specialize bucket_sum --json\n"
        "  cyclescope specialize --plan goal.json        # then: cyclescope record --goal goal.json -- ./prog"
    )

    def add_arguments(self, p: argparse.ArgumentParser) -> None:
        p.add_argument("procedure", nargs="?", metavar="PROCEDURE|0xSTART-0xEND",
                       help="what to analyze (default: the procedures with most samples)")
        p.add_argument("--limit", "-n", type=int, default=10, metavar="N",
                       help="without a procedure: the N procedures with most samples (default: 10; 0: all)")
        p.add_argument("--phi", type=finite_float, default=100 * PHI_SHARE, metavar="PCT",
                       help=f"a specialization must save at least PCT%% of the selection's cycles "
                            f"(default: {100 * PHI_SHARE:g})")
        p.add_argument("--min-values", type=int, default=30, metavar="N",
                       help="a candidate's probability needs at least N values behind it (default: 30)")
        p.add_argument("--plan", metavar="FILE",
                       help="write the candidates static elimination keeps, for `record --goal FILE`")
        p.add_argument("--cycles-event", metavar="EVENT",
                       help="the event whose samples measure time (default: cycles, else cpu-clock)")
        p.add_argument("--mcpu", metavar="CPU", help="llvm-mca CPU model (default: this machine's)")
        add_selection_options(p)
        add_output_options(p)

    def run(self, args: argparse.Namespace) -> int:
        from cyclescope.app.specialize import specialize, specialize_targets, write_plan
        from cyclescope.report.specialize import specialize_table

        if not 0 <= args.phi <= 100:
            raise UsageError("--phi is a percentage")
        if args.limit < 0:
            raise UsageError("--limit must be 0 (every procedure) or more")
        sel = selection(args)
        p = open_profile(args, sel=sel)
        ev = cycles_event(p, args.cycles_event)
        targets = specialize_targets(p, ev, args.procedure, list(sel.images), args.limit)
        if args.min_values < 1:
            raise UsageError("--min-values must be at least 1")
        out = specialize(p, targets, ev, args.mcpu, args.phi / 100, args.min_values)
        if args.plan:
            n = write_plan(out, args.plan)
            print(f"cyclescope specialize: {n} candidate(s) written to {args.plan}, for `cyclescope record --goal "
                  f"{args.plan}`", file=sys.stderr)
        if args.json:
            write_json(out.to_json())
        else:
            write_table(specialize_table(out))
        return 0
