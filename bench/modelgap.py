"""How far the static model's cycles are from what the blocks took: the gap calc's model-based
counts fall into, measured on recordings kept by bench/accuracy.py.

    python bench/modelgap.py --keep DIR                  # every program DIR holds
    python bench/modelgap.py --keep DIR --programs xz,zlib --top 10

For each block with at least --min-samples samples that callgrind saw run: its true cycles per
execution (its samples times the sampling period in cycles, over its exact count) against the
model's (the sum of its instructions' M_i, llvm-mca's cycles as the oldest unretired
instruction), and how its samples spread over its instructions (the share on its most sampled
instruction; the share of its instructions the model gives no cycle). A block whose true cycles
are the model's is one the issue-point and sum-ratio estimators can count; one that takes many
times the model's is stalled, and only a measurement (a loop counter, a trip count, an anchor)
counts it. Analyses run from the tree that recorded DIR (the recordings name its binaries).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from common import hot_procedures, machine, save

# Bins of true cycles per execution / the model's.
BINS = ((0.0, 0.67), (0.67, 1.5), (1.5, 3.0), (3.0, 10.0), (10.0, float("inf")))


def blocks(keep: Path, names: list[str], min_samples: int, runs: int) -> list[dict[str, Any]]:
    import numpy as np
    import suite
    from accuracy import callgrind_counts

    from cyclescope.app.calc import calc_target

    progs, inp = suite.programs(names)
    out: list[dict[str, Any]] = []
    for p in progs:
        db = keep / f"{p.name}.db"
        if not db.exists():
            print(f"{p.name}: no recording in {keep}, skipped", file=sys.stderr)
            continue
        prof, ob = callgrind_counts(p, [a.replace("{input}", str(inp)) for a in p.args], keep)
        exact_at = prof.counts[ob]
        profile, ev, hot = hot_procedures(db, p.image, 100)
        for _, t in hot:
            c = calc_target(profile, t, ev, None, paths=False)
            if c.period_cycles is None:
                raise SystemExit("the clock was not measured: no period in cycles")
            e = c.events.index(ev)
            for blk in c.cfg.blocks:
                s = c.samples[blk.first : blk.last + 1, e].astype(float)
                exact = exact_at.get(c.cfg.insns[blk.first].address, 0) * runs
                if s.sum() < min_samples or exact == 0:
                    continue
                m = np.array([im.m for im in c.model.blocks[blk.id].insns], float)
                true = float(s.sum()) * c.period_cycles / exact
                out.append({"program": p.name, "procedure": t.name, "start": blk.start, "samples": float(s.sum()),
                            "true_cycles": true, "model_cycles": float(m.sum()),
                            "top_share": float(s.max() / s.sum()), "zero_m": float((m <= 0).mean()),
                            "samples_per_insn": s.tolist(), "m": m.tolist()})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--keep", required=True, metavar="DIR", help="bench/accuracy.py --keep DIR's recordings")
    ap.add_argument("--programs", default="kernels,demo,bzip2,gzip,xz,zlib,lua,sqlite,zstd,lzip")
    ap.add_argument("--runs", type=int, default=3, help="the recordings' runs (bench/accuracy.py --runs)")
    ap.add_argument("--min-samples", type=int, default=40)
    ap.add_argument("--top", type=int, default=8, help="list this many of the most sampled blocks")
    ap.add_argument("--save-as", default="modelgap")
    a = ap.parse_args()
    rows = blocks(Path(a.keep), a.programs.split(","), a.min_samples, a.runs)
    if not rows:
        raise SystemExit("no block with enough samples")
    total = sum(r["samples"] for r in rows)
    print(f"{len(rows)} blocks with at least {a.min_samples} samples, {total:,.0f} samples")
    print("true cycles per execution / the model's: share of those samples")
    for lo, hi in BINS:
        sh = sum(r["samples"] for r in rows
                 if r["model_cycles"] > 0 and lo <= r["true_cycles"] / r["model_cycles"] < hi)
        print(f"  {lo:5.2f} to {hi:5.2f}: {100 * sh / total:5.1f}%")
    none = sum(r["samples"] for r in rows if r["model_cycles"] <= 0)
    print(f"  the model gives the block no cycle: {100 * none / total:5.1f}%")
    zero = sum(r["samples"] * r["zero_m"] for r in rows) / total
    top = sum(r["samples"] * r["top_share"] for r in rows) / total
    print(f"instructions the model gives no cycle (sample-weighted): {100 * zero:.1f}%; "
          f"share of a block's samples on its most sampled instruction (sample-weighted): {100 * top:.1f}%")
    by_prog: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        by_prog.setdefault(r["program"], []).append(r)
    for name, rs in by_prog.items():
        n = sum(r["samples"] for r in rs)
        near = sum(r["samples"] for r in rs
                   if r["model_cycles"] > 0 and 0.67 <= r["true_cycles"] / r["model_cycles"] < 1.5)
        print(f"  {name:8s} {n:8,.0f} samples, {100 * near / n:5.1f}% in blocks within 1.5x of the model")
    print(f"the {a.top} most sampled blocks:")
    for r in sorted(rows, key=lambda r: -r["samples"])[: a.top]:
        ratio = r["true_cycles"] / r["model_cycles"] if r["model_cycles"] > 0 else float("inf")
        print(f"  {r['program']:6s} {r['procedure'][:28]:28s} {r['start']:#8x} {r['samples']:7,.0f} samples: "
              f"{r['true_cycles']:7.2f} cycles an execution, model {r['model_cycles']:5.2f} ({ratio:5.1f}x); "
              f"{100 * r['top_share']:.0f}% on one instruction of {len(r['m'])}")
    print(f"saved {save(a.save_as, {'machine': machine(), 'blocks': rows})}")


if __name__ == "__main__":
    main()
