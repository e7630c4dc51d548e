"""`cyclescope export`: profiles in the formats other tools read."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from cyclescope.app.calc import ESTIMATOR_HELP, ESTIMATORS, PROFILE_ESTIMATOR
from cyclescope.cli.base import Command, add_selection_options, eprint, open_db, open_profile, register
from cyclescope.errors import DataError, NotFoundError, UsageError

if TYPE_CHECKING:

    from cyclescope.app.profile import Profile
    from cyclescope.images.dwarf import DwarfIndex
    from cyclescope.images.elf import SymbolTable
    from cyclescope.report.llvm_sample import FunctionProfile


def _emit(output: str | None, data: bytes) -> None:
    """Write an export to ``output`` (whole or not at all) or to standard output."""
    from cyclescope.db.layout import write_atomic

    if output:
        write_atomic(Path(output), data)
        return
    if data[:2] == b"\x1f\x8b" and sys.stdout.isatty():
        raise UsageError("this format is binary (gzip): give -o FILE, or redirect standard output")
    try:
        buf = getattr(sys.stdout, "buffer", None)  # None when a caller redirected stdout to a StringIO
        if buf is not None:
            sys.stdout.flush()
            buf.write(data)
        else:
            sys.stdout.write(data.decode("utf-8", "surrogateescape"))
        sys.stdout.flush()
    except BrokenPipeError:
        pass


FORMATS = ("collapsed", "speedscope", "pprof", "llvm-sample", "bolt-fdata")


@register
class Export(Command):
    name = "export"
    description = (
        "Call stacks recorded with `record -g fp` (or `daemon -g fp`), symbolized, in a format other tools\n"
        "read: 'collapsed' (Brendan Gregg's folded stacks, for flamegraph.pl and many viewers),\n"
        "'speedscope' (https://www.speedscope.app) or 'pprof' (gzip-compressed profile.proto with mappings,\n"
        "build-ids, functions and source lines: `go tool pprof -top FILE`). Without recorded stacks, each\n"
        "instruction is a one-frame stack (the flat profile), and a note says so.\n\n"
        "'llvm-sample' writes LLVM's text sample profile of one image for clang -fprofile-sample-use:\n"
        "execution counts per source line estimated by `calc` from the samples (no branch records\n"
        "needed; --counts samples takes raw samples instead, --callgrind exact counts), nested profiles\n"
        "for inlined code, call targets from the direct calls. Build with -g (and\n"
        "-fdebug-info-for-profiling for discriminators), and rebuild with LLVM's profile inference\n"
        "(clang 14+: -mllvm -sample-profile-use-profi), which makes the most of counts from samples;\n"
        "`llvm-profdata show --sample FILE` reads it. Where the selection (or --edges-from DB) holds the\n"
        "branch outcomes of sampled paths (`record --values edges --exact interpret --interpret 32`),\n"
        "each function's block counts follow the branch probabilities they show (calc's split where a\n"
        "branch was not seen), scaled to calc's total for the function.\n\n"
        "'bolt-fdata' writes BOLT's profile without branch records (as `perf2bolt -nl`): samples per\n"
        "instruction of one image, by function symbol and offset, for llvm-bolt -data=FILE (link the\n"
        "program with -Wl,--emit-relocs for BOLT to reorder its blocks and functions)."
    )
    epilog = (
        "examples:\n"
        "  cyclescope record -g fp -- ./prog && cyclescope export collapsed | flamegraph.pl > prog.svg\n"
        "  cyclescope export speedscope -o prog.speedscope.json\n"
        "  cyclescope export pprof -o prog.pb.gz && go tool pprof -top prog.pb.gz\n"
        "  cyclescope export llvm-sample --image ./prog -o prog.prof\n"
        "      && clang -O2 -g -fprofile-sample-use=prog.prof -mllvm -sample-profile-use-profi ...\n"
        "  cyclescope export bolt-fdata --image ./prog -o prog.fdata && llvm-bolt-16 prog -o prog.bolt \\\n"
        "      -data=prog.fdata -reorder-blocks=ext-tsp -reorder-functions=hfsort\n"
        "notes: with -g fp, a function without a frame (most distribution code) hides its caller; -g dwarf\n"
        "unwinds with .eh_frame instead. --image selects stacks by their leaf's image, --process by the\n"
        "command sampled (stacks recorded before this release have none: --process leaves them out)."
    )

    def add_arguments(self, p: argparse.ArgumentParser) -> None:
        p.add_argument("format", choices=FORMATS, help="output format")
        add_selection_options(p)
        p.add_argument("-o", "--output", metavar="FILE", help="write to FILE (default: standard output)")
        p.add_argument("--counts", choices=("calc", "samples"), default="calc",
                       help="llvm-sample: execution counts estimated by calc (default), or raw samples per "
                            "instruction (AutoFDO without branch records)")
        p.add_argument("--estimator", choices=ESTIMATORS, default=PROFILE_ESTIMATOR,
                       help="llvm-sample with --counts calc: " + ESTIMATOR_HELP + f" (default: {PROFILE_ESTIMATOR})")
        p.add_argument("--callgrind", metavar="FILE",
                       help="llvm-sample: exact counts from `valgrind --tool=callgrind --dump-instr=yes` output "
                            "instead (the recorded samples then only choose the binary)")
        p.add_argument("--edges-from", metavar="DB",
                       help="llvm-sample with --counts calc: branch outcomes of sampled paths (value sampling's "
                            "edges module) from this database, all epochs (default: the selection's own, when "
                            "it has them)")
        p.add_argument("--no-edges", action="store_true",
                       help="llvm-sample: calc's counts alone, even where branch outcomes were recorded")
        p.add_argument("--offsets", action="store_true",
                       help="name frames procedure+offset instead of merging a procedure's instructions")

    def run(self, args: argparse.Namespace) -> int:
        from cyclescope.app.stacks import FLAT_NOTE, export_stacks, select_stacks

        db = open_db(args)
        prof = open_profile(args, db)
        if args.format == "llvm-sample":
            return self._llvm_sample(args, prof)
        if args.format == "bolt-fdata":
            return self._bolt_fdata(args, prof)
        if args.format == "pprof" and not args.output and sys.stdout.isatty():
            raise UsageError("pprof output is binary: give -o FILE or redirect standard output")
        sel = select_stacks(prof, list(args.image), list(getattr(args, "event", None) or ()))
        for c in sel.corrupt:
            eprint(f"cyclescope export: skipped {c}")
        if sel.flat:
            eprint(f"cyclescope export: {FLAT_NOTE}")
        _emit(args.output, export_stacks(prof, args.format, sel, args.offsets,
                                         lambda m: eprint(f"cyclescope export: {m}")))
        return 0

    @staticmethod
    def _llvm_sample(args: argparse.Namespace, prof: Profile) -> int:
        from cyclescope.app.calc import cycles_event
        from cyclescope.app.counts import branch_outcomes, calc_counts, one_binary, sample_counts
        from cyclescope.app.prof import prof_report
        from cyclescope.images.dwarf import DwarfIndex, dwarf_source
        from cyclescope.images.elf import read_symbols
        from cyclescope.report.llvm_sample import render

        ev = cycles_event(prof, getattr(args, "event", None) and args.event[0])
        report = prof_report(prof)
        _, info, b = one_binary(prof, report, list(args.image), args.format)
        assert b.path is not None
        dpath = dwarf_source(b.path, info.key)
        if dpath is None:
            raise NotFoundError(f"{info.path}: no DWARF line information (build with -g)")
        dwarf_index = DwarfIndex(dpath, info.key)
        raw = read_symbols(b.path, demangle=False)  # compilers know functions by their linkage names
        heads: dict[int, int] | None  # entry counts by function; None: the entry instruction's count
        if args.callgrind:
            counts = _callgrind_counts(args.callgrind, info.path)
            per_fn, heads, source = _by_function(raw, counts), None, f"exact counts from {args.callgrind}"
        elif args.counts == "samples":
            counts = sample_counts(prof, info, ev)
            per_fn, heads, source = _by_function(raw, counts), {}, f"{ev} samples per instruction"
        else:
            edges = None if args.no_edges else branch_outcomes(prof, info, args.edges_from)
            kept: list[tuple[str, int, int]] = []
            per_fn, heads, skipped = calc_counts(prof, info, ev, report, args.estimator, edges, kept)
            for msg in skipped:
                eprint(f"cyclescope export: skipped {msg}")
            source = f"execution counts estimated by calc from {ev} samples, {args.estimator} estimator"
            if edges:
                seen = round(sum(sum(d.values()) for d in edges.values()))
                source += f"; blocks shaped by {seen:,} branch outcomes on sampled paths at {len(edges):,} branches"
            if any(k for _, k, _ in kept):
                # Where the flow gives no count (loops no path saw end, code no edge of positive
                # probability reaches), calc's counts stay: say how much, and where most.
                share = sum(k for _, k, _ in kept) / max(1, sum(t for _, _, t in kept))
                top = sorted((x for x in kept if x[1]), key=lambda x: -x[1])
                names = ", ".join(f"{n} {100 * k / t:.0f}%" for n, k, t in top[:3]) + (", ..." if len(top) > 3 else "")
                source += (f"; calc's counts kept for {100 * share:.0f}% of the shaped functions' count where "
                           f"the flow gives none (of each: {names})")
        profiles = [p for p in (_profile_of(b.path, dwarf_index, raw, start, c, heads) for start, c in per_fn.items())
                    if p]
        if not any(p.total for p in profiles):
            raise NotFoundError(f"{info.path}: no execution counts for any function with source lines"
                                + (" (see `cyclescope calc`)" if not args.callgrind and args.counts == "calc" else ""))
        _emit(args.output, render(profiles).encode())
        eprint(f"cyclescope export: {sum(1 for p in profiles if p.total)} functions of {info.path} ({source})")
        return 0

    @staticmethod
    def _bolt_fdata(args: argparse.Namespace, prof: Profile) -> int:
        from cyclescope.app.calc import cycles_event
        from cyclescope.app.counts import event_counts, one_binary
        from cyclescope.app.prof import prof_report
        from cyclescope.images.elf import local_function_files, read_symbols
        from cyclescope.report.bolt_fdata import bolt_names, render

        ev = cycles_event(prof, getattr(args, "event", None) and args.event[0])
        key, info, b = one_binary(prof, prof_report(prof), list(args.image), args.format)
        assert b.path is not None
        raw = read_symbols(b.path, demangle=False)  # BOLT knows functions by their linkage names
        offs, counts = event_counts(prof, key, ev)
        names = bolt_names(raw.starts, raw.names, local_function_files(b.path))
        res = render([ev], offs, counts, raw.starts, raw.ends, names)
        if not res.samples:
            raise NotFoundError(f"{info.path}: no {ev} samples in its functions")
        _emit(args.output, res.text.encode())
        note = f"; {res.outside} samples outside every function symbol left out" if res.outside else ""
        note += f"; {res.plt} samples in PLT stubs left out (BOLT keeps no profile for them)" if res.plt else ""
        eprint(f"cyclescope export: {res.samples:,} {ev} samples in {res.functions:,} functions of {info.path}{note}")
        return 0


def _by_function(raw: SymbolTable, counts: dict[int, int]) -> dict[int, dict[int, int]]:
    """Instruction counts (ELF address -> count) grouped by the function symbol containing them."""
    out: dict[int, dict[int, int]] = {}
    if not counts or not len(raw):
        return out
    addrs = np.array(sorted(counts), np.uint64)
    idx = raw.lookup(addrs)
    for a, i in zip(addrs.tolist(), idx.tolist(), strict=True):
        if i >= 0:
            out.setdefault(int(raw.starts[i]), {})[a] = counts[a]
    return out


def _callgrind_counts(path: str, image_path: str) -> dict[int, int]:
    """Exact executions per instruction of one binary from callgrind's output (--dump-instr=yes)."""
    from cyclescope.analysis.callgrind import parse_callgrind

    try:
        with open(path, errors="replace") as f:
            prof = parse_callgrind(f.read())
    except OSError as e:
        raise NotFoundError(f"{path}: {e.strerror}") from None
    except (ValueError, IndexError):
        raise DataError(f"{path}: not callgrind's output (run valgrind --tool=callgrind --dump-instr=yes)") from None
    ob = prof.object_for(image_path) or prof.object_for(os.path.basename(image_path))
    if ob is None:
        raise NotFoundError(f"{path}: no counts for {image_path} (objects: {', '.join(sorted(prof.counts)) or 'none'}; "
                            "run valgrind --tool=callgrind --dump-instr=yes)")
    return dict(prof.counts[ob])


