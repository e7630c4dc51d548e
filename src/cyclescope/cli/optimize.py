"""`cyclescope optimize`: the Morph loop for a program built from source.

Build (with {flags} empty) -> profile a training run (repeated into one profile until it has
--train-samples samples) -> sample its paths as many times (the branch outcomes of the next 32
instructions after each of 1,000 stops a second, interpreted while the thread is stopped) ->
export an LLVM sample profile from calc's estimates shaped by those outcomes -> rebuild with
-fprofile-sample-use (and LLVM's profile inference) -> run both builds alternately and report the
speedup with its spread. Everything goes into one work directory, kept for inspection.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from cyclescope.app.calc import ESTIMATOR_HELP, ESTIMATORS, PROFILE_ESTIMATOR
from cyclescope.cli.base import Command, eprint, finite_float, register
from cyclescope.errors import CycleScopeError, UsageError

PROFILE_FLAGS = "-fdebug-info-for-profiling"
MAX_TRAIN_RUNS = 20  # --train-samples repeats the training run at most this often
# Sampled paths (analysis/paths.py): L instructions after each stop of the thread, at this rate.
# About 1.8 ms a stop for L = 32 (the SQLite shell's training run: 1.4 s alone, 2.4 s with paths).
PATH_LENGTH = 32
PATH_HZ = 1000
# LLVM's profile inference ("profi", LLVM 14 and later): block and edge counts made consistent by a
# min-cost flow over the CFG, in place of the older weight propagation. Timer samples give line
# counts with gaps and noise, which is what it was made for: under cachegrind's model it took
# calc's profile of bzip2 from 57% to 85% of instrumented PGO's gain (docs/benchmarks.md).
INFERENCE_FLAGS = {"profi": "-mllvm -sample-profile-use-profi", "propagate": ""}


def run_cpu(argv: list[str], stdin: str | None, cpu: int | None = None) -> tuple[float, bytes]:
    """Run ``argv`` (on CPU ``cpu`` only, if given); its user+system CPU seconds and its standard output."""
    fin = open(stdin, "rb") if stdin else subprocess.DEVNULL  # noqa: SIM115 - closed below
    pin = None if cpu is None else (lambda: os.sched_setaffinity(0, {cpu}))
    try:
        p = subprocess.Popen(argv, stdout=subprocess.PIPE, stdin=fin, stderr=subprocess.DEVNULL, preexec_fn=pin)
        out = b""
        assert p.stdout is not None
        for chunk in iter(lambda: p.stdout.read(1 << 16), b""):  # type: ignore[union-attr]
            out += chunk[: max(0, (1 << 20) - len(out))]  # keep the first MiB to compare outputs
        _, status, ru = os.wait4(p.pid, 0)
        p.returncode = os.waitstatus_to_exitcode(status)
    finally:
        if stdin:
            fin.close()  # type: ignore[union-attr]
    if p.returncode != 0:
        raise CycleScopeError(f"{shlex.join(argv)} exited with {p.returncode}")
    return ru.ru_utime + ru.ru_stime, out


def quartiles(xs: list[float]) -> tuple[float, float, float]:
    if len(xs) < 2:
        return xs[0], xs[0], xs[0]
    q = statistics.quantiles(xs, n=4, method="inclusive")
    return q[1], q[0], q[2]


@register
class Optimize(Command):
    name = "optimize"
    description = (
        "The closed loop (Morph): build the program with BUILD ({out} = the binary to write, {flags} =\n"
        "extra compiler flags), run the training command under cyclescope, turn the samples into an LLVM\n"
        "sample profile (execution counts estimated by calc, shaped by the branch outcomes of sampled\n"
        "paths: no branch records needed), rebuild with -fprofile-sample-use, then run both builds\n"
        "alternately and report the speedup (median and quartiles of the per-round CPU-time ratios).\n"
        "BUILD must compile with clang and -g."
    )
    epilog = (
        "example:\n"
        "  cyclescope optimize --build 'clang-14 -O2 -g {flags} -o {out} prog.c' -- {out} input.txt\n"
        "The run command after -- names the binary as {out}."
    )

    def add_arguments(self, p: argparse.ArgumentParser) -> None:
        p.add_argument("--build", required=True, metavar="CMD", help="shell command that builds {out} with {flags}")
        p.add_argument("--runs", type=int, default=5, metavar="N", help="measured runs of each build (default: 5)")
        p.add_argument("--cpu", type=int, metavar="N",
                       help="measure both builds on CPU N only (a quiet one): runs that do not migrate "
                            "between CPUs vary less (the spread of the speedup about 2-3 times narrower "
                            "on the development VMs)")
        p.add_argument("--stdin", metavar="FILE", help="feed FILE to the program's standard input")
        p.add_argument("--workdir", metavar="DIR", help="where to build, record and keep the profile "
                                                        "(default: a new directory under /tmp)")
        p.add_argument("-F", "--freq", type=finite_float, default=5000.0, metavar="HZ",
                       help="sampling rate of the training run (default: 5000)")
        p.add_argument("--train-samples", type=int, default=20000, metavar="N",
                       help="repeat the training run into one profile until it has N samples, at most "
                            f"{MAX_TRAIN_RUNS} runs (default: 20000; 0: one run)")
        p.add_argument("--counts", choices=("calc", "samples"), default="calc",
                       help="the profile's counts: calc's execution estimates (default) or raw samples per "
                            "instruction (see `export llvm-sample`)")
        p.add_argument("--estimator", choices=ESTIMATORS, default=PROFILE_ESTIMATOR,
                       help="with --counts calc: " + ESTIMATOR_HELP + f" (default: {PROFILE_ESTIMATOR})")
        p.add_argument("--no-paths", dest="paths", action="store_false",
                       help="leave out the sampled paths: calc's estimates alone (the paths' run stops the "
                            "program 1,000 times a second with ptrace and interprets the next 32 "
                            "instructions; their branch outcomes shape each function's counts)")
        p.add_argument("--inference", choices=tuple(INFERENCE_FLAGS), default="profi",
                       help="how clang turns the profile's line counts into branch weights: LLVM's profile "
                            "inference (default; -mllvm -sample-profile-use-profi, clang 14 or later) or its "
                            "older weight propagation")
        p.add_argument("--json", action="store_true", help="write the result as JSON")
        p.add_argument("command", nargs=argparse.REMAINDER, help="-- the training and measured run, {out} "
                                                                 "for the binary")

    def run(self, args: argparse.Namespace) -> int:
        import tempfile

        cmd = args.command[1:] if args.command[:1] == ["--"] else args.command
        _check(args, cmd)
        work = Path(args.workdir or tempfile.mkdtemp(prefix="cyclescope-optimize-"))
        work.mkdir(parents=True, exist_ok=True)
        base, opt, prof, db = work / "base", work / "opt", work / "profile.txt", work / "train.db"

        def argv(exe: Path) -> list[str]:
            return [a.replace("{out}", str(exe)) for a in cmd]

        _build(args.build, base, PROFILE_FLAGS)
        runs, total = _train(args, db, argv(base))
        paths = _sample_paths(args, work, runs, argv(base))
        outcomes = _export(args, db, base, prof, paths)
        _build(args.build, opt, f"{PROFILE_FLAGS} -fprofile-sample-use={shlex.quote(str(prof))} "
                                f"{INFERENCE_FLAGS[args.inference]}".rstrip())
        times, same = _measure(args, argv(base), argv(opt))
        ratios = [b / o for b, o in zip(times["base"], times["opt"], strict=True) if o > 0]
        med, lo, hi = quartiles(ratios)
        doc = {"workdir": str(work), "profile": str(prof), "inference": args.inference, "runs": args.runs,
               "cpu": args.cpu, "train_runs": runs, "train_samples": total, "branch_outcomes": outcomes,
               "base_cpu_s": times["base"], "opt_cpu_s": times["opt"], "speedup": med,
               "speedup_quartiles": [lo, hi], "same_output": same}
        if args.json:
            json.dump(doc, sys.stdout, indent=2)
            sys.stdout.write("\n")
        else:
            on = f", on CPU {args.cpu}" if args.cpu is not None else ""
            print(f"baseline   CPU {statistics.median(times['base']):.3f} s (median of {args.runs}{on})")
            print(f"optimized  CPU {statistics.median(times['opt']):.3f} s")
            print(f"speedup    {med:.3f}x [{lo:.3f}, {hi:.3f}] (per-round ratios, median [quartiles])")
            shaped = f", shaped by {outcomes:,} branch outcomes of sampled paths" if outcomes else ""
            print(f"profile    {prof} (clang's {args.inference} inference{shaped})")
        if not same:
            eprint("cyclescope optimize: warning: the two builds wrote different output")
        return 0


def _check(args: argparse.Namespace, cmd: list[str]) -> None:
    if not cmd:
        raise UsageError("give the run command after --, with {out} for the binary")
    if "{out}" not in args.build:
        raise UsageError("--build must contain {out} (and {flags} for the profile flags)")
    if args.runs < 1:
        raise UsageError("--runs must be at least 1")
    if args.train_samples < 0:
        raise UsageError("--train-samples must be 0 or more")
    if args.cpu is not None and args.cpu not in os.sched_getaffinity(0):
        cpus = ",".join(str(c) for c in sorted(os.sched_getaffinity(0)))
        raise UsageError(f"--cpu {args.cpu}: not a CPU this process may run on ({cpus})")


def _build(template: str, out: Path, flags: str) -> None:
    line = template.replace("{out}", shlex.quote(str(out))).replace("{flags}", flags)
    eprint(f"cyclescope optimize: {line}")
    r = subprocess.run(line, shell=True, capture_output=True, text=True)
    if r.returncode != 0 or not out.exists():
        tail = (r.stderr or r.stdout).strip().splitlines()[-3:]
        raise CycleScopeError("build failed: " + " | ".join(tail))


def _under_record(args: argparse.Namespace, db: Path, t: int, run: list[str], *opts: str
                  ) -> subprocess.CompletedProcess[str]:
    """The training run of the base build under `cyclescope record` (the t-th into ``db``)."""
    rec = [sys.executable, "-m", "cyclescope", "record", "--db", str(db), *(["--append"] if t else []), *opts,
           "--", *run]
    stdin = open(args.stdin, "rb") if args.stdin else subprocess.DEVNULL  # noqa: SIM115
    try:
        return subprocess.run(rec, stdin=stdin, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    finally:
        if args.stdin:
            stdin.close()  # type: ignore[union-attr]


def _train(args: argparse.Namespace, db: Path, run: list[str]) -> tuple[int, int]:
    """The training run again, into the same epoch, until the profile has enough samples: a run of
    a fraction of a second leaves most blocks with a few samples, and calc's estimates (and clang's
    use of them) improve with more (docs/benchmarks.md). Returns the runs and the samples."""
    total = runs = 0
    for t in range(MAX_TRAIN_RUNS):
        runs = t + 1
        r = _under_record(args, db, t, run, "-F", str(args.freq))
        if r.returncode != 0:
            raise CycleScopeError(f"the training run failed: {r.stderr.strip()[-300:]}")
        m = re.search(r"record: ([\d,]+) samples", r.stderr)
        total += int(m.group(1).replace(",", "")) if m else 0
        eprint(f"cyclescope optimize: training run {t + 1} under cyclescope record: {total:,} samples so far")
        if total >= args.train_samples or not m:
            break
    return runs, total


def _sample_paths(args: argparse.Namespace, work: Path, runs: int, run: list[str]) -> Path | None:
    """The training runs once more with their branch outcomes sampled (exact mode), for calc's
    paths; None when not asked for or when they could not be taken."""
    if not (args.paths and args.counts == "calc"):
        return None
    paths = work / "paths.db"
    if paths.exists():
        shutil.rmtree(paths)  # a previous optimize's, perhaps of another build
    for t in range(runs):
        r = _under_record(args, paths, t, run, "-F", str(PATH_HZ), "--values", "edges", "--exact", "interpret",
                          "--interpret", str(PATH_LENGTH))
        if r.returncode != 0:
            why = (r.stderr.strip().splitlines() or ["?"])[-1]
            eprint(f"cyclescope optimize: warning: no sampled paths ({why}); calc's estimates alone")
            return None
        eprint(f"cyclescope optimize: sampled paths of the training run {t + 1}/{runs}")
    return paths


def _export(args: argparse.Namespace, db: Path, base: Path, prof: Path, paths: Path | None) -> int:
    """The sample profile clang reads, written to ``prof``; how many branch outcomes shaped it."""
    export = [sys.executable, "-m", "cyclescope", "export", "llvm-sample", "--db", str(db), "--image", str(base),
              "--counts", args.counts, "--estimator", args.estimator, "-o", str(prof)]
    r = subprocess.run([*export, *(["--edges-from", str(paths)] if paths else [])], capture_output=True, text=True)
    if r.returncode != 0 and paths is not None and "no branch outcomes" in r.stderr:
        # Exact mode follows the command's own thread: a training command that runs the binary
        # in a child (a shell script, say) leaves no paths of it.
        eprint("cyclescope optimize: warning: the sampled paths did not reach the binary; calc's estimates alone")
        r = subprocess.run(export, capture_output=True, text=True)
    if r.returncode != 0:
        raise CycleScopeError(f"no sample profile: {r.stderr.strip()}")
    m = re.search(r"shaped by ([\d,]+) branch outcomes", r.stderr)
    return int(m.group(1).replace(",", "")) if m else 0


def _measure(args: argparse.Namespace, base: list[str], opt: list[str]) -> tuple[dict[str, list[float]], bool]:
    """Both builds, alternated for ``args.runs`` rounds: their CPU times, and whether their outputs
    were the same."""
    times: dict[str, list[float]] = {"base": [], "opt": []}
    outputs: dict[str, bytes] = {}
    t0 = time.monotonic()
    for i in range(args.runs):
        order = [("base", base), ("opt", opt)] if i % 2 == 0 else [("opt", opt), ("base", base)]
        for name, run in order:
            cpu, out = run_cpu(run, args.stdin, args.cpu)
            times[name].append(cpu)
            outputs.setdefault(name, out)
        if sys.stderr.isatty():
            sys.stderr.write(f"\rcyclescope optimize: measured {i + 1}/{args.runs} rounds "
                             f"({time.monotonic() - t0:.0f} s)")
    if sys.stderr.isatty():
        sys.stderr.write("\n")
    return times, outputs.get("base") == outputs.get("opt")
