"""`cyclescope prof`: where the samples went, per procedure or per image."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from cyclescope.cli.base import (
    Command,
    add_output_options,
    add_selection_options,
    open_selection,
    register,
)
from cyclescope.errors import UsageError
from cyclescope.report.render import is_tty, write_json, write_table

if TYPE_CHECKING:
    from cyclescope.db.query import ProfileSet
    from cyclescope.report.prof import ProfReport

TERMINAL_LIMIT = 40


def prof_report(ps: ProfileSet, by_image: bool) -> ProfReport:
    from cyclescope.binaries.symbolize import Symbolizer
    from cyclescope.db.query import query_counts
    from cyclescope.report.prof import build_prof, counts_by_image
    from cyclescope.report.summary import summarize

    counts = query_counts(ps)
    per_image = counts_by_image(counts)
    sym = Symbolizer(ps.db)
    rep = build_prof(ps.event_names, per_image, ps.images, sym.table, sym.offsets_to_vaddr, by_image=by_image)
    rep.summary = summarize(ps, dict(zip(rep.events, rep.totals, strict=True)))
    rep.problems = {k: v for k, v in sym.problems.items()}
    return rep


@register
class Prof(Command):
    name = "prof"
    help = "samples per procedure (or per image): where have all the cycles gone?"
    description = (
        "Samples per procedure, sorted by the first event, with one column per event: DCPI's\n"
        "dcpiprof. Every report states lost samples and the share that could not be attributed."
    )
    epilog = (
        "examples:\n"
        "  cyclescope prof                      # latest epoch, every process\n"
        "  cyclescope prof --images --epoch all\n"
        "  cyclescope prof --process gcc --limit 20\n"
        "  cyclescope prof --json | jq '.rows[0]'"
    )

    def add_arguments(self, p: argparse.ArgumentParser) -> None:
        p.add_argument("--images", action="store_true", help="one row per image instead of per procedure")
        p.add_argument("--limit", "-n", type=int, default=None, metavar="N",
                       help=f"show the first N rows (default: {TERMINAL_LIMIT} on a terminal, all in a pipe; 0: all)")
        add_selection_options(p)
        add_output_options(p)

    def run(self, args: argparse.Namespace) -> int:
        if args.limit is not None and args.limit < 0:
            raise UsageError("--limit must be 0 or more")
        from cyclescope.report.prof import prof_table

        ps = open_selection(args)
        rep = prof_report(ps, args.images)
        if args.json:
            write_json(rep.to_json())
            return 0
        limit = args.limit
        if limit is None:
            limit = TERMINAL_LIMIT if is_tty(sys.stdout) else 0
        write_table(prof_table(rep, limit or None))
        return 0
