"""`cyclescope values` and `cyclescope invariants`: what sampled instructions computed."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from cyclescope.cli.base import Command, add_output_options, add_selection_options, finite_float, open_profile, register
from cyclescope.errors import NotFoundError, UsageError
from cyclescope.report.render import write_json, write_table

if TYPE_CHECKING:
    from cyclescope.app.profile import Profile
    from cyclescope.db.values import ValueSelection
    from cyclescope.values.api import ValueModule


def add_value_report_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--modules", metavar="MODULES", default=None,
                   help="value modules that format the values (default: those that captured them)")
    p.add_argument("--uid", type=int, metavar="UID",
                   help="only values of processes owned by UID (root reads everyone's; others their own)")


def load_selection(args: argparse.Namespace) -> tuple[Profile, ValueSelection, list[ValueModule]]:
    """The selection, its value hotlists (--uid's) and the modules that format them (--modules)."""
    from cyclescope.app.values import open_values

    p = open_profile(args)
    vs, modules = open_values(p, args.uid, args.modules.split(",") if args.modules else None)
    return p, vs, modules


@register
class Values(Command):
    name = "values"
    description = (
        "The most frequent values each sampled instruction read, addressed, loaded or produced, from\n"
        "value sampling (record or daemon with --values): one row per instruction and kind of value,\n"
        "with vtot (values seen), thld (the hotlist's sampling probability), nv (values kept) and the\n"
        "hotlist with estimated shares, as in Figure 1 of the value-sampling paper."
    )
    epilog = (
        "kinds: in:REG (operands), addr (effective addresses), load/store (memory values), out:REG (results),\n"
        "ctx (call sites, at procedure entries), edge (branch outcomes), alias (same-address or 4K-aliased\n"
        "pairs), KIND@ctx (per call site)\n\n"
        "examples:\n"
        "  cyclescope values                      # the most-sampled hotlists\n"
        "  cyclescope values scale                # one procedure, instruction by instruction\n"
        "  cyclescope values scale --kind in: --kind out:"
    )

    def add_arguments(self, p: argparse.ArgumentParser) -> None:
        p.add_argument("procedure", nargs="?", help="only this procedure (or 0xSTART-0xEND with --image)")
        p.add_argument("--kind", action="append", default=[], metavar="KIND",
                       help="only these kinds of value (repeatable; 'in:' matches every operand)")
        p.add_argument("--call-sites", action="store_true", help="include the per-call-site hotlists (KIND@ctx)")
        p.add_argument("--top", type=int, default=4, metavar="N", help="values shown per hotlist (default: 4)")
        p.add_argument("--min-vtot", type=int, default=1, metavar="N", help="hotlists with at least N values")
        p.add_argument("--limit", type=int, default=40, metavar="N",
                       help="at most N rows without a procedure (default: 40; 0: all)")
        add_value_report_options(p)
        add_selection_options(p, events=False)
        add_output_options(p)

    def run(self, args: argparse.Namespace) -> int:
        import numpy as np

        from cyclescope.report.summary import summarize
        from cyclescope.report.values import Namer, ValuesReport, hot_rows, kind_matches, selection_notes

        if args.top < 1:
            raise UsageError("--top must be at least 1")
        p, vs, modules = load_selection(args)
        profile_set, sym = p.profile_set, p.sym
        named = vs.hotlists
        lists = named.lists
        namer = Namer(profile_set, sym, named.images)
        keep = lists.total >= args.min_vtot
        kind_ok = np.array([kind_matches(k, args.kind or None, args.call_sites) for k in named.kinds], bool)
        keep &= kind_ok[lists.keys["kind"]]
        from cyclescope.app.values import image_filter

        allowed = image_filter(profile_set, list(args.image))
        if allowed is not None:
            img_ok = np.array([k in allowed for k in named.images], bool)
            keep &= img_ok[lists.keys["image"]]
        title = "cyclescope values: "
        if args.procedure:
            from cyclescope.app.procedures import resolve_target

            target, _ = resolve_target(p, args.procedure, list(args.image))
            img = named.images.index(target.info.key) if target.info.key in named.images else -1
            off = lists.keys["offset"]
            keep &= (lists.keys["image"] == img) & (off >= target.start) & (off < target.end)
            title += f"{target.name} in {target.info.path}"
        else:
            title += "the hotlists whose top value was seen most"
        rows = hot_rows(named, modules, namer, args.top, keep)
        for r in rows:
            r.where = namer.where(r.image, r.offset)
            d = namer.insn(r.image, r.offset)
            r.insn = d.text if d is not None else ""
        if args.procedure:
            rows.sort(key=lambda r: (r.offset, r.kind))
        else:
            # The most telling first: hotlists whose top value accounts for the most values.
            rows.sort(key=lambda r: -(r.vtot * (r.values[0].share if r.values else 0.0)))
            if args.limit:
                rows = rows[: args.limit]
        if not rows:
            raise NotFoundError("no hotlist matches (try --kind, --min-vtot, or a procedure with samples)")
        totals = {e: int(m.samples) for e, m in profile_set.events.items()}
        report = ValuesReport(rows, vs.meta, summarize(profile_set, totals), title, selection_notes(vs), args.top)
        if args.json:
            write_json(report.to_json())
        else:
            from cyclescope.report.values import values_table

            write_table(values_table(report))
        return 0


@register
class Invariants(Command):
    name = "invariants"
    description = (
        "Instructions in hot procedures whose operand, result, loaded value or address is dominated by\n"
        "one value (per call site when the call context was captured), with the source line and an\n"
        "upper estimate of the cycles that specializing the code for that value could remove: the\n"
        "value-sampling paper's search for semi-invariant values."
    )
    epilog = (
        "examples:\n"
        "  cyclescope invariants\n"
        "  cyclescope invariants --min-prob 0.9 --min-share 5"
    )

    def add_arguments(self, p: argparse.ArgumentParser) -> None:
        p.add_argument("--min-prob", type=finite_float, default=0.6, metavar="P",
                       help="the top value's estimated probability at least P (default: 0.6)")
        p.add_argument("--min-share", type=finite_float, default=1.0, metavar="PCT",
                       help="in procedures with at least PCT%% of the samples (default: 1)")
        p.add_argument("--min-vtot", type=int, default=30, metavar="N",
                       help="hotlists with at least N values (default: 30)")
        p.add_argument("--limit", type=int, default=30, metavar="N", help="at most N rows (default: 30; 0: all)")
        add_value_report_options(p)
        add_selection_options(p, events=False)
        add_output_options(p)

    def run(self, args: argparse.Namespace) -> int:

        from cyclescope.app.values import invariants_report
        from cyclescope.report.values import invariants_table

        if not 0 < args.min_prob <= 1:
            raise UsageError("--min-prob must be in (0, 1]")
        if not 0 <= args.min_share <= 100:
            raise UsageError("--min-share is a percentage")
        p, vs, modules = load_selection(args)
        report = invariants_report(p, vs, modules, list(args.image), args.min_prob, args.min_vtot, args.min_share / 100,
                                args.limit)
        if args.json:
            write_json(report.to_json())
        else:
            write_table(invariants_table(report))
        return 0