def _profile_of(path: str, dwarf_index: DwarfIndex, raw: SymbolTable, start: int, counts: dict[int, int],
                heads: dict[int, int] | None) -> FunctionProfile | None:
    """The profile of the function at ``start`` from its instructions' counts (None without source lines).
    ``heads``: entry counts by function, or None to take the entry instruction's own count."""
    from cyclescope.images.disasm import disassemble, read_code
    from cyclescope.images.dwarf import Scopes
    from cyclescope.report.llvm_sample import Executed, function_profile

    i = int(raw.lookup(np.array([start], np.uint64))[0])
    cu = int(dwarf_index.cu_at(np.array([start], np.uint64))[0])
    if i < 0 or cu < 0:
        return None
    end, name = int(raw.ends[i]), raw.names[i]
    cu_scopes = dwarf_index.scopes(cu)
    at_start = cu_scopes.stack_at(start)
    if not at_start or at_start[0].inlined:
        return None  # no DWARF subprogram here (assembly, or code without -g)
    inlined = Scopes(tuple(s for s in cu_scopes.items if s.inlined and s.low < end and s.high > start))
    try:
        insns = disassemble(read_code(path, start, end), start)
    except Exception:  # the symbol's bytes are not in the file: count without call targets
        insns = []
    callee_of: dict[int, str] = {}
    for ins in insns:
        t = ins.direct_target if ins.mnemonic.startswith("call") else None
        if t is not None:
            j = int(raw.lookup(np.array([t], np.uint64))[0])
            if j >= 0 and int(raw.starts[j]) == t:
                callee_of[ins.address] = raw.names[j]
    addrs = sorted(a for a, c in counts.items() if c > 0)
    pos = dwarf_index.positions(np.array(addrs, np.uint64))
    executed = []
    for a, p in zip(addrs, pos, strict=True):
        if p is None:
            continue
        executed.append(Executed(counts[a], p.line, p.discriminator, inlined.stack_at(a), callee_of.get(a)))
    head = counts.get(start, 0) if heads is None else heads.get(start, 0)
    return function_profile(name, at_start[0].line, executed, head)
