"""The optimization loop: clang with cyclescope's sample profiles against no profile and against
instrumented PGO (the upper anchor).

Per program, builds with clang-14 -O2 -g -gdwarf-4 -fdebug-info-for-profiling (DWARF 4 because
valgrind 3.19 cannot read clang-14's DWARF 5):
  base       no profile
  calc       -fprofile-sample-use with `cyclescope export llvm-sample` of a training run at 5 kHz:
             execution counts estimated by calc from timer samples (no branch records)
  samples    the same with --counts samples: raw samples per instruction (AutoFDO without branch
             records)
  callgrind  the same with --callgrind: exact counts of a valgrind run, the best any profile of this
             form (line counts, nested inline profiles) can do
  instr      -fprofile-instr-use with the profile of a -fprofile-instr-generate build's training run
  calc-EST   calc with `--estimator EST`: dcpi (DCPI's smallest-ratio rule for stalled classes) or
             geomean (its geometric mean with the class's sum S / sum M; export's default since
             bench/out/optimize_estimators, so that plain `calc` is geomean from then on)
  paths      calc's estimates shaped by the branch outcomes of sampled paths: the training run
             again, as often, under `record --values edges --exact interpret --interpret 32` at
             1 kHz (the thread stopped and the next 32 instructions interpreted from its exact
             state; analysis/paths.py), exported with --edges-from
  SRC+profi  any of the sample profiles above, with LLVM's profile inference (-mllvm
             -sample-profile-use-profi: block and edge counts made consistent by min-cost flow,
             "profi", in place of clang's older weight propagation)
All run alternately, rotating the order, for --runs rounds on the training input itself (the
usual AutoFDO/PGO set-up when comparing profile sources). Reported: the CPU-time speedup over base
per round, median with a distribution-free 95% confidence interval of the median, and the share of
instrumented PGO's gain each profile reaches: (speedup - 1) / (speedup_instr - 1) (AutoFDO
reports 85% with branch records). Also, timing-free: llvm-profdata's overlap of each profile with
the exact-count one (similarity of normalized line counts, hot-block overlap), and (--simulate, on
by default) one run of each build under valgrind's cachegrind with its cache and branch simulation:
instructions, I1/D1 and LL misses and branch mispredictions, combined as KCachegrind's cycle
estimate CEst = Ir + 10 Bm + 10 L1m + 100 LLm. That figure is deterministic, so it answers what
the timings of this noisy VM cannot: which profile helps, and by how much of instrumented PGO's
gain, on a model machine (not this CPU: no measured latencies, a simple branch predictor).

Programs from Debian sources (bench/suite.py fetches and configures them): bzip2 (one clang
command), gzip, xz (statically linked liblzma) and zlib's minigzip (their configured trees are
copied and rebuilt with `make CC=clang-14 CFLAGS=...` per variant), each compressing the first
INPUT_MB megabytes of bench/out/suite/input.txt (Python sources); and our own (--programs): the
demo workload, bench/workload.c and tests/programs/kernels.c. Two programs where instrumented PGO
gains clearly, unlike the compressors: Lua 5.4's interpreter running bench/programs/workload.lua
(allocation and the collector, table loops, floating point, method calls, string patterns) and
SQLite's shell (its amalgamation) running bench/programs/workload.sql in memory (inserts, index
builds, joins, aggregates, sorting); both compiled with one clang command like bzip2.

Usage: python bench/optimize.py [--runs 31] [--programs bzip2,gzip,xz,zlib,lua,sqlite] [--train-runs N]
                                [--repeat R]
                                [--sources calc,samples,callgrind,calc+profi,calc-dcpi+profi]
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from common import ROOT, fmt_ci, machine, median, save
from suite import LUA_FLAGS, LUA_SOURCES, SQLITE_FLAGS

sys.path.insert(0, str(ROOT / "src"))
from cyclescope.cli.optimize import run_cpu

CLANG = shutil.which("clang-14") or "clang"
PROFDATA = shutil.which("llvm-profdata-14") or "llvm-profdata"
FLAGS = "-O2 -g -gdwarf-4 -fdebug-info-for-profiling"  # DWARF 4: valgrind 3.19 cannot read clang-14's DWARF 5
SUITE = ROOT / "bench" / "out" / "suite"


# Megabytes of bench/out/suite/input.txt each program compresses: runs of about 0.1-0.3 s, so that
# many alternated rounds fit (this VM's run-to-run noise is 10-30%; the rounds' ratios average it).
INPUT_MB = {"bzip2": 2, "gzip": 6, "xz": 1, "zlib": 6}

# name -> (configured source tree, binary built there, make target, run argv with {exe})
MADE = {
    "gzip": ("gzip-1.12", "gzip", "all", ["{exe}", "-c", "-6", "{input}"]),
    "xz": ("xz-utils-5.4.1", "src/xz/xz", "all", ["{exe}", "-c", "-3", "-T1", "{input}"]),
    "zlib": ("zlib-1.2.13.dfsg", "minigzip", "minigzip", ["{exe}", "-c", "-6", "{input}"]),
}
NOREGEN = ["ACLOCAL=:", "AUTOCONF=:", "AUTOMAKE=:", "AUTOHEADER=:", "MAKEINFO=:", "AUTOPOINT=:"]


def make_builder(name: str, work: Path, fresh: bool = True) -> Any:
    """A build function ``build(out, extra flags) -> out`` for program ``name`` in its work directory
    ``work``: one clang command, or for a configured autotools/zlib tree a private copy in
    work/tree (made unless ``fresh`` is False: a kept work directory's), rebuilt per variant."""
    if name not in MADE:
        srcs, _, more = programs()[name]

        def build_one(out: Path, extra: str) -> Path:
            sh([CLANG, *shlex.split(FLAGS), *shlex.split(extra), "-o", str(out), *srcs, *more])
            return out

        return build_one
    tree, binary, target, _ = MADE[name]
    src = work / "tree"
    if fresh:
        shutil.copytree(SUITE / "src" / tree, src, symlinks=True)

    def build(out: Path, extra: str) -> Path:
        subprocess.run(["make", "-s", "clean", *NOREGEN], cwd=src, stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL)
        sh(["make", "-s", "-j2", *NOREGEN, f"CC={CLANG}", f"CFLAGS={FLAGS} {extra}", target], cwd=src)
        shutil.copy(src / binary, out)
        return out

    return build


def programs() -> dict[str, tuple[list[str], list[str], list[str]]]:
    """name -> (sources, run argv with {exe}, further compile and link arguments); sources [] for the
    MADE programs."""
    bz = SUITE / "src" / "bzip2-1.0.8"
    lua = next(iter(sorted((SUITE / "src").glob("lua5.4-*/src"))), SUITE / "src" / "lua5.4" / "src")
    sq = next(iter(sorted(p for p in (SUITE / "src").glob("sqlite3-*") if p.is_dir())), SUITE / "src" / "sqlite3")
    progs = ROOT / "bench" / "programs"

    def inp(name: str) -> str:
        full = SUITE / "input.txt"
        if not full.exists():
            return str(full)
        part = SUITE / f"input-{INPUT_MB[name]}mb.txt"
        if not part.exists():
            part.write_bytes(full.read_bytes()[: INPUT_MB[name] << 20])
        return str(part)

    made = {n: ([], [a.replace("{input}", inp(n)) for a in m[3]], []) for n, m in MADE.items()}
    return {
        **made,
        "bzip2": ([str(bz / f) for f in ("blocksort.c", "huffman.c", "crctable.c", "randtable.c", "compress.c",
                                         "decompress.c", "bzlib.c", "bzip2.c")], ["{exe}", "-c", "-9", inp("bzip2")],
                  ["-lm"]),
        # An interpreter and a database engine: programs where instrumented PGO gains clearly (6% and
        # more in the cachegrind model), unlike the compressors.
        "lua": ([str(lua / f) for f in LUA_SOURCES], ["{exe}", str(progs / "workload.lua")],
                [*LUA_FLAGS, "-lm", "-ldl"]),
        "sqlite": ([str(sq / "sqlite3.c"), str(sq / "shell.c")],
                   ["{exe}", ":memory:", f".read {progs / 'workload.sql'}"], [*SQLITE_FLAGS, f"-I{sq}", "-lm"]),
        "demo": ([str(ROOT / "src" / "cyclescope" / "demo" / "workload.c")], ["{exe}", "1.0"], ["-lm"]),
        "workload": ([str(ROOT / "bench" / "workload.c")], ["{exe}", "3"], ["-lm"]),
        "kernels": ([str(ROOT / "tests" / "programs" / "kernels.c")], ["{exe}"], ["-lm"]),
    }


def sh(cmd: list[str], **kw: Any) -> subprocess.CompletedProcess[str]:
    """Run ``cmd`` (its output discarded, its errors kept for the message)."""
    r = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, **kw)
    if r.returncode != 0:
        raise RuntimeError(f"{shlex.join(cmd)}: {r.stderr[-600:]}")
    return r


