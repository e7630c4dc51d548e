"""Python programs of a fraction of a second through the eBPF path: how much of them is named.

tests/programs/pylast.py spins in first() for FIRST seconds, then in last() for LAST seconds, and
exits. `record --collector bpf --no-loop-counts -g fp -F 2000 -- pythonX.Y pylast.py FIRST LAST`;
from `export collapsed`, the samples under `py::first` and under `py::last`, against what the
program's CPU time at 2 kHz would give (FIRST x 2000 and LAST x 2000: spin() runs on one CPU the
whole time, so a busy machine gives fewer). Two cases: a script of 0.1 s in all (`--short`,
default 0.05,0.05: how soon the program is described to the eBPF program) and a last function
that runs only after the last drain that would have read its name (`--late`, default 0.3,0.03:
the names copied at the process's exit).

With --system-wide ROUNDS: `record -a --collector bpf -g fp -F 1000 -d 6`, and 2.5 s into it
tests/programs/pyshares.py ROUNDS run under its own command name (a symlink to the interpreter):
the share of its samples under `py::main` (the samples before the process is described to the
program have no Python frames; with these, the interpreter's start-up and finalization). Once
each round: as `pyshares-py` and `python-pyshares`, links to the interpreter, and as
`pyshares-run.py` and `pyshares-cli`, copies of the script run by their #! line (collect/
pyframes.py's watch_execs: exec.bpf.c wakes the collector at the exec of each; ftrace's filter on
the name executed, its fallback, only at the second and third's; a process not woken for is seen
when the rings' side records are next read).

Contenders: the head, and with --base REV the tree committed at REV (`git archive`), alternated
in each round.

Usage: python bench/pyshort.py [--rounds 3] [--base REV] [--pythons 3.10,3.11,3.12,3.13]
       [--short 0.05,0.05] [--late 0.3,0.03] [--system-wide 150] [--save-as NAME]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from common import ROOT, contender_trees, cpython, fmt_spread, machine, save

PROGRAM = ROOT / "tests" / "programs" / "pylast.py"
RATE = 2000


def one(src: Path, exe: str, first: float, last: float, tmp: Path) -> dict[str, float]:
    db = tmp / "db"
    subprocess.run(["rm", "-rf", str(db)], check=True)
    env = dict(os.environ, PYTHONPATH=str(src))
    rec = subprocess.run([sys.executable, "-m", "cyclescope", "record", "--db", str(db), "-q", "--collector", "bpf",
                          "--no-loop-counts", "-g", "fp", "-F", str(RATE), "--", exe, str(PROGRAM), str(first),
                          str(last)], env=env, capture_output=True, text=True)
    if rec.returncode != 0:
        raise RuntimeError(rec.stderr[-400:])
    ex = subprocess.run([sys.executable, "-m", "cyclescope", "export", "collapsed", "--db", str(db)], env=env,
                        capture_output=True, text=True, check=True)
    tag = f":{PROGRAM}"
    got = {"first": 0, "last": 0, "total": 0}
    for line in ex.stdout.splitlines():
        s, n = line.rsplit(" ", 1)
        frames = s.split(";")
        got["total"] += int(n)
        for f in ("first", "last"):
            if f"py::{f}{tag}" in frames:
                got[f] += int(n)
    return {"first": got["first"] / (first * RATE), "last": got["last"] / (last * RATE), "samples": got["total"]}


# Links to the interpreter, not named python and named python; scripts run by their #! line,
# with the .py suffix and without (a console script's name). ftrace's filter on the name executed
# (the fallback) matches the second and third; exec.bpf.c, which looks at the file run, all four.
SYSTEM_WIDE_NAMES = ("pyshares-py", "python-pyshares", "pyshares-run.py", "pyshares-cli")
SCRIPTS = ("pyshares-run.py", "pyshares-cli")


def system_wide(src: Path, exe: str, rounds: int, tmp: Path, name: str) -> dict[str, float]:
    import time

    db = tmp / "db"
    subprocess.run(["rm", "-rf", str(db)], check=True)
    script = ROOT / "tests" / "programs" / "pyshares.py"
    link = tmp / name
    link.unlink(missing_ok=True)
    if name in SCRIPTS:
        link.write_text(f"#!{exe}\n" + script.read_text())
        link.chmod(0o755)
        cmd, script = [str(link), str(rounds)], link
    else:
        link.symlink_to(exe)
        cmd = [str(link), str(script), str(rounds)]
    env = dict(os.environ, PYTHONPATH=str(src))
    rec = subprocess.Popen([sys.executable, "-m", "cyclescope", "record", "--db", str(db), "-a", "--collector", "bpf",
                            "-g", "fp", "-F", "1000", "-d", "6"], env=env, stdout=subprocess.DEVNULL,
                           stderr=subprocess.PIPE, text=True)
    time.sleep(2.5)
    subprocess.run(cmd, check=True, capture_output=True)
    _, err = rec.communicate()
    if rec.returncode != 0:
        raise RuntimeError(err[-400:])
    ex = subprocess.run([sys.executable, "-m", "cyclescope", "export", "collapsed", "--db", str(db), "--process",
                         name], env=env, capture_output=True, text=True, check=True)
    total = named = 0
    for line in ex.stdout.splitlines():
        s, n = line.rsplit(" ", 1)
        total += int(n)
        named += int(n) if f"py::main:{script}" in s.split(";") else 0
    return {"main": named / total if total else float("nan"), "samples": total}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--base", help="a git revision to compare with the head")
    ap.add_argument("--pythons", default="3.10,3.11,3.12,3.13")
    ap.add_argument("--short", default="0.05,0.05")
    ap.add_argument("--late", default="0.3,0.03")
    ap.add_argument("--system-wide", type=int, default=0, metavar="ROUNDS",
                    help="also pyshares.py ROUNDS started during a system-wide recording")
    ap.add_argument("--save-as", default="pyshort")
    args = ap.parse_args()
    cases = {"short": tuple(float(x) for x in args.short.split(",")),
             "late": tuple(float(x) for x in args.late.split(","))}
    exes = {}
    for v in args.pythons.split(","):
        exe = cpython(v)
        if exe is not None:
            exes[v] = exe
        else:
            print(f"pyshort: no CPython {v} here", file=sys.stderr)
    results: dict[str, Any] = {"machine": machine(), "args": vars(args), "runs": []}
    with tempfile.TemporaryDirectory(prefix="pyshort-") as d:
        tmp = Path(d)
        trees = contender_trees(args.base, tmp)
        for r in range(args.rounds):
            order = list(trees.items()) if r % 2 == 0 else list(reversed(trees.items()))  # alternated
            for v, exe in exes.items():
                for case, (first, last) in cases.items():
                    for label, src in order:
                        res = one(src, exe, first, last, tmp)
                        res.update(round=r, python=v, case=case, tree=label)
                        results["runs"].append(res)
                        print(f"round {r} {v:5} {case:5} {label:10} first {res['first']:5.2f} last {res['last']:5.2f}"
                              f" of their samples at {RATE} Hz ({res['samples']} samples in all)", flush=True)
                if args.system_wide:
                    for name in SYSTEM_WIDE_NAMES:
                        for label, src in order:
                            sw = system_wide(src, exe, args.system_wide, tmp, name)
                            sw.update(round=r, python=v, case=f"system-wide {name}", tree=label)
                            results["runs"].append(sw)
                            print(f"round {r} {v:5} system-wide {name:15} {label:10} under main {sw['main']:5.3f} "
                                  f"({sw['samples']} samples)", flush=True)
    print("\nshare of the expected samples named, median [min, max] of the rounds:")
    for v in exes:
        for case in cases:
            row = []
            for label in trees:
                pick = [x for x in results["runs"] if (x["python"], x["case"], x["tree"]) == (v, case, label)]
                row.append(f"{label}: first {fmt_spread([x['first'] for x in pick], digits=2)}, "
                           f"last {fmt_spread([x['last'] for x in pick], digits=2)}")
            print(f"  {v:5} {case:5} " + "; ".join(row))
        for name in SYSTEM_WIDE_NAMES if args.system_wide else ():
            row = []
            for label in trees:
                pick = [x["main"] for x in results["runs"]
                        if (x["python"], x["case"], x["tree"]) == (v, f"system-wide {name}", label)]
                row.append(f"{label}: under main {fmt_spread(pick, digits=3)}")
            print(f"  {v:5} system-wide as {name}: " + "; ".join(row))
    print(f"saved {save(args.save_as, results)}")


if __name__ == "__main__":
    main()
