"""Procedures and listings: resolve a procedure name or address range in a profile's images,
list its instructions with their samples (DCPI's dcpilist), or a source file's lines."""

from __future__ import annotations

import difflib
import re
from typing import TYPE_CHECKING

from cyclescope.errors import NotFoundError, UsageError

if TYPE_CHECKING:
    import numpy as np

    from cyclescope.app.profile import Profile
    from cyclescope.db.query import ProfileSet
    from cyclescope.images.dwarf import DwarfIndex, Scope
    from cyclescope.images.registry import ImageInfo
    from cyclescope.report.listing import Listing, SourceListing, Target
    from cyclescope.report.prof import ProfRow

_RANGE_RE = re.compile(r"^(0x[0-9a-fA-F]+)\s*(?:-\s*(0x[0-9a-fA-F]+)|\+\s*(0x[0-9a-fA-F]+|\d+))$")



def _candidate_images(profile_set: ProfileSet, image_patterns: list[str], totals: dict[str, int]) -> list[str]:
    from cyclescope.db.query import match_images

    keys = match_images(profile_set, image_patterns) if image_patterns else list(totals)
    return sorted((k for k in keys if k in profile_set.images and profile_set.images[k].kind != "unknown"),
                  key=lambda k: -totals.get(k, 0))


def procedure_target(p: Profile, image_key: str, name: str) -> Target | None:
    """The procedure ``name`` of one of the selection's images, bounded by its symbol table (None:
    the table has no such name)."""
    from cyclescope.report.listing import Target

    info = p.images[image_key]
    table = p.sym.table(info)
    if name not in table.names:
        return None
    k = table.names.index(name)
    return Target(info, name, int(table.starts[k]), int(table.ends[k]))


def procedures_with_samples(p: Profile, event: str) -> tuple[list[ProfRow], list[ProfRow], int]:
    """The procedures with samples of ``event``, hottest first, that have code to analyze; those
    without (the kernel's: its code is not in the database); and the event's total. NotFoundError,
    saying why, when there is nothing to analyze."""
    from cyclescope.app.prof import prof_report

    profile_set, sym = p.profile_set, p.sym
    report = prof_report(p)
    i = report.events.index(event)
    rows = [r for r in report.rows if r.start is not None and r.counts[i] > 0]
    no_code = [r for r in rows if profile_set.images[r.image_key].kind not in ("elf", "vdso")]
    rows = [r for r in rows if profile_set.images[r.image_key].kind in ("elf", "vdso")]
    if not rows:
        problems = sorted({sym.problems[k] for k in profile_set.images if k in sym.problems})
        nosym = [r.image for r in report.rows if r.start is None and r.counts[i] > 0]
        raise NotFoundError("no procedure with samples to analyze"
                            + (f": {problems[0]}" if problems else
                               f": {nosym[0]} has no symbol table (stripped?); give an address range "
                               "0xSTART-0xEND instead of a procedure" if nosym else ""))
    return rows, no_code, int(report.totals[i])


def resolve_target(p: Profile, spec: str, image_patterns: list[str]) -> tuple[Target, list[str]]:
    """A procedure name or address range, in the images of the selection (the hottest image
    holding the name; notes name the others)."""
    from cyclescope.report.listing import Target

    profile_set, sym = p.profile_set, p.sym
    totals = p.image_totals()
    keys = _candidate_images(profile_set, image_patterns, totals)
    m = _RANGE_RE.match(spec.strip())
    if m:
        start = int(m.group(1), 16)
        end = int(m.group(2), 16) if m.group(2) else start + int(m.group(3), 0)
        if end <= start:
            raise UsageError(f"empty address range {spec}")
        elf = [k for k in keys if profile_set.images[k].kind in ("elf", "vdso")]
        if len(elf) != 1 and not image_patterns:
            raise UsageError("an address range needs --image (the selection has samples in several images)")
        if not keys:
            raise NotFoundError("no image with samples matches")
        return Target(profile_set.images[keys[0]], spec, start, end), []
    matches: list[tuple[int, ImageInfo, int, int, str]] = []
    for k in keys:
        info = profile_set.images[k]
        table = sym.table(info)
        for i, n in enumerate(table.names):
            if n == spec or (n.startswith(spec + "(") and "(" not in spec):
                matches.append((totals.get(k, 0), info, int(table.starts[i]), int(table.ends[i]), n))
    if not matches:
        names_seen: dict[str, int] = {}
        for k in keys:
            if len(names_seen) < 200000:
                names_seen.update(dict.fromkeys(sym.table(profile_set.images[k]).names, 0))
        close = difflib.get_close_matches(spec, list(names_seen), n=5, cutoff=0.6)
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        where = f" in {', '.join(image_patterns)}" if image_patterns else " in the images with samples"
        raise NotFoundError(f"no procedure named '{spec}'{where}{hint}")
    matches.sort(key=lambda m: -m[0])
    _, info, start, end, name = matches[0]
    notes = [f"'{spec}' is also in {m[1].path} (use --image to choose)" for m in matches[1:4] if m[1].key != info.key]
    return Target(info, name, start, end), notes