def overlap(base: Path, test: Path) -> dict[str, float]:
    """llvm-profdata's comparison of two sample profiles: similarity of the normalized line counts
    and the overlap of their hot blocks, in percent."""
    out = subprocess.run([PROFDATA, "overlap", "--sample", str(base), str(test)], capture_output=True, text=True,
                         check=True).stdout

    def pct(label: str) -> float:
        m = re.search(label + r":\s*([\d.]+)%", out)
        return float(m.group(1)) if m else float("nan")

    return {"similarity": pct("Whole program profile similarity"), "hot_blocks": pct("Hot-block overlap")}


_CG = {"Ir": r"I\s+refs:\s+([\d,]+)", "I1m": r"I1\s+misses:\s+([\d,]+)", "D1m": r"D1\s+misses:\s+([\d,]+)",
       "LLm": r"LL misses:\s+([\d,]+)", "Bc": r"Branches:\s+([\d,]+)", "Bm": r"Mispredicts:\s+([\d,]+)"}


def simulate(argv: list[str]) -> dict[str, int]:
    """One run under cachegrind (cache and branch simulation): its event totals and KCachegrind's
    cycle estimate CEst = Ir + 10 Bm + 10 L1m + 100 LLm."""
    r = sh(["valgrind", "--tool=cachegrind", "--cache-sim=yes", "--branch-sim=yes",
            "--cachegrind-out-file=/dev/null", *argv])
    out = {}
    for k, pat in _CG.items():
        m = re.search(pat, r.stderr)
        if not m:
            raise RuntimeError(f"cachegrind printed no {k}: {r.stderr[-400:]}")
        out[k] = int(m.group(1).replace(",", ""))
    out["CEst"] = out["Ir"] + 10 * out["Bm"] + 10 * (out["I1m"] + out["D1m"]) + 100 * out["LLm"]
    return out


