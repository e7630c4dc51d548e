"""What anchors really cost the profiled programs: gcc compiling in a loop, its compiles counted under
`record` with and without anchors, alternated, system-wide (`record -a --anchors` against
`--no-anchors`) and per task (`record -- LOOP` against `--no-anchors`).

The anchors' own account (the traps they counted, times 9.5 us) is what their budget holds them to;
the compiles are what the machine lost, traps or not (registering probes in every process that maps
a library, out-of-line slots for short-lived processes, closes).

Usage: python bench/anchors.py [--rounds N] [--seconds S]     (root: it records system-wide)
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import PY, ROOT, machine, median, save

SRC = ROOT / "src" / "cyclescope" / "demo" / "workload.c"


def gcc_loop(work: Path, seconds: float | None, stop: Path) -> str:
    """A shell loop compiling the demo workload, one line in work/n per compile."""
    until = f"[ $SECONDS -lt {int(seconds)} ]" if seconds else f"[ ! -e {stop} ]"
    return (f"SECONDS=0; while {until}; do gcc -O2 -g -c -o {work}/w.o {SRC} && echo >> {work}/n; done")


def one(work: Path, mode: str, anchors: bool, seconds: float) -> dict[str, Any]:
    db, n, stop = work / "db", work / "n", work / "stop"
    shutil.rmtree(db, ignore_errors=True)
    n.write_text("")
    stop.unlink(missing_ok=True)
    flag = "--anchors" if anchors and mode == "system" else ("--no-anchors" if not anchors else None)
    args = [PY, "-m", "cyclescope", "record", "--db", str(db), "-F", "5000"] + ([flag] if flag else [])
    if mode == "system":
        loop = subprocess.Popen(["bash", "-c", gcc_loop(work, None, stop)])
        r = subprocess.run([*args, "-a", "-d", str(seconds)], capture_output=True, text=True)
        stop.touch()
        loop.wait()
    else:
        r = subprocess.run([*args, "--", "bash", "-c", gcc_loop(work, seconds, stop)], capture_output=True,
                           text=True)
    if r.returncode != 0:
        raise SystemExit(f"record failed: {r.stderr.strip()[-300:]}")
    m = re.search(r"anchors: (\d+) procedure entries counted exactly in windows \(([\d.]+) s", r.stderr)
    return {"compiles": len(n.read_text().splitlines()), "counted": int(m.group(1)) if m else 0,
            "trap_s": float(m.group(2)) if m else 0.0}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=30.0)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="cyclescope-bench-anchors-"))
    out: dict[str, Any] = {"machine": machine(), "seconds": args.seconds, "rounds": []}
    try:
        for k in range(args.rounds):
            row: dict[str, Any] = {}
            for mode in ("system", "task"):
                order = (False, True) if k % 2 == 0 else (True, False)
                for anchors in order:
                    row[f"{mode}/{'anchors' if anchors else 'none'}"] = one(work, mode, anchors, args.seconds)
                    time.sleep(1)
            out["rounds"].append(row)
            print(f"round {k + 1}: " + ", ".join(f"{key} {v['compiles']}" for key, v in row.items()), file=sys.stderr)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"\ngcc compiles in {args.seconds:.0f} s under record -F 5000, {args.rounds} rounds alternated")
    for mode in ("system", "task"):
        ratios = [r[f"{mode}/anchors"]["compiles"] / max(1, r[f"{mode}/none"]["compiles"]) for r in out["rounds"]]
        counted = [r[f"{mode}/anchors"]["counted"] for r in out["rounds"]]
        trap = [r[f"{mode}/anchors"]["trap_s"] for r in out["rounds"]]
        print(f"  {mode:6s} with anchors / without: {median(ratios):.3f} [{min(ratios):.3f}, {max(ratios):.3f}]; "
              f"entries counted {min(counted)}-{max(counted)}; traps by the anchors' account "
              f"{min(trap):.2f}-{max(trap):.2f} s")
    print(f"saved {save('anchors', out)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
