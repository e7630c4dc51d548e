"""Where a probe's traps land in the samples: one procedure's timer samples per instruction with
and without a uprobe counting its entries, from perf itself (no cyclescope in the loop).

Each round records the program with `perf record -e cpu-clock` alone, then under `perf stat` with
a `perf probe` on the procedure's entry (counting mode, as calc's anchors), alternated. Printed:
the entries counted, the procedure's samples in each, and the offsets whose samples moved most.
What the anchors learn from it (analysis/anchors.py, NEAR_BYTES): the samples a probe adds at the
first bytes after the entry, where each trap returns, and those it adds elsewhere.

Usage: python bench/trapnear.py [--program xz] [--function hc_find_func] [--rounds 2] [--rate 5000]
"""

from __future__ import annotations

import argparse
import collections
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from common import machine, perf_probes, save
from suite import programs


def samples_by_offset(data: Path, function: str) -> collections.Counter[int]:
    out = subprocess.run(["perf", "script", "-i", str(data), "-F", "ip,sym,symoff"], capture_output=True, text=True,
                         check=True).stdout
    c: collections.Counter[int] = collections.Counter()
    for line in out.split():
        if line.startswith(function + "+0x"):
            c[int(line.rsplit("+", 1)[1], 16)] += 1
    return c


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--program", default="xz")
    ap.add_argument("--function", default="hc_find_func")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--rate", type=int, default=5000)
    ap.add_argument("--near", type=int, default=12, help="bytes after the entry counted as where traps return")
    args = ap.parse_args()
    (p,), inp = programs([args.program])
    pargs = [a.replace("{input}", str(inp)) for a in p.args]
    base: collections.Counter[int] = collections.Counter()
    probed: collections.Counter[int] = collections.Counter()
    entries = []
    with perf_probes(p.exe, {"trapnear": args.function}) as events, tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for probe in ((False, True) if r % 2 == 0 else (True, False)):
                data = Path(tmp) / f"{r}-{int(probe)}.data"
                rec = ["perf", "record", "-q", "-e", "cpu-clock", "-F", str(args.rate), "-o", str(data), "--"]
                if probe:
                    stat = Path(tmp) / f"{r}.stat"
                    subprocess.run(["perf", "stat", "-x,", "-o", str(stat), "-e", events["trapnear"], "--",
                                    *rec, str(p.exe), *pargs], check=True, stdout=subprocess.DEVNULL)
                    entries.append(int(stat.read_text().strip().splitlines()[-1].split(",")[0]))
                    probed.update(samples_by_offset(data, args.function))
                else:
                    subprocess.run([*rec, str(p.exe), *pargs], check=True, stdout=subprocess.DEVNULL)
                    base.update(samples_by_offset(data, args.function))
    added = sum(probed.values()) - sum(base.values())
    near = sum(probed[o] - base[o] for o in set(probed) | set(base) if o < args.near)
    print(f"{p.name} {args.function}: {sum(entries):,} entries counted over {args.rounds} rounds; samples "
          f"{sum(base.values()):,} without the probe, {sum(probed.values()):,} with it (+{added:,}); of those, "
          f"{near:+,} in the entry's first {args.near} bytes")
    print("offsets whose samples moved most (without, with):")
    moved = sorted(set(probed) | set(base), key=lambda o: -abs(probed[o] - base[o]))[:10]
    for o in moved:
        print(f"  +{o:#06x} {base[o]:7,d} {probed[o]:7,d} {probed[o] - base[o]:+7,d}")
    path = save("trapnear", {"machine": machine(), "args": vars(args), "entries": entries, "added": added,
                             "near": near, "without": {str(k): v for k, v in base.items()},
                             "with": {str(k): v for k, v in probed.items()}})
    print(f"raw data: {path}")


if __name__ == "__main__":
    main()
