"""`cyclescope export`: profiles in the formats other tools read."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import Counter
from typing import Any

import numpy as np

from cyclescope.cli.base import Command, add_selection_options, eprint, open_db, register, selection
from cyclescope.errors import NotFoundError, UsageError

FORMATS = ("collapsed", "speedscope", "pprof")


@register
class Export(Command):
    name = "export"
    help = "write call stacks (or the flat profile) as collapsed stacks, speedscope or pprof"
    description = (
        "Call stacks recorded with `record -g fp` (or `daemon -g fp`), symbolized, in a format other tools\n"
        "read: 'collapsed' (Brendan Gregg's folded stacks, for flamegraph.pl and many viewers),\n"
        "'speedscope' (https://www.speedscope.app) or 'pprof' (gzip-compressed profile.proto with mappings,\n"
        "build-ids, functions and source lines: `go tool pprof -top FILE`). Without recorded stacks, each\n"
        "instruction is a one-frame stack (the flat profile), and a note says so."
    )
    epilog = (
        "examples:\n"
        "  cyclescope record -g fp -- ./prog && cyclescope export collapsed | flamegraph.pl > prog.svg\n"
        "  cyclescope export speedscope -o prog.speedscope.json\n"
        "  cyclescope export pprof -o prog.pb.gz && go tool pprof -top prog.pb.gz\n"
        "notes: stacks come from frame pointers: a function without a frame (a leaf built without\n"
        "-mno-omit-leaf-frame-pointer, most distribution code) hides its caller. --image selects stacks\n"
        "by their leaf's image; --process applies to flat profiles only."
    )

    def add_arguments(self, p: argparse.ArgumentParser) -> None:
        p.add_argument("format", choices=FORMATS, help="output format")
        add_selection_options(p)
        p.add_argument("-o", "--output", metavar="FILE", help="write to FILE (default: standard output)")
        p.add_argument("--offsets", action="store_true",
                       help="name frames procedure+offset instead of merging a procedure's instructions")

    def run(self, args: argparse.Namespace) -> int:
        from cyclescope.db.query import match_images, open_profile, query_counts
        from cyclescope.db.stacks import load_stacks
        from cyclescope.images.registry import ImageInfo
        from cyclescope.images.symbolize import Symbolizer
        from cyclescope.report.export import Stacks, collapsed, named_stacks, speedscope

        db = open_db(args)
        ps = open_profile(db, selection(args))
        images = set(match_images(ps, list(args.image))) if args.image else None
        if args.image and not images:
            raise NotFoundError(f"no image matching {', '.join(args.image)} in the selection")
        sel = load_stacks(db, ps.epochs, list(args.host) or None, images)
        for c in sel.corrupt:
            eprint(f"cyclescope export: skipped {c}")
        infos = dict(ps.images)
        for k, d in sel.images.items():
            infos.setdefault(k, ImageInfo.from_json(d))
        stacks: Stacks = sel.counts
        if not stacks:
            eprint("cyclescope export: no call stacks recorded in the selection (record with -g fp); "
                   "exporting the flat profile as one-frame stacks")
            t = query_counts(ps, images=sorted(images) if images else None)
            stacks = Counter()
            for img, off, ev, c in zip(t.column("image").to_pylist(), t.column("offset").to_pylist(),
                                       t.column("event").to_pylist(), t.column("count").to_pylist(), strict=True):
                stacks[(ev, ((img, int(off)),))] += int(c)
        elif args.process:
            raise UsageError("--process selects flat profiles only: stacks do not record the process")
        sym = Symbolizer(db)
        names: dict[tuple[str, int], str] = {}

        def name(f: tuple[str, int]) -> str:
            n = names.get(f)
            if n is None:
                key, off = f
                info = infos.get(key)
                if info is None:
                    n = "[unknown]"
                else:
                    t = sym.table(info)
                    i = int(t.lookup(np.array([off], np.uint64))[0]) if len(t) else -1
                    base = os.path.basename(info.path) if info.path else key[:12]
                    if i < 0:
                        n = f"{base}+{off:#x}"
                    else:
                        s = int(t.starts[i])
                        n = t.names[i] + (f"+{off - s:#x}" if args.offsets and off != s else "")
                names[f] = n
            return n

        wanted = set(getattr(args, "event", None) or ())
        if wanted:
            stacks = Counter({k: n for k, n in stacks.items() if k[0] in wanted})
            if not stacks:
                raise NotFoundError(f"no samples of {', '.join(sorted(wanted))} in the selection")
        events = sorted({ev for ev, _ in stacks})
        if args.format == "pprof":
            blob = self._pprof(ps, stacks, events, infos, sym, name)
            if not args.output:
                if sys.stdout.isatty():
                    raise UsageError("pprof output is binary: give -o FILE or redirect standard output")
                sys.stdout.buffer.write(blob)
                return 0
            tmp = f"{args.output}.tmp-{os.getpid()}"
            with open(tmp, "wb") as fb:
                fb.write(blob)
            os.replace(tmp, args.output)
            return 0
        if args.format == "collapsed":
            out = collapsed(named_stacks(stacks, name, events[0] if len(events) > 1 else None))
            if len(events) > 1:
                eprint(f"cyclescope export: collapsed stacks of {events[0]} (of {', '.join(events)})")
        else:
            per = {ev: named_stacks(stacks, name, ev) for ev in events}
            title = f"cyclescope epoch {','.join(map(str, ps.epochs))}"
            out = json.dumps(speedscope(per, title), separators=(",", ":")) + "\n"
        if args.output:
            tmp = f"{args.output}.tmp-{os.getpid()}"
            with open(tmp, "w") as f:
                f.write(out)
            os.replace(tmp, args.output)
        else:
            try:
                sys.stdout.write(out)
                sys.stdout.flush()
            except BrokenPipeError:
                pass
        return 0

    @staticmethod
    def _pprof(ps: Any, stacks: Counter[Any], events: list[str], infos: dict[str, Any], sym: Any,
               name: Any) -> bytes:
        """Function, source file and line per frame (DWARF where the binary has it), then the profile."""
        from cyclescope.images.dwarf import DwarfIndex, dwarf_source
        from cyclescope.report.export import pprof

        frames = sorted({f for _, st in stacks for f in st})
        where: dict[tuple[str, int], tuple[str | None, int | None]] = {}
        by_image: dict[str, list[int]] = {}
        for key, off in frames:
            by_image.setdefault(key, []).append(off)
        for key, offs in by_image.items():
            info = infos.get(key)
            if info is None or info.kind != "elf":
                continue
            try:
                b = sym.binary(info)
                path = dwarf_source(b.path, info.key) if b.path else None
                if not path:
                    continue
                pos = DwarfIndex(path, info.key).positions(np.array(offs, np.uint64))
            except Exception as e:  # a damaged or missing debug file: names without lines
                eprint(f"cyclescope export: no source lines for {info.path}: {e}")
                continue
            for off, sp in zip(offs, pos, strict=True):
                if sp is not None:
                    where[(key, off)] = (sp.file, sp.line)
        meta = {k: {"path": i.path, "build_id": i.build_id or "", "size": getattr(i, "size", 0)}
                for k, i in infos.items()}
        period = None
        if events and events[0] in ps.events and ps.events[events[0]].time_based:
            em = ps.events[events[0]]
            if em.samples:
                period = (events[0], int(em.period_sum / em.samples))
        time_ns = int(ps.start_time * 1e9)
        duration = int(max(0.0, ps.end_time - ps.start_time) * 1e9)
        return pprof(stacks, events, meta, lambda f: (name(f), *where.get(f, (None, None))), time_ns, duration,
                     period)
