"""`cyclescope timeline`: where the samples went over time, per process or thread."""

from __future__ import annotations

import argparse

from cyclescope.cli.base import Command, add_output_options, add_selection_options, open_profile, register
from cyclescope.report.render import write_json, write_table


@register
class Timeline(Command):
    name = "timeline"
    description = (
        "Samples over time: CPUs busy (for cpu-clock) or samples per step, in total and for the\n"
        "busiest processes (or threads), from the 100 ms windows the collector keeps per thread."
    )
    epilog = (
        "examples:\n"
        "  cyclescope timeline                    # the latest epoch, about 60 steps\n"
        "  cyclescope timeline --by thread --process myserver --step 1000\n"
        "  cyclescope timeline --epoch all --json | jq '.series[0]'"
    )

    def add_arguments(self, p: argparse.ArgumentParser) -> None:
        p.add_argument("--by", choices=("process", "thread"), default="process",
                       help="one series per process name (default) or per thread")
        p.add_argument("--step", type=int, default=None, metavar="MS",
                       help="milliseconds per row, a multiple of 100 (default: what fits about 60 rows)")
        p.add_argument("--top", type=int, default=6, metavar="N",
                       help="series for the N busiest processes or threads, the rest summed (default: 6)")
        add_selection_options(p)
        add_output_options(p)

    def run(self, args: argparse.Namespace) -> int:
        from cyclescope.app.timeline import timeline
        from cyclescope.report.timeline import timeline_table

        tl = timeline(open_profile(args), args.by, args.step, args.top)
        if args.json:
            write_json(tl.to_json())
        else:
            write_table(timeline_table(tl))
        return 0
