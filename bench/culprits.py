"""calc's stall culprits against a cache and branch simulation of the same program.

callgrind with --cache-sim=yes --branch-sim=yes --dump-instr=yes gives, per instruction, its
executions, D1 misses (reads and writes: D1mr, D1mw), last-level misses and branch mispredictions
(conditional Bcm, indirect Bim). Each program is then recorded --runs times at --rate (default
record settings) and every procedure with at least --min-samples samples goes through calc. calc
blames each dynamic stall on candidate culprits: D-cache (the loads in the stall's skid window) and
mispredict (the branch that entered the block); a culprit's blame is the stall's cycles times the
stalled instruction's executions, shared among its candidates.

Measured at instruction level, for D-cache and mispredict blame:
- precision: the share of blame (weighted) on instructions the simulation shows missing (at least
  --miss-rate of their executions miss D1) or mispredicting (at least --miss-rate of their
  executions mispredict);
- recall: of the misses (mispredicts) of such instructions in the analyzed procedures, the share at
  instructions calc blames at all.

The simulation is valgrind's model of a cache and a predictor, not this CPU: it is the reference
the issue asks for, not ground truth about Zen.

Usage: python bench/culprits.py [--programs kernels,demo,bzip2,gzip] [--runs 3]
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from collections import defaultdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from common import hot_procedures, machine, record_runs, run, save
from suite import Program, programs


def simulate(p: Program, args: list[str], tmp: Path) -> Any:
    from cyclescope.analysis.callgrind import parse_callgrind

    out = tmp / f"cgsim-{p.name}.out"
    if not out.exists():
        r = run(["valgrind", "--tool=callgrind", "--cache-sim=yes", "--branch-sim=yes", "--dump-instr=yes",
                 f"--callgrind-out-file={out}", str(p.exe), *args])
        if r.returncode != 0:
            raise SystemExit(f"callgrind failed for {p.name}: {r.stderr[-800:]}")
    prof = parse_callgrind(out.read_text(), keep_all=True)
    ob = prof.object_for(str(p.exe))
    if ob is None:
        raise SystemExit(f"{p.name}: {p.exe} not in the callgrind profile")
    return prof, ob


def analyze(p: Program, db: Path, prof: Any, ob: str, min_samples: int, rate: float) -> dict[str, Any]:
    from cyclescope.app.calc import calc_target

    profile, ev, hot = hot_procedures(db, p.image, min_samples)
    execs = prof.counts[ob]
    d1 = defaultdict(int)
    for name in ("D1mr", "D1mw"):
        for a, v in prof.event(ob, name).items():
            d1[a] += v
    mis = defaultdict(int)
    for name in ("Bcm", "Bim"):
        for a, v in prof.event(ob, name).items():
            mis[a] += v
    truth = {"d": (d1, {a for a, v in d1.items() if v >= rate * max(1, execs.get(a, 0))}),
             "p": (mis, {a for a, v in mis.items() if v >= rate * max(1, execs.get(a, 0))})}
    out: dict[str, Any] = {c: {"blame": 0.0, "blame_right": 0.0, "misses": 0.0, "misses_blamed": 0.0,
                               "blamed": 0, "significant": 0} for c in "dp"}
    for _samples, t in hot:
        c = calc_target(profile, t, ev, None)
        if c.period_cycles is None:
            continue
        blamed: dict[str, dict[int, float]] = {"d": defaultdict(float), "p": defaultdict(float)}
        for kk, st in enumerate(c.culprits):
            if st is None:
                continue
            f = c.freq.block[c.cfg.block_of[kk]]
            if not f:
                continue
            weight = st.cycles * f * c.period_cycles
            for code in "dp":
                if code in st.codes:
                    cands = st.culprit_addrs.get(code) or [c.cfg.insns[kk].address]
                    for a in cands:
                        blamed[code][a] += weight / len(cands)
        addrs = {ins.address for ins in c.cfg.insns}
        for code in "dp":
            counts, significant = truth[code]
            o = out[code]
            for a, w in blamed[code].items():
                o["blame"] += w
                o["blamed"] += 1
                if a in significant:
                    o["blame_right"] += w
            for a in significant & addrs:
                o["significant"] += 1
                o["misses"] += counts[a]
                if a in blamed[code]:
                    o["misses_blamed"] += counts[a]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--programs", default="kernels,demo,bzip2,gzip")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--rate", type=int, default=5000)
    ap.add_argument("--min-samples", type=int, default=100)
    ap.add_argument("--miss-rate", type=float, default=0.02,
                    help="an instruction misses (mispredicts) when at least this share of its executions do")
    ap.add_argument("--keep", metavar="DIR", help="keep (and reuse) recordings and simulations in DIR")
    ap.add_argument("--save-as", default="culprits", help="bench/out/NAME.json")
    args = ap.parse_args()
    progs, inp = programs(args.programs.split(","))
    tmp = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="cs-culprits-"))
    tmp.mkdir(parents=True, exist_ok=True)
    totals = {c: defaultdict(float) for c in "dp"}
    per: dict[str, Any] = {}
    names = {"d": "D-cache miss", "p": "mispredict"}
    for p in progs:
        pargs = [a.replace("{input}", str(inp)) for a in p.args]
        prof, ob = simulate(p, pargs, tmp)
        db = tmp / f"{p.name}.db"
        record_runs(db, args.runs, args.rate, p.exe, pargs, p.name)
        res = analyze(p, db, prof, ob, args.min_samples, args.miss_rate)
        per[p.name] = res
        for code in "dp":
            o = res[code]
            for k, v in o.items():
                totals[code][k] += v
            prec = 100 * o["blame_right"] / max(1e-9, o["blame"])
            rec = 100 * o["misses_blamed"] / max(1, o["misses"])
            print(f"{p.name:>8} {names[code]:>13}: precision {prec:5.1f}% of blame ({o['blamed']:.0f} instructions "
                  f"blamed), recall {rec:5.1f}% of the misses at {o['significant']:.0f} instructions the simulation "
                  "shows missing", flush=True)
    for code in "dp":
        o = totals[code]
        print(f"all programs, {names[code]}: precision {100 * o['blame_right'] / max(1e-9, o['blame']):.1f}%, "
              f"recall {100 * o['misses_blamed'] / max(1, o['misses']):.1f}%")
    print(f"raw data: {save(args.save_as, {'machine': machine(), 'args': vars(args), 'programs': per})}")
    if not args.keep:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
