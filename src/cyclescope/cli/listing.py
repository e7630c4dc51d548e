"""`cyclescope list`: annotated disassembly of a procedure, or per-line totals of a source file."""

from __future__ import annotations

import argparse

from cyclescope.cli.base import Command, add_output_options, add_selection_options, open_profile, register, selection
from cyclescope.errors import UsageError
from cyclescope.report.render import write_json, write_table


@register
class List(Command):
    name = "list"
    description = (
        "Annotated disassembly of a procedure (or an address range) with the samples of every event per\n"
        "instruction and the source lines and inlined calls from DWARF interleaved: DCPI's dcpilist.\n"
        "With --source FILE: the source file with per-line totals and the hottest lines marked."
    )
    epilog = (
        "examples:\n"
        "  cyclescope list hot\n"
        "  cyclescope list _PyEval_EvalFrameDefault --image libpython3.11.so.1.0\n"
        "  cyclescope list 0x1130-0x11a0 --image ./prog\n"
        "  cyclescope list --source hotcold.c"
    )

    def add_arguments(self, p: argparse.ArgumentParser) -> None:
        p.add_argument("procedure", nargs="?", metavar="PROCEDURE|0xSTART-0xEND|0xSTART+LEN",
                       help="what to list: a procedure name or an address range (ELF addresses)")
        p.add_argument("--source", metavar="FILE", help="list a source file with per-line totals instead")
        p.add_argument("--source-dir", metavar="DIR", action="append", default=[],
                       help="where to look for source files (repeatable)")
        p.add_argument("--no-source", action="store_true", help="do not interleave source lines")
        p.add_argument("--bytes", action="store_true", help="show instruction bytes")
        p.add_argument("--sampled-lines", action="store_true", help="--source: only lines with samples")
        p.add_argument("--values", action="store_true",
                       help="a column with each instruction's most telling value hotlist (from value sampling)")
        p.add_argument("--value-kind", action="append", default=[], metavar="KIND",
                       help="with --values: only these kinds (repeatable, e.g. in: out: load)")
        add_selection_options(p)
        add_output_options(p)

    def run(self, args: argparse.Namespace) -> int:
        from cyclescope.app.procedures import make_listing, make_source_listing, resolve_target
        from cyclescope.report.listing import listing_table, source_table

        if bool(args.procedure) == bool(args.source):
            raise UsageError("give a PROCEDURE (or address range) or --source FILE")
        p = open_profile(args)
        if args.source:
            sl = make_source_listing(p, args.source, args.source_dir)
            if args.json:
                write_json(sl.to_json())
            else:
                write_table(source_table(sl, context_only=args.sampled_lines))
            return 0
        sel = selection(args)
        target, notes = resolve_target(p, args.procedure, list(sel.images))
        lst = make_listing(p, target, args.source_dir, not args.no_source, notes)
        if args.values:
            from cyclescope.app.values import listing_values

            cols, cells, vnotes = listing_values(p, target.info.key, target.start, target.end, args.value_kind)
            lst.value_columns, lst.values = cols, cells
            lst.problems += vnotes
        if args.json:
            write_json(lst.to_json())
        else:
            write_table(listing_table(lst, show_bytes=args.bytes))
        return 0