def cpu_of(argv: list[str], cpu: int | None = None) -> float:
    return run_cpu(argv, None, cpu)[0]  # the same measurement `cyclescope optimize` makes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=31)
    ap.add_argument("--programs", default="bzip2,gzip,xz,zlib,lua,sqlite")
    ap.add_argument("--save-as", default="optimize", help="name of the raw data file in bench/out/ (.json added)")
    ap.add_argument("--sources", default="calc,samples,callgrind",
                    help="count sources of the sample profiles compared (export llvm-sample --counts calc|samples, "
                         "or callgrind: exact counts from a valgrind run, the anchor for the profile's form)")
    ap.add_argument("--train-runs", type=int, default=1, metavar="N",
                    help="record the training run N times into the profile (more samples: a run of 0.2-0.5 s "
                         "at 5 kHz gives 1,000-2,500; a continuous profiler would see the program many times)")
    ap.add_argument("--repeat", type=int, default=1, metavar="R",
                    help="under cachegrind, each sample profile from R independent recordings (fresh training runs, "
                         "new profile, new build): the spread of its share of instrumented PGO's gain")
    ap.add_argument("--cpu", type=int, default=None,
                    help="time every build on this CPU only (2-3 times narrower intervals here: bench/retime.py)")
    ap.add_argument("--no-simulate", dest="simulate", action="store_false",
                    help="skip the deterministic comparison under cachegrind")
    args = ap.parse_args()
    sources = args.sources.split(",")
    work = Path(tempfile.mkdtemp(prefix="cs-bench-opt-"))
    cs = [sys.executable, "-m", "cyclescope"]
    results: dict[str, Any] = {}
    for name in args.programs.split(","):
        srcs, run_argv, _ = programs()[name]
        needed = [SUITE / "src" / MADE[name][0]] if name in MADE else [Path(s) for s in srcs]
        if not all(p.exists() for p in needed):
            print(f"skipping {name}: sources missing (run bench/suite.py {name})", file=sys.stderr)
            continue
        d = work / name
        d.mkdir()

        def argv(exe: Path, run_argv: list[str] = run_argv) -> list[str]:
            return [a.replace("{exe}", str(exe)) for a in run_argv]

        build = make_builder(name, d)
        print(f"{name}: building", flush=True)

        base = build(d / "base", "")

        def train(where: Path, base: Path = base) -> None:
            """Training runs of the base build under cyclescope: the input run N times into one epoch
            (and as many runs with sampled paths, for the paths source)."""
            for t in range(args.train_runs):
                sh([*cs, "record", "--db", str(where / "db"), "-q", *(["--append"] if t else []), "--", *argv(base)])
            for t in range(args.train_runs if any(s.startswith("paths") for s in sources) else 0):
                sh([*cs, "record", "--db", str(where / "paths"), "-q", *(["--append"] if t else []), "-F", "1000",
                    "--values", "edges", "--exact", "interpret", "--interpret", "32", "--", *argv(base)])

        def profiled(where: Path, src: str, base: Path = base, d: Path = d, build: Any = build) -> Path:
            """The build with the sample profile of ``src`` (a count source, +profi for profile inference),
            exported from where/db (or from d/cg.out: exact counts)."""
            counts, _, variant = src.partition("+")
            kind, _, estimator = counts.partition("-")  # calc-dcpi: calc with --estimator dcpi
            how = (["--callgrind", str(d / "cg.out")] if counts == "callgrind"
                   else ["--counts", "calc", "--edges-from", str(where / "paths")] if kind == "paths"
                   else ["--counts", kind, *(["--estimator", estimator] if estimator else [])])
            prof = where / f"{counts}.prof"
            if not prof.exists():
                sh([*cs, "export", "llvm-sample", "--db", str(where / "db"), "--image", str(base), *how, "-o",
                    str(prof)])
            extra = " -mllvm -sample-profile-use-profi" if variant == "profi" else ""
            return build(where / src.replace("+", "-"), f"-fprofile-sample-use={prof}{extra}")

        train(d)
        if "callgrind" in sources:
            sh(["valgrind", "--tool=callgrind", "--dump-instr=yes", f"--callgrind-out-file={d / 'cg.out'}",
                *argv(base)])
        cons = [("base", base), *((src, profiled(d, src)) for src in sources)]
        # Instrumented PGO.
        gen = build(d / "gen", "-fprofile-instr-generate")
        sh(argv(gen), env={**os.environ, "LLVM_PROFILE_FILE": str(d / "i.profraw")})
        sh([PROFDATA, "merge", "-o", str(d / "i.profdata"), str(d / "i.profraw")])
        cons.append(("instr", build(d / "instr", f"-fprofile-instr-use={d / 'i.profdata'}")))
        # How close each profile is to the one made from exact counts (deterministic, unlike the timings).
        similarity = {src: overlap(d / "callgrind.prof", d / f"{src}.prof") for src in sources
                      if "+" not in src and src != "callgrind" and "callgrind" in sources}
        sim = {}
        if args.simulate:
            for c, exe in cons:
                sim[c] = simulate(argv(exe))
                print(f"{name} under cachegrind: {c} CEst {sim[c]['CEst']:,} (Ir {sim[c]['Ir']:,}, "
                      f"mispredicts {sim[c]['Bm']:,})", flush=True)
        # Fresh recordings: the same configuration again from new training runs (the model run is
        # deterministic, the samples are not), for the spread of each sample profile's share.
        reps: dict[str, list[int]] = {c: [sim[c]["CEst"]] for c in sources if c in sim}
        for report in range(1, args.repeat if args.simulate else 1):
            dr = d / f"rep{report}"
            dr.mkdir()
            train(dr)
            for src in sources:
                if src.startswith("callgrind"):
                    continue  # exact counts: the same profile every time
                reps[src].append(simulate(argv(profiled(dr, src)))["CEst"])
                print(f"{name} under cachegrind, recording {report + 1}: {src} CEst {reps[src][-1]:,}", flush=True)
        cpu: dict[str, list[float]] = {c: [] for c, _ in cons}
        for rnd in range(args.runs):
            k = rnd % len(cons)
            for c, exe in cons[k:] + cons[:k]:
                cpu[c].append(cpu_of(argv(exe), args.cpu))
            print(f"{name} round {rnd}: " + ", ".join(f"{c} {cpu[c][-1]:.3f} s" for c, _ in cons), flush=True)
        speedup = {c: [b / x for b, x in zip(cpu["base"], cpu[c], strict=True)] for c, _ in cons[1:]}
        gain_i = median(speedup["instr"]) - 1
        share = {c: (median(speedup[c]) - 1) / gain_i if gain_i > 0.005 else None for c in sources}
        results[name] = {"cpu": cpu, "speedup": speedup, "share": share, "similarity": similarity, "sim": sim,
                         "sim_reps": reps}
    print(f"\nclang-14 {FLAGS}; speedup over the unprofiled build per round: median (95% confidence")
    print(f"interval of the median) of {args.runs} rounds; the share of instrumented PGO's gain in brackets\n")
    print(f"{'program':<8} {'base s':>6} " + " ".join(f"{c:>28}" for c in [*sources, "instr"]))
    for name, r in results.items():
        cells = []
        for c in sources:
            sh_ = "n/a" if r["share"][c] is None else f"{100 * r['share'][c]:.0f}%"
            cells.append(f"{fmt_ci(r['speedup'][c], 'x')} [{sh_}]")
        cells.append(fmt_ci(r["speedup"]["instr"], "x"))
        print(f"{name:<8} {median(r['cpu']['base']):>6.3f} " + " ".join(f"{x:>28}" for x in cells))
    if any(r["similarity"] for r in results.values()):
        print("\nllvm-profdata overlap with the profile of exact counts (callgrind): whole-program similarity, "
              "hot-block overlap")
        for name, r in results.items():
            print(f"{name:<8} " + "  ".join(f"{c}: {v['similarity']:.1f}%, {v['hot_blocks']:.1f}%"
                                             for c, v in r["similarity"].items()))
    if any(r["sim"] for r in results.values()):
        print("\nUnder cachegrind (one deterministic run each): KCachegrind's cycle estimate of each build over "
              "the\nunprofiled one's (CEst base / CEst), the share of instrumented PGO's gain in brackets; "
              "then Ir and\nmispredicted branches relative to base")
        print(f"{'program':<8} " + " ".join(f"{c:>26}" for c in [*sources, "instr"]))
        for name, r in results.items():
            sim = r["sim"]
            if not sim:
                continue
            gain = sim["base"]["CEst"] / sim["instr"]["CEst"] - 1
            cells = []
            for c in [*sources, "instr"]:
                g = sim["base"]["CEst"] / sim[c]["CEst"]
                sh_ = f" [{100 * (g - 1) / gain:.0f}%]" if gain > 0.002 and c != "instr" else ""
                cells.append(f"{g:.3f}x{sh_} Ir {sim[c]['Ir'] / sim['base']['Ir']:.3f} "
                             f"Bm {sim[c]['Bm'] / max(sim['base']['Bm'], 1):.2f}")
            print(f"{name:<8} " + " ".join(f"{x:>26}" for x in cells))
    if args.repeat > 1 and any(len(v) > 1 for r in results.values() for v in r["sim_reps"].values()):
        print(f"\nUnder cachegrind, each sample profile from {args.repeat} independent recordings: the share of "
              "instrumented PGO's gain,\nmedian [min, max] (exact counts are the same every time)")
        for name, r in results.items():
            sim = r["sim"]
            gain = sim["base"]["CEst"] / sim["instr"]["CEst"] - 1
            if gain <= 0.002:
                print(f"{name:<8} instrumented PGO gains nothing here ({1 + gain:.3f}x)")
                continue
            cells = []
            for c, ests in r["sim_reps"].items():
                if len(ests) < 2:
                    continue
                shares = sorted(100 * (sim["base"]["CEst"] / e - 1) / gain for e in ests)
                cells.append(f"{c}: {median(shares):.0f}% [{shares[0]:.0f}, {shares[-1]:.0f}]")
            print(f"{name:<8} " + "  ".join(cells))
    path = save(args.save_as, {"machine": machine(), "args": vars(args), "results": results})
    print(f"\ntarget: at least 85% of instrumented PGO's gain; raw data: {path}")


if __name__ == "__main__":
    main()