def make_listing(p: Profile, target: Target, source_dirs: list[str], with_source: bool, notes: list[str]) -> Listing:
    """DCPI's dcpilist: the target's instructions with their samples per event, source lines and
    inlined calls from DWARF interleaved (``with_source``)."""
    import numpy as np

    from cyclescope.db.query import query_counts
    from cyclescope.images.disasm import disassemble, read_code
    from cyclescope.images.dwarf import DwarfIndex, SourcePos, dwarf_source
    from cyclescope.report.listing import SourceFiles, build_listing, counts_at
    from cyclescope.report.prof import counts_by_image
    from cyclescope.report.summary import summarize

    profile_set, sym = p.profile_set, p.sym
    info = target.info
    events = profile_set.event_names
    all_counts = query_counts(profile_set)
    sel_totals = [0] * len(events)
    for e, c in zip(all_counts.column("event").to_pylist(), all_counts.column("count").to_pylist(), strict=True):
        if e in events:
            sel_totals[events.index(e)] += int(c)
    per_image = counts_by_image(query_counts(profile_set, images=[info.key]))
    off, ev, cnt = per_image.get(info.key, (np.zeros(0, np.uint64), np.zeros(0, object), np.zeros(0, np.int64)))
    off = sym.offsets_to_vaddr(info, off)
    counts = counts_at(events, off, ev, cnt)
    problems = list(notes)
    b = sym.binary(info)
    insns = []
    dwarf_index: DwarfIndex | None = None
    if b.path is not None:
        try:
            insns = disassemble(read_code(b.path, target.start, target.end), target.start)
        except (OSError, Exception) as e:  # DataError or a capstone failure: list counts only
            problems.append(f"cannot read code: {e}")
        if with_source:
            src = dwarf_source(b.path, info.key)
            if src is not None:
                dwarf_index = DwarfIndex(src, info.key)
            else:
                problems.append(f"{info.path}: no DWARF line information (built without -g, or stripped)")
    elif b.problem:
        problems.append(b.problem)
    elif info.kind in ("kernel", "module", "jit"):
        problems.append(f"{info.path}: no code bytes are kept for this image; showing sampled offsets only")
    addrs = np.array([i.address for i in insns], np.uint64)
    positions: list[SourcePos | None] = [None] * len(insns)
    stacks: list[list[Scope]] = [[] for _ in insns]
    if dwarf_index is not None and len(addrs):
        positions = dwarf_index.positions(addrs)
        stacks = _stacks(dwarf_index, addrs, target.start, target.end)
        dwarf_index.close()
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
    lst.summary = summarize(profile_set, dict(zip(events, sel_totals, strict=True)))
    return lst


def _stacks(dwarf_index: DwarfIndex, addrs: np.ndarray, start: int, end: int) -> list[list[Scope]]:
    """Inlined-call stacks per address: each scope marks the sorted addresses it covers."""
    import numpy as np

    cus = dwarf_index.cu_at(addrs)
    hits: list[list[Scope]] = [[] for _ in range(len(addrs))]
    order = np.argsort(addrs, kind="stable")
    sorted_addrs = addrs[order]
    for cu in np.unique(cus[cus >= 0]).tolist():
        for sc in dwarf_index.scopes(int(cu)).items:
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


def make_source_listing(p: Profile, pattern: str, source_dirs: list[str]) -> SourceListing:
    """The source file matching ``pattern`` with the most samples, its lines with their totals."""
    import numpy as np

    from cyclescope.db.query import query_counts
    from cyclescope.images.dwarf import DwarfIndex, dwarf_source
    from cyclescope.report.listing import SourceFiles, build_source_listing
    from cyclescope.report.prof import counts_by_image
    from cyclescope.report.summary import summarize

    profile_set, sym = p.profile_set, p.sym
    events = profile_set.event_names
    per_image = counts_by_image(query_counts(profile_set))
    by_file: dict[str, dict[int, np.ndarray]] = {}
    images_of: dict[str, set[str]] = {}
    sel_totals = dict.fromkeys(events, 0)
    for key, (off, ev, cnt) in per_image.items():
        for e, c in zip(ev.tolist(), cnt.tolist(), strict=True):
            if e in sel_totals:
                sel_totals[e] += int(c)
        info = profile_set.images.get(key)
        if info is None or info.kind not in ("elf", "vdso"):
            continue
        b = sym.binary(info)
        src = dwarf_source(b.path, info.key) if b.path else None
        if src is None:
            continue
        dwarf_index = DwarfIndex(src, info.key)
        off = sym.offsets_to_vaddr(info, off)
        uniq, inv = np.unique(off, return_inverse=True)
        pos = dwarf_index.positions(uniq)
        dwarf_index.close()
        for i, (e, c) in enumerate(zip(ev.tolist(), cnt.tolist(), strict=True)):
            sp = pos[int(inv[i])]
            if sp is None or not _file_matches(sp.file, pattern):
                continue
            lines = by_file.setdefault(sp.file, {})
            a = lines.get(sp.line)
            if a is None:
                a = lines[sp.line] = np.zeros(len(events), np.int64)
            a[events.index(e)] += c
            images_of.setdefault(sp.file, set()).add(info.path)
    if not by_file:
        raise NotFoundError(f"no samples in a source file matching '{pattern}' (is the binary built with -g?)")
    ranked = sorted(by_file, key=lambda f: -sum(int(v[0]) for v in by_file[f].values()))
    chosen = ranked[0]
    files = SourceFiles(source_dirs)
    sl = build_source_listing(chosen, events, by_file[chosen], files.lines(chosen), sorted(images_of[chosen]))
    sl.others = ranked[1:]
    sl.summary = summarize(profile_set, sel_totals)
    return sl


def _file_matches(path: str, pattern: str) -> bool:
    pattern = pattern.rstrip("/")
    return path == pattern or path.endswith("/" + pattern.lstrip("./")) or path.rsplit("/", 1)[-1] == pattern
