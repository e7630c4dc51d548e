"""Skid calibration: where timer samples land relative to the instruction the model says is waited on.

Uses the recordings and callgrind counts that `bench/accuracy.py --keep DIR` left in DIR. For every
basic block with a known execution count E, the observed cycles per execution of each instruction
are S_i * P / E. In blocks whose total agrees with llvm-mca's best case (no dynamic stall), those
cycles should be llvm-mca's M_j moved forward by the skid: S_i * P / E = sum_j K_kind(j)[i - j] M_j.
K is fitted per kind of blocking instruction (load, store, divide, multiply, branch, other) by
non-negative least squares, then normalized. Single-block loops wrap around (samples skidding past
the back-edge land on the loop head).

Usage: python bench/skid.py --keep bench/out/acc [--programs ...]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from common import hot_procedures, save
from suite import programs

KINDS = ("load", "store", "div", "mul", "branch", "other")
DEPTH = 5


def kind_of(info: object, ins: object) -> str:
    k = getattr(info, "kind", "other")
    if k in ("div", "sqrt"):
        return "div"
    if k == "mul":
        return "mul"
    if getattr(info, "loads", False) and not getattr(ins, "mnemonic", "").startswith(("pop", "ret")):
        return "load"
    if getattr(info, "stores", False):
        return "store"
    if k in ("branch", "call", "ret"):
        return "branch"
    return "other"


def nnls(a: np.ndarray, b: np.ndarray, iters: int = 3000) -> np.ndarray:
    """Non-negative least squares by projected gradient (small problems; no SciPy needed)."""
    x = np.clip(np.linalg.lstsq(a, b, rcond=None)[0], 0, None)
    lr = 1.0 / max(np.linalg.norm(a, 2) ** 2, 1e-12)
    for _ in range(iters):
        x = np.clip(x - lr * (a.T @ (a @ x - b)), 0, None)
    return x


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--keep", required=True)
    ap.add_argument("--programs", default="kernels,demo,bzip2,gzip,xz,zlib")
    ap.add_argument("--tolerance", type=float, default=0.15, help="how close to the model a clean block is")
    ap.add_argument("--runs", type=int, default=3, help="how many runs each recording holds (accuracy.py --runs)")
    args = ap.parse_args()
    from cyclescope.analysis.callgrind import parse_callgrind
    from cyclescope.app.calc import calc_target

    keep = Path(args.keep)
    progs, _ = programs(args.programs.split(","))
    targets: list[float] = []
    design: list[np.ndarray] = []
    clean = total = 0
    model_ratio = []
    for p in progs:
        cg = parse_callgrind((keep / f"cg-{p.name}.out").read_text())
        ob = cg.object_for(str(p.exe))
        counts = cg.counts[ob] if ob else {}
        runs = args.runs
        profile, ev, hot = hot_procedures(keep / f"{p.name}.db", p.image, 100)
        for _samples, t in hot:
            c = calc_target(profile, t, ev, None)
            assert c.period_cycles
            runs_e = counts
            for blk in c.cfg.blocks:
                e = runs_e.get(c.cfg.insns[blk.first].address, 0) * runs
                if e <= 0:
                    continue
                s = c.samples[blk.first : blk.last + 1, c.events.index(ev)]
                if s.sum() < 60:
                    continue
                ms = np.array([im.m for im in c.model.blocks[blk.id].insns])
                obs = s * c.period_cycles / e  # observed cycles per execution, per instruction
                total += 1
                ratio = obs.sum() / max(ms.sum(), 1e-9)
                model_ratio.append((float(ratio), float(s.sum())))
                if abs(ratio - 1) > args.tolerance:
                    continue
                clean += 1
                n = len(ms)
                loop = any(c.cfg.edges[x].src == blk.id for x in blk.preds)
                for i in range(n):
                    row_v = np.zeros(len(KINDS) * DEPTH)
                    for d in range(DEPTH):
                        j = i - d
                        if j < 0:
                            if not loop:
                                continue
                            j += n
                        kk = KINDS.index(kind_of(c.infos[blk.first + j], c.cfg.insns[blk.first + j]))
                        row_v[kk * DEPTH + d] += ms[j]
                    design.append(row_v)
                    targets.append(float(obs[i]))
    r = np.array([m for m, _ in model_ratio])
    w = np.array([s for _, s in model_ratio])
    qs = np.percentile(r, [10, 25, 50, 75, 90]) if len(r) else []
    print(f"observed/model cycles per block over {total} blocks: percentiles 10/25/50/75/90: "
          + " ".join(f"{q:.2f}" for q in qs))
    if not design:
        raise SystemExit("no block agrees with the model closely enough to fit a skid kernel")
    a = np.array(design)
    b = np.array(targets)
    x = nnls(a, b)
    kernels = {}
    for kk, name in enumerate(KINDS):
        v = x[kk * DEPTH : (kk + 1) * DEPTH]
        used = a[:, kk * DEPTH : (kk + 1) * DEPTH].sum()
        if used <= 0:
            continue
        kernels[name] = [round(float(z / v.sum()), 3) if v.sum() else 0.0 for z in v]
        print(f"{name:>7}: mass {v.sum():.2f} of the model's cycles; lands at +0..+{DEPTH - 1}: {kernels[name]}")
    r = np.array([m for m, _ in model_ratio])
    w = np.array([s for _, s in model_ratio])
    print(f"{clean} clean blocks of {total}; observed/model cycles per block: median {np.median(r):.2f}, "
          f"within 15% for {100 * w[np.abs(r - 1) <= 0.15].sum() / w.sum():.1f}% of the samples")
    save("skid", {"kernels": kernels, "clean_blocks": clean, "blocks": total, "ratios": model_ratio})
    print(json.dumps(kernels))


if __name__ == "__main__":
    main()
