"""`cyclescope list`: annotated disassembly of a procedure, or per-line totals of a source file."""

from __future__ import annotations

import argparse
import difflib
import re
from typing import TYPE_CHECKING

from cyclescope.cli.base import (
    Command,
    add_output_options,
    add_selection_options,
    open_db,
    open_selection,
    register,
    selection,
)
from cyclescope.errors import NotFoundError, UsageError
from cyclescope.report.render import write_json, write_table

if TYPE_CHECKING:
    import numpy as np

    from cyclescope.binaries.symbolize import Symbolizer
    from cyclescope.db.query import ProfileSet
    from cyclescope.images.dwarf import DwarfIndex, Scope
    from cyclescope.images.registry import ImageInfo
    from cyclescope.report.listing import Listing, SourceListing, Target

_RANGE_RE = re.compile(r"^(0x[0-9a-fA-F]+)\s*(?:-\s*(0x[0-9a-fA-F]+)|\+\s*(0x[0-9a-fA-F]+|\d+))$")


def image_totals(ps: ProfileSet) -> dict[str, int]:
    from cyclescope.db.query import query_counts

    t = query_counts(ps)
    out: dict[str, int] = {}
    for img, c in zip(t.column("image").to_pylist(), t.column("count").to_pylist(), strict=True):
        out[img] = out.get(img, 0) + int(c)
    return out


def _candidate_images(ps: ProfileSet, image_patterns: list[str], totals: dict[str, int]) -> list[str]:
    from cyclescope.db.query import match_images

    keys = match_images(ps, image_patterns) if image_patterns else list(totals)
    return sorted((k for k in keys if k in ps.images and ps.images[k].kind != "unknown"),
                  key=lambda k: -totals.get(k, 0))


def resolve_target(ps: ProfileSet, spec: str, image_patterns: list[str], sym: Symbolizer) -> tuple[Target, list[str]]:
    """A procedure name or address range, in the images of the selection."""
    from cyclescope.report.listing import Target

    totals = image_totals(ps)
    keys = _candidate_images(ps, image_patterns, totals)
    m = _RANGE_RE.match(spec.strip())
    if m:
        start = int(m.group(1), 16)
        end = int(m.group(2), 16) if m.group(2) else start + int(m.group(3), 0)
        if end <= start:
            raise UsageError(f"empty address range {spec}")
        elf = [k for k in keys if ps.images[k].kind in ("elf", "vdso")]
        if len(elf) != 1 and not image_patterns:
            raise UsageError("an address range needs --image (the selection has samples in several images)")
        if not keys:
            raise NotFoundError("no image with samples matches")
        return Target(ps.images[keys[0]], spec, start, end), []
    matches: list[tuple[int, ImageInfo, int, int, str]] = []
    names_seen: dict[str, int] = {}
    for k in keys:
        info = ps.images[k]
        table = sym.table(info)
        for i, n in enumerate(table.names):
            if n == spec or (n.startswith(spec + "(") and "(" not in spec):
                matches.append((totals.get(k, 0), info, int(table.starts[i]), int(table.ends[i]), n))
        if len(names_seen) < 200000:
            for n in table.names:
                names_seen.setdefault(n, 0)
    if not matches:
        close = difflib.get_close_matches(spec, list(names_seen), n=5, cutoff=0.6)
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        where = f" in {', '.join(image_patterns)}" if image_patterns else " in the images with samples"
        raise NotFoundError(f"no procedure named '{spec}'{where}{hint}")
    matches.sort(key=lambda m: -m[0])
    _, info, start, end, name = matches[0]
    notes = [f"'{spec}' is also in {m[1].path} (use --image to choose)" for m in matches[1:4] if m[1].key != info.key]
    return Target(info, name, start, end), notes


