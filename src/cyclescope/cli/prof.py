"""`cyclescope prof`: where the samples went, per procedure or per image."""

from __future__ import annotations

import argparse
import sys

from cyclescope.app.prof import prof_report
from cyclescope.cli.base import Command, add_output_options, add_selection_options, open_profile, register
from cyclescope.errors import UsageError
from cyclescope.report.render import is_tty, write_json, write_table

TERMINAL_LIMIT = 40


@register
class Prof(Command):
    name = "prof"
    description = (
        "Samples per procedure, sorted by the first event, with one column per event: DCPI's\n"
        "dcpiprof. Every report states lost samples and the share that could not be attributed."
    )
    epilog = (
        "examples:\n"
        "  cyclescope prof                      # latest epoch, every process\n"
        "  cyclescope prof --images --epoch all\n"
        "  cyclescope prof --process gcc --limit 20\n"
        "  cyclescope prof --stacks --lines --sort self --process python3   # Python lines\n"
        "  cyclescope prof --json | jq '.rows[0]'"
    )

    def add_arguments(self, p: argparse.ArgumentParser) -> None:
        p.add_argument("--images", action="store_true", help="one row per image instead of per procedure")
        p.add_argument("--stacks", action="store_true",
                       help="one row per function from the call stacks: its samples with what it called "
                            "(total) and alone (self); Python functions (py::) appear here")
        p.add_argument("--lines", action="store_true",
                       help="with --stacks: Python functions split by line (py::function:file:LINE)")
        p.add_argument("--sort", choices=("total", "self"), default=None,
                       help="with --stacks: hottest first by total (default) or by self")
        p.add_argument("--limit", "-n", type=int, default=None, metavar="N",
                       help=f"show the first N rows (default: {TERMINAL_LIMIT} on a terminal, all in a pipe; 0: all)")
        add_selection_options(p)
        add_output_options(p)

    def run(self, args: argparse.Namespace) -> int:
        if args.limit is not None and args.limit < 0:
            raise UsageError("--limit must be 0 or more")
        if args.lines and not args.stacks:
            raise UsageError("--lines goes with --stacks (lines of Python functions come from the call stacks)")
        if args.sort and not args.stacks:
            raise UsageError("--sort goes with --stacks (prof sorts procedures by their samples)")
        if args.stacks and args.images:
            raise UsageError("--stacks and --images do not go together (--stacks: one row per function)")
        from cyclescope.report.prof import prof_table, stack_prof_table

        limit = args.limit
        if limit is None:
            limit = TERMINAL_LIMIT if is_tty(sys.stdout) else 0
        if args.stacks:
            from cyclescope.app.prof import stack_prof_report

            srep = stack_prof_report(open_profile(args), args.lines, args.sort == "self")
            if args.json:
                write_json(srep.to_json())
            else:
                write_table(stack_prof_table(srep, limit or None))
            return 0
        report = prof_report(open_profile(args), args.images)
        if args.json:
            write_json(report.to_json())
            return 0
        write_table(prof_table(report, limit or None))
        return 0
