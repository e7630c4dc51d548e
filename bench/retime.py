"""Real CPU time of the builds a bench/optimize.py run kept: many alternated rounds of the
unprofiled build, the instrumented PGO build and each recording's sample-profile build.

bench/optimize.py times each build for --runs rounds, on the first recording only (its runs since
the sampled paths used one round: the builds and the cachegrind runs take the time). Its work
directory stays behind (/tmp/cs-bench-opt-XXXX/PROGRAM, rep1/ and rep2/ for --repeat), so the same
builds can be timed afterwards on a quiet machine, as long as wanted.

Each round runs every build once, in an order rotated by one each round (no build always first or
after the same one). Reported per build: the speedup over the unprofiled build of the same round,
median with a distribution-free 95% confidence interval of the median, and the share of
instrumented PGO's gain that the median reaches, with a 95% bootstrap interval (rounds resampled
as wholes, so the pairing stays).

Usage: python bench/retime.py [--rounds 41] [--cpu N] [--sources paths-profi,callgrind-profi]
                              [--save-as NAME] /tmp/cs-bench-opt-XXXX:lua,sqlite ...
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import numpy as np
from common import ROOT, fmt_ci, machine, median, save
from optimize import cpu_of, programs


def share_interval(base: np.ndarray, test: np.ndarray, instr: np.ndarray, rng: np.random.Generator,
                   n: int = 2000) -> tuple[float, float, float]:
    """Share of instrumented PGO's gain, (median speedup of test - 1) / (median speedup of instr - 1),
    and a 95% bootstrap interval from resampling whole rounds."""
    def share(idx: np.ndarray) -> float:
        gi = float(np.median(base[idx] / instr[idx])) - 1
        return (float(np.median(base[idx] / test[idx])) - 1) / gi if gi > 0 else float("nan")

    all_ = np.arange(len(base))
    boots = np.array([share(rng.integers(0, len(base), len(base))) for _ in range(n)])
    boots = boots[np.isfinite(boots)]
    lo, hi = (np.percentile(boots, [2.5, 97.5]) if len(boots) else (float("nan"), float("nan")))
    return share(all_), float(lo), float(hi)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=41)
    ap.add_argument("--cpu", type=int, default=None,
                    help="run every build on this CPU only (2-3 times narrower intervals on these VMs)")
    ap.add_argument("--sources", default="paths-profi",
                    help="the sample-profile builds' names in the work directory (bench/optimize.py's --sources "
                         "with - for +), each timed from every recording that has it")
    ap.add_argument("--save-as", default="retime", help="name of the raw data file in bench/out/ (.json added)")
    ap.add_argument("dirs", nargs="+", metavar="WORKDIR:PROG,PROG")
    args = ap.parse_args()
    rng = np.random.default_rng(1)
    results: dict[str, Any] = {}
    for spec in args.dirs:
        work, _, progs = spec.partition(":")
        for name in progs.split(","):
            d = Path(work) / name
            if not (d / "base").exists() or not (d / "instr").exists():
                sys.exit(f"retime: {d}: no base and instr builds (not a bench/optimize.py work directory)")
            builds = [("base", d / "base"), ("instr", d / "instr")]
            for src in args.sources.split(","):
                found = [(f"{src} {w.name if w != d else 'rep0'}", w / src) for w in [d, *sorted(d.glob("rep*"))]
                         if (w / src).exists()]
                if not found:
                    sys.exit(f"retime: {d}: no build {src} (bench/optimize.py --sources {src.replace('-', '+')})")
                builds += found
            _, run_argv, _ = programs()[name]
            cpu: dict[str, list[float]] = {b: [] for b, _ in builds}
            for rnd in range(args.rounds):
                k = rnd % len(builds)
                for b, exe in builds[k:] + builds[:k]:
                    cpu[b].append(cpu_of([a.replace("{exe}", str(exe)) for a in run_argv], args.cpu))
                print(f"{name} round {rnd}: " + ", ".join(f"{b} {cpu[b][-1]:.3f} s" for b, _ in builds),
                      file=sys.stderr, flush=True)
            base = np.array(cpu["base"])
            instr = np.array(cpu["instr"])
            rows = {}
            for b, _ in builds[1:]:
                x = np.array(cpu[b])
                sp = list(base / x)
                rows[b] = {"speedup": sp, "share": None if b == "instr" else share_interval(base, x, instr, rng)}
            results[f"{work}/{name}"] = {"cpu": cpu, "rows": rows}
            print(f"\n{name} ({d}): base {median(cpu['base']):.3f} s CPU, median of {args.rounds} rounds; speedup "
                  "over base per round, median (95% CI of the median); share of instrumented PGO's gain "
                  "[95% bootstrap interval]")
            for b, r in rows.items():
                share = "" if r["share"] is None else "  {:.0f}% [{:.0f}, {:.0f}]".format(
                    *(100 * v for v in r["share"]))
                print(f"  {b:<26} {fmt_ci(r['speedup'], 'x')}{share}", flush=True)
    print(f"\nraw data: {save(args.save_as, {'machine': machine(), 'args': vars(args), 'results': results})}")


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT / "src"))
    main()