def make_listing(ps: ProfileSet, target: Target, sym: Symbolizer, source_dirs: list[str], with_source: bool,
                 notes: list[str]) -> Listing:
    import numpy as np

    from cyclescope.db.query import query_counts
    from cyclescope.images.disasm import disassemble, read_code
    from cyclescope.images.dwarf import DwarfIndex, SourcePos, dwarf_source
    from cyclescope.report.listing import SourceFiles, build_listing, counts_at
    from cyclescope.report.prof import counts_by_image
    from cyclescope.report.summary import summarize

    info = target.info
    events = ps.event_names
    all_counts = query_counts(ps)
    sel_totals = [0] * len(events)
    for e, c in zip(all_counts.column("event").to_pylist(), all_counts.column("count").to_pylist(), strict=True):
        if e in events:
            sel_totals[events.index(e)] += int(c)
    per_image = counts_by_image(query_counts(ps, images=[info.key]))
    off, ev, cnt = per_image.get(info.key, (np.zeros(0, np.uint64), np.zeros(0, object), np.zeros(0, np.int64)))
    off = sym.offsets_to_vaddr(info, off)
    counts = counts_at(events, off, ev, cnt)
    problems = list(notes)
    b = sym.binary(info)
    insns = []
    dw: DwarfIndex | None = None
    if b.path is not None:
        try:
            insns = disassemble(read_code(b.path, target.start, target.end), target.start)
        except (OSError, Exception) as e:  # DataError or a capstone failure: list counts only
            problems.append(f"cannot read code: {e}")
        if with_source:
            src = dwarf_source(b.path, info.key)
            if src is not None:
                dw = DwarfIndex(src, info.key)
            else:
                problems.append(f"{info.path}: no DWARF line information (built without -g, or stripped)")
    elif b.problem:
        problems.append(b.problem)
    elif info.kind in ("kernel", "module", "jit"):
        problems.append(f"{info.path}: no code bytes are kept for this image; showing sampled offsets only")
    addrs = np.array([i.address for i in insns], np.uint64)
    positions: list[SourcePos | None] = [None] * len(insns)
    stacks: list[list[Scope]] = [[] for _ in insns]
    if dw is not None and len(addrs):
        positions = dw.positions(addrs)
        stacks = _stacks(dw, addrs, target.start, target.end)
        dw.close()
    near = [str(__import__("os").path.dirname(b.path))] if b.path else []
    files = SourceFiles(source_dirs, near)
    table = sym.table(info)

    def name_of(addr: int) -> str | None:
        i = int(table.lookup(np.array([addr], np.uint64))[0])
        if i < 0:
            return None
        s = int(table.starts[i])
        return table.names[i] + (f"+{addr - s:#x}" if addr != s else "")

    lst = build_listing(target, events, insns, counts, positions, stacks, files.line, name_of, sel_totals)
    lst.binary = b.path
    lst.problems = problems + lst.problems
    for f in sorted(files.missing):
        lst.problems.append(f"source {f} not found (--source-dir DIR to look there)")
    lst.summary = summarize(ps, dict(zip(events, sel_totals, strict=True)))
    return lst


def _stacks(dw: DwarfIndex, addrs: np.ndarray, start: int, end: int) -> list[list[Scope]]:
    """Inlined-call stacks per address: each scope marks the sorted addresses it covers."""
    import numpy as np

    cus = dw.cu_at(addrs)
    hits: list[list[Scope]] = [[] for _ in range(len(addrs))]
    order = np.argsort(addrs, kind="stable")
    sorted_addrs = addrs[order]
    for cu in np.unique(cus[cus >= 0]).tolist():
        for sc in dw.scopes(int(cu)).items:
            if not sc.inlined or sc.low >= end or sc.high <= start:
                continue
            lo = int(np.searchsorted(sorted_addrs, np.uint64(sc.low), side="left"))
            hi = int(np.searchsorted(sorted_addrs, np.uint64(sc.high), side="left"))
            for k in order[lo:hi].tolist():
                if cus[k] == cu:
                    hits[k].append(sc)
    for h in hits:
        if len(h) > 1:
            h.sort(key=lambda s: (s.depth, s.high - s.low))
    return hits


