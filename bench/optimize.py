"""The optimization loop: clang with cyclescope's sample profile against no profile and against
instrumented PGO (the upper anchor).

Per program, three builds with clang-14 -O2 -g -fdebug-info-for-profiling:
  base     no profile
  sample   -fprofile-sample-use with `cyclescope export llvm-sample` of a training run at 5 kHz
           (execution counts estimated by calc from timer samples: no branch records)
  instr    -fprofile-instr-use with the profile of a -fprofile-instr-generate build's training run
The three run alternately, rotating the order, for --runs rounds on the training input itself
(the usual AutoFDO/PGO set-up when comparing profile sources). Reported: CPU-time speedups over
base per round (median [quartiles]) and the share of instrumented PGO's gain that the sample
profile reaches: (speedup_sample - 1) / (speedup_instr - 1). AutoFDO reports 85% with branch records.

Programs from Debian sources (bench/suite.py fetches and configures them): bzip2 (one clang
command), gzip, xz (statically linked liblzma) and zlib's minigzip (their configured trees are
copied and rebuilt with `make CC=clang-14 CFLAGS=...` per variant); and our own: the demo workload,
bench/workload.c and tests/programs/kernels.c. The Debian programs compress bench/out/suite/input.txt
(6 MB of Python sources).

Usage: python bench/optimize.py [--runs 5] [--programs bzip2,gzip,xz,zlib,demo,workload,kernels]
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from common import ROOT, fmt_spread, machine, median, save

sys.path.insert(0, str(ROOT / "src"))
from cyclescope.cli.optimize import run_cpu

CLANG = shutil.which("clang-14") or "clang"
PROFDATA = shutil.which("llvm-profdata-14") or "llvm-profdata"
FLAGS = "-O2 -g -fdebug-info-for-profiling"
SUITE = ROOT / "bench" / "out" / "suite"


# name -> (configured source tree, binary built there, make target, run argv with {exe})
MADE = {
    "gzip": ("gzip-1.12", "gzip", "all", ["{exe}", "-c", "-6", "{input}"]),
    "xz": ("xz-utils-5.4.1", "src/xz/xz", "all", ["{exe}", "-c", "-3", "-T1", "{input}"]),
    "zlib": ("zlib-1.2.13.dfsg", "minigzip", "minigzip", ["{exe}", "-c", "-6", "{input}"]),
}
NOREGEN = ["ACLOCAL=:", "AUTOCONF=:", "AUTOMAKE=:", "AUTOHEADER=:", "MAKEINFO=:", "AUTOPOINT=:"]


def make_builder(name: str, work: Path) -> Any:
    """A build function for a configured autotools/zlib tree: a private copy, rebuilt per variant."""
    tree, binary, target, _ = MADE[name]
    src = work / "tree"
    shutil.copytree(SUITE / "src" / tree, src, symlinks=True)

    def build(out: Path, extra: str) -> Path:
        subprocess.run(["make", "-s", "clean", *NOREGEN], cwd=src, stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL)
        sh(["make", "-s", "-j2", *NOREGEN, f"CC={CLANG}", f"CFLAGS={FLAGS} {extra}", target], cwd=src)
        shutil.copy(src / binary, out)
        return out

    return build


def programs() -> dict[str, tuple[list[str], list[str], str | None]]:
    """name -> (sources, run argv with {exe}, stdin file); sources [] for the MADE programs."""
    bz = SUITE / "src" / "bzip2-1.0.8"
    inp = str(SUITE / "input.txt")
    made = {n: ([], [a.replace("{input}", inp) for a in m[3]], None) for n, m in MADE.items()}
    return {
        **made,
        "bzip2": ([str(bz / f) for f in ("blocksort.c", "huffman.c", "crctable.c", "randtable.c", "compress.c",
                                         "decompress.c", "bzlib.c", "bzip2.c")], ["{exe}", "-c", "-9", inp], None),
        "demo": ([str(ROOT / "src" / "cyclescope" / "demo" / "workload.c")], ["{exe}", "1.0"], None),
        "workload": ([str(ROOT / "bench" / "workload.c")], ["{exe}", "3"], None),
        "kernels": ([str(ROOT / "tests" / "programs" / "kernels.c")], ["{exe}"], None),
    }


def sh(cmd: list[str], **kw: Any) -> subprocess.CompletedProcess[str]:
    """Run ``cmd`` (its output discarded, its errors kept for the message)."""
    r = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, **kw)
    if r.returncode != 0:
        raise RuntimeError(f"{shlex.join(cmd)}: {r.stderr[-600:]}")
    return r


def cpu_of(argv: list[str]) -> float:
    return run_cpu(argv, None)[0]  # the same measurement `cyclescope optimize` makes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--programs", default="bzip2,gzip,xz,zlib,demo,workload,kernels")
    ap.add_argument("--save-as", default="optimize", help="name of the raw data file in bench/out/")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="cs-bench-opt-"))
    cs = [sys.executable, "-m", "cyclescope"]
    results: dict[str, Any] = {}
    for name in args.programs.split(","):
        srcs, run_argv, _ = programs()[name]
        needed = [SUITE / "src" / MADE[name][0]] if name in MADE else [Path(s) for s in srcs]
        if not all(p.exists() for p in needed):
            print(f"skipping {name}: sources missing (run bench/suite.py)", file=sys.stderr)
            continue
        d = work / name
        d.mkdir()

        def argv(exe: Path, run_argv: list[str] = run_argv) -> list[str]:
            return [a.replace("{exe}", str(exe)) for a in run_argv]

        def build_one(out: Path, extra: str, srcs: list[str] = srcs) -> Path:
            sh([CLANG, *shlex.split(FLAGS), *shlex.split(extra), "-o", str(out), *srcs, "-lm"])
            return out

        build = make_builder(name, d) if name in MADE else build_one
        print(f"{name}: building", flush=True)

        base = build(d / "base", "")
        # Sample profile: a training run of the base build under cyclescope.
        sh([*cs, "record", "--db", str(d / "db"), "-q", "--", *argv(base)])
        sh([*cs, "export", "llvm-sample", "--db", str(d / "db"), "--image", str(base), "-o", str(d / "s.prof")])
        sample = build(d / "sample", f"-fprofile-sample-use={d / 's.prof'}")
        # Instrumented PGO.
        gen = build(d / "gen", "-fprofile-instr-generate")
        sh(argv(gen), env={**os.environ, "LLVM_PROFILE_FILE": str(d / "i.profraw")})
        sh([PROFDATA, "merge", "-o", str(d / "i.profdata"), str(d / "i.profraw")])
        instr = build(d / "instr", f"-fprofile-instr-use={d / 'i.profdata'}")
        cons = [("base", base), ("sample", sample), ("instr", instr)]
        cpu: dict[str, list[float]] = {c: [] for c, _ in cons}
        for rnd in range(args.runs):
            order = cons[rnd % 3:] + cons[: rnd % 3]
            for c, exe in order:
                cpu[c].append(cpu_of(argv(exe)))
            print(f"{name} round {rnd}: " + ", ".join(f"{c} {cpu[c][-1]:.3f} s" for c, _ in cons), flush=True)
        sp_s = [b / s for b, s in zip(cpu["base"], cpu["sample"], strict=True)]
        sp_i = [b / i for b, i in zip(cpu["base"], cpu["instr"], strict=True)]
        share = (median(sp_s) - 1) / (median(sp_i) - 1) if median(sp_i) > 1.005 else None
        results[name] = {"cpu": cpu, "speedup_sample": sp_s, "speedup_instr": sp_i, "share": share}
    print(f"\nclang-14 {FLAGS}; speedup over the unprofiled build, median [quartiles] of {args.runs} rounds\n")
    print(f"{'program':<10} {'base CPU s':>12} {'sample-PGO':>24} {'instr-PGO':>24} {'share of instr gain':>20}")
    for name, r in results.items():
        sh_ = "n/a (no gain)" if r["share"] is None else f"{100 * r['share']:.0f}%"
        print(f"{name:<10} {median(r['cpu']['base']):>12.3f} {fmt_spread(r['speedup_sample'], 'x'):>24} "
              f"{fmt_spread(r['speedup_instr'], 'x'):>24} {sh_:>20}")
    path = save(args.save_as, {"machine": machine(), "args": vars(args), "results": results})
    print(f"\ntarget: at least 85% of instrumented PGO's gain; raw data: {path}")


if __name__ == "__main__":
    main()
