"""`cyclescope stats` and `cyclescope diff`: is a difference between runs real?"""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from cyclescope.app.compare import insn_counts, sample_sets, set_counts
from cyclescope.cli.base import (
    Command,
    add_engine_options,
    add_output_options,
    default_db,
    eprint,
    finite_float,
    open_profile,
    register,
)
from cyclescope.errors import DataError, UsageError
from cyclescope.report.render import is_tty, write_json, write_table

if TYPE_CHECKING:
    pass


def _filters(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("selecting samples")
    g.add_argument("--process", "--comm", metavar="NAME", action="append", default=[], dest="process",
                   help="only processes named NAME (repeatable)")
    g.add_argument("--image", metavar="IMAGE", action="append", default=[], help="only samples in IMAGE (repeatable)")
    g.add_argument("--event", "-e", metavar="EVENT", help="the event to compare (default: the first recorded)")
    g.add_argument("--images", action="store_true", help="compare images instead of procedures")
    add_engine_options(g)  # type: ignore[arg-type]


@register
class Stats(Command):
    name = "stats"
    description = (
        "Per procedure across several sample sets: range% ((max-min)/sum), sum, sum%, N, mean, std-dev,\n"
        "min, max, sorted by range%: the procedures whose time varies most between runs come first\n"
        "(Figure 3 of the DCPI paper). Sets are epochs by default; --by host or --by db to change that."
    )
    epilog = (
        "examples:\n  cyclescope stats --epoch 1-8\n"
        "  cyclescope stats --db run1.db --db run2.db --by db --epoch all"
    )

    def add_arguments(self, p: argparse.ArgumentParser) -> None:
        p.add_argument("--db", metavar="PATH", action="append", default=[],
                       help="database(s) (repeatable; default: $CYCLESCOPE_DB or ./cyclescope.db)")
        p.add_argument("--epoch", "-E", default="all", metavar="SPEC", help="epochs to include (default: all)")
        p.add_argument("--host", metavar="HOST", action="append", default=[], help="only these hosts")
        p.add_argument("--by", choices=["epoch", "host", "db"], default="epoch", help="what a sample set is")
        p.add_argument("--normalize", action="store_true",
                       help="compare shares (each set scaled to the same total) instead of raw counts")
        p.add_argument("--limit", "-n", type=int, default=None, metavar="N", help="show the first N rows")
        p.add_argument("--min-percent", type=finite_float, default=0.5, metavar="P",
                       help="hide procedures with less than P%% of all samples (default: 0.5)")
        _filters(p)
        add_output_options(p)

    def run(self, args: argparse.Namespace) -> int:
        from cyclescope.db.layout import Database
        from cyclescope.db.query import Selection
        from cyclescope.report.compare import build_stats, stats_table

        dbs = [Database.open(p) for p in (args.db or [default_db()])]
        sets = sample_sets(dbs, args.epoch, args.by, list(args.host),
                           Selection(processes=tuple(args.process), images=tuple(args.image)))
        if len(sets) < 2:
            raise UsageError(f"stats needs at least two sample sets; found {len(sets)} (by {args.by})")
        event = args.event
        per_set = []
        names = []
        for name, db, sel in sets:
            try:
                ev, counts = set_counts(open_profile(args, db, sel, what=name), event, args.images)
            except DataError as e:  # a set with nothing readable: say so, compare the others
                eprint(f"cyclescope stats: leaving out {name}: {e}")
                continue
            event = event or ev
            per_set.append(counts)
            names.append(name)
        if len(per_set) < 2:
            raise DataError(f"stats needs at least two readable sample sets; {len(per_set)} left")
        report = build_stats(event or "?", names, per_set, normalize=args.normalize)
        if args.json:
            write_json(report.to_json())
            return 0
        limit = args.limit if args.limit is not None else (40 if is_tty(sys.stdout) else 0)
        write_table(stats_table(report, limit or None, args.min_percent / 100))
        return 0


def parse_set(spec: str, default: str) -> tuple[str, str, str | None]:
    """'[DB:]EPOCHS[@HOST]' -> (db path, epochs, host)."""
    db = default
    rest = spec
    if ":" in spec:
        db, rest = spec.rsplit(":", 1)
    host = None
    if "@" in rest:
        rest, host = rest.split("@", 1)
    return db, rest or "latest", host


@register
class Diff(Command):
    name = "diff"
    description = (
        "Compare two sample sets A and B, each '[DB:]EPOCHS[@HOST]' (default: the two latest epochs).\n"
        "Shares are normalized by each set's total; a change is flagged when a two-proportion z-test\n"
        "with Benjamini-Hochberg control of the false discovery rate gives q < --alpha and the share\n"
        "moved by at least --min-change percentage points."
    )
    epilog = (
        "examples:\n"
        "  cyclescope diff                        # epoch -2 against epoch -1\n"
        "  cyclescope diff 3 4 --procedure hot    # instruction by instruction (same binary)\n"
        "  cyclescope diff before.db:all after.db:all"
    )

    def add_arguments(self, p: argparse.ArgumentParser) -> None:
        p.add_argument("a", nargs="?", default="-2", metavar="A", help="first sample set (default: -2)")
        p.add_argument("b", nargs="?", default="-1", metavar="B", help="second sample set (default: -1)")
        p.add_argument("--db", metavar="PATH", default=None, help="database for sets that name none")
        p.add_argument("--alpha", type=finite_float, default=0.05, help="false discovery rate (default: 0.05)")
        p.add_argument("--min-change", type=finite_float, default=0.1, metavar="POINTS",
                       help="smallest change of share worth flagging, in percentage points (default: 0.1)")
        p.add_argument("--procedure", metavar="NAME", help="compare the instructions of one procedure")
        p.add_argument("--all", action="store_true", help="also list what did not change significantly")
        p.add_argument("--limit", "-n", type=int, default=None, metavar="N", help="show the first N rows")
        _filters(p)
        add_output_options(p)

    def run(self, args: argparse.Namespace) -> int:
        from cyclescope.db.layout import Database
        from cyclescope.db.query import Selection
        from cyclescope.report.compare import build_diff, diff_table

        if not 0 < args.alpha < 1:
            raise UsageError("--alpha must be between 0 and 1")
        default = args.db or default_db()
        sides = []
        for spec in (args.a, args.b):
            dbp, epochs, host = parse_set(spec, default)
            db = Database.open(dbp)
            sel = Selection(epochs=epochs, hosts=(host,) if host else (), processes=tuple(args.process),
                            images=tuple(args.image))
            sides.append((spec, open_profile(args, db, sel, what=spec)))
        event = args.event
        if args.procedure:
            (_, pa), (_, pb) = sides
            event, a = insn_counts(pa, args.procedure, event, args.image)
            _, b = insn_counts(pb, args.procedure, event, args.image)
            unit = "instruction"
        else:
            event, a = set_counts(sides[0][1], event, args.images)
            _, b = set_counts(sides[1][1], event, args.images)
            unit = "image" if args.images else "procedure"
        report = build_diff(event or "?", sides[0][0], sides[1][0], a, b, args.alpha, args.min_change / 100, unit)
        if args.json:
            write_json(report.to_json())
            return 0
        limit = args.limit if args.limit is not None else (40 if is_tty(sys.stdout) else 0)
        write_table(diff_table(report, limit or None, all_rows=args.all))
        return 0
