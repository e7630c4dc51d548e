"""Python frames in stacks: CPython programs with known function shares, two ways.

tests/programs/pyshares.py runs three functions with the same work per iteration, 70/20/10
iterations in every 100, and (--time) prints the wall time each one took: the truth of the
run. Two ways of naming Python frames, alternated:
- perfmap: `record --collector perf --no-loop-counts -g dwarf,32768 -F 2000 -- pythonX.Y -X perf`
  (the rings, whose unwinder walks the JIT frames the perf map names; 3.12 and 3.13
  write the perf map that names their trampolines; 3.11 has no such option);
- bpf: `record --collector bpf --no-loop-counts -g fp -F 2000 -- pythonX.Y` (no option: the eBPF
  program reads the frames from the interpreter's memory; 3.10 to 3.13);
- bpf-dwarf: the same with `-g dwarf`: the program walks the native stack with unwind rows too, and
  each run of the evaluation loop gets its Python frames among the native ones, down to `_start`.
From `export collapsed`: each function's share of the samples under the three (its frames
inclusive), the error against the truth in points, how complete the stacks are (perfmap: the
share of samples under `py::main` whose outermost frame is `_start`, bpf-dwarf likewise; bpf:
whose outermost is `py::<module>`), the share of samples with Python frames, and of frames no image names.

Usage: python bench/pyframes.py [--rounds 3] [--iterations 300] [--modes perfmap,bpf,bpf-dwarf]
       [--save-as NAME]
"""

from __future__ import annotations

import argparse
import re
import shutil
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

from common import cpython, cyclescope_cmd, fmt_spread, machine, run, save

PROGRAM = Path(__file__).resolve().parents[1] / "tests" / "programs" / "pyshares.py"
FUNCS = ("seventy", "twenty", "ten")


def interpreters(mode: str) -> list[tuple[str, str, list[str]]]:
    out = []
    perf = ["-X", "perf"] if mode == "perfmap" else []
    versions = (("3.11", []), ("3.12", perf), ("3.13", perf)) if mode == "perfmap" else (
        ("3.10", []), ("3.11", []), ("3.12", []), ("3.13", []))
    for v, flags in versions:
        exe = cpython(v)
        if exe is not None:
            out.append((v, exe, flags))
    return out


def one(mode: str, exe: str, flags: list[str], iterations: int, tmp: Path) -> dict[str, Any]:
    db = tmp / "db"
    shutil.rmtree(db, ignore_errors=True)
    how = {"perfmap": ["--collector", "perf", "-g", "dwarf,32768"], "bpf": ["--collector", "bpf", "-g", "fp"],
           "bpf-dwarf": ["--collector", "bpf", "-g", "dwarf"]}[mode]
    r = run(cyclescope_cmd("record", "--db", str(db), "-q", "--no-loop-counts", *how, "-F", "2000",
                           "--", exe, *flags, str(PROGRAM), str(iterations), "--time"))
    if r.returncode != 0:
        raise RuntimeError(r.stderr[-400:])
    m = re.search(r"seventy ([\d.]+) twenty ([\d.]+) ten ([\d.]+)", r.stdout)
    assert m, r.stdout
    t = [float(x) for x in m.groups()]
    truth = {f: v / sum(t) for f, v in zip(FUNCS, t, strict=True)}
    ex = run(cyclescope_cmd("export", "collapsed", "--db", str(db)))
    stacks: Counter[str] = Counter()
    for line in ex.stdout.splitlines():
        s, n = line.rsplit(" ", 1)
        stacks[s] += int(n)
    tag = f":{PROGRAM}"
    per = {f: sum(n for s, n in stacks.items() if f"py::{f}{tag}" in s.split(";")) for f in FUNCS}
    inside = sum(per.values())
    under_main = [(s.split(";"), n) for s, n in stacks.items() if f"py::main{tag}" in s.split(";")]
    total = sum(stacks.values())
    frames = sum(len(s.split(";")) * n for s, n in stacks.items())
    unnamed = sum(sum(1 for f in s.split(";") if f.startswith(("[unknown]", "perf-")) or ".map+" in f) * n
                  for s, n in stacks.items())
    root = f"py::<module>{tag}" if mode == "bpf" else "_start"
    named = sum(n for _, n in under_main) / total if total else 0.0
    out: dict[str, Any] = {"samples": total, "truth": truth, "named": named,
                           "unnamed_frames": unnamed / frames if frames else 0.0}
    if inside:
        out["shares"] = {f: per[f] / inside for f in FUNCS}
        out["error_points"] = {f: 100 * (per[f] / inside - truth[f]) for f in FUNCS}
        out["complete"] = sum(n for fr, n in under_main if fr[0] == root) / sum(n for _, n in under_main)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--iterations", type=int, default=300)
    ap.add_argument("--modes", default="perfmap,bpf,bpf-dwarf")
    ap.add_argument("--save-as", default="pyframes")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="cs-bench-py-"))
    runs = [(m, v, exe, flags) for m in args.modes.split(",") for v, exe, flags in interpreters(m)]
    rows: dict[str, list[dict[str, Any]]] = {f"{m} {v}": [] for m, v, _, _ in runs}
    for rnd in range(args.rounds):
        for m, v, exe, flags in runs:  # alternated
            r = one(m, exe, flags, args.iterations, tmp)
            rows[f"{m} {v}"].append(r)
            got = r.get("error_points")
            print(f"round {rnd} {m} python {v}: {r['samples']} samples, "
                  + (", ".join(f"{f} {r['shares'][f]:.3f} (truth {r['truth'][f]:.3f})" for f in FUNCS)
                     + f", complete {r['complete']:.3f}, named {r['named']:.3f}" if got else "no Python frames named"),
                  flush=True)
    shutil.rmtree(tmp, ignore_errors=True)
    lines = ["", "Python frames (median [min, max] over rounds)", ""]
    for m, v, _, flags in runs:
        rs = rows[f"{m} {v}"]
        label = f"{m} python {v} {' '.join(flags)}".rstrip()
        if not any("error_points" in r for r in rs):
            lines.append(f"{label}: no Python frames named "
                         f"(unnamed frames {fmt_spread([100 * r['unnamed_frames'] for r in rs], '%', 2)})")
            continue
        err = [abs(e) for r in rs for e in r["error_points"].values()]
        complete = fmt_spread([100 * r["complete"] for r in rs], "%", 1)
        root = "<module>" if m == "bpf" else "_start"
        lines.append(f"{label}: worst share error {max(err):.2f} points, per function "
                     f"{fmt_spread(err, ' points', 2)}; stacks from {root} {complete}; samples with Python "
                     f"frames {fmt_spread([100 * r['named'] for r in rs], '%', 1)}; "
                     f"unnamed frames {fmt_spread([100 * r['unnamed_frames'] for r in rs], '%', 2)}")
    path = save(args.save_as, {"machine": machine(), "args": vars(args), "rows": rows, "lines": lines})
    print("\n".join(lines))
    print(f"raw data: {path}")


if __name__ == "__main__":
    main()