def make_source_listing(ps: ProfileSet, pattern: str, sym: Symbolizer, source_dirs: list[str]) -> SourceListing:
    import numpy as np

    from cyclescope.db.query import query_counts
    from cyclescope.images.dwarf import DwarfIndex, dwarf_source
    from cyclescope.report.listing import SourceFiles, build_source_listing
    from cyclescope.report.prof import counts_by_image
    from cyclescope.report.summary import summarize

    events = ps.event_names
    per_image = counts_by_image(query_counts(ps))
    by_file: dict[str, dict[int, np.ndarray]] = {}
    images_of: dict[str, set[str]] = {}
    sel_totals = dict.fromkeys(events, 0)
    for key, (off, ev, cnt) in per_image.items():
        for e, c in zip(ev.tolist(), cnt.tolist(), strict=True):
            if e in sel_totals:
                sel_totals[e] += int(c)
        info = ps.images.get(key)
        if info is None or info.kind not in ("elf", "vdso"):
            continue
        b = sym.binary(info)
        src = dwarf_source(b.path, info.key) if b.path else None
        if src is None:
            continue
        dw = DwarfIndex(src, info.key)
        off = sym.offsets_to_vaddr(info, off)
        uniq, inv = np.unique(off, return_inverse=True)
        pos = dw.positions(uniq)
        dw.close()
        for i, (e, c) in enumerate(zip(ev.tolist(), cnt.tolist(), strict=True)):
            p = pos[int(inv[i])]
            if p is None or not _file_matches(p.file, pattern):
                continue
            lines = by_file.setdefault(p.file, {})
            a = lines.get(p.line)
            if a is None:
                a = lines[p.line] = np.zeros(len(events), np.int64)
            a[events.index(e)] += c
            images_of.setdefault(p.file, set()).add(info.path)
    if not by_file:
        raise NotFoundError(f"no samples in a source file matching '{pattern}' (is the binary built with -g?)")
    ranked = sorted(by_file, key=lambda f: -sum(int(v[0]) for v in by_file[f].values()))
    chosen = ranked[0]
    files = SourceFiles(source_dirs)
    sl = build_source_listing(chosen, events, by_file[chosen], files.lines(chosen), sorted(images_of[chosen]))
    sl.others = ranked[1:]
    sl.summary = summarize(ps, sel_totals)
    return sl


def _file_matches(path: str, pattern: str) -> bool:
    pattern = pattern.rstrip("/")
    return path == pattern or path.endswith("/" + pattern.lstrip("./")) or path.rsplit("/", 1)[-1] == pattern


@register
class List(Command):
    name = "list"
    help = "a procedure's instructions with samples and source lines (or a source file's lines)"
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
        from cyclescope.binaries.symbolize import Symbolizer
        from cyclescope.report.listing import listing_table, source_table

        if bool(args.procedure) == bool(args.source):
            raise UsageError("give a PROCEDURE (or address range) or --source FILE")
        db = open_db(args)
        ps = open_selection(args, db)
        sym = Symbolizer(db)
        if args.source:
            sl = make_source_listing(ps, args.source, sym, args.source_dir)
            if args.json:
                write_json(sl.to_json())
            else:
                write_table(source_table(sl, context_only=args.sampled_lines))
            return 0
        sel = selection(args)
        target, notes = resolve_target(ps, args.procedure, list(sel.images), sym)
        lst = make_listing(ps, target, sym, args.source_dir, not args.no_source, notes)
        if args.values:
            from cyclescope.cli.values import value_columns_for_listing

            cols, cells, vnotes = value_columns_for_listing(args, ps, sym, target.info.key, target.start,
                                                            target.end)
            lst.value_columns, lst.values = cols, cells
            lst.problems += vnotes
        if args.json:
            write_json(lst.to_json())
        else:
            write_table(listing_table(lst, show_bytes=args.bytes))
        return 0
