"""Overhead of value sampling, in the form of the value-sampling paper's Table 2.

Contenders, alternated within each round on the calibrated workload (bench/workload.c), all at
5 kHz with cyclescope's own CPU counted:
  none                    the workload alone
  plain                   cyclescope record (PC samples only)
  capture                 --values --interpret 0 (registers and stack at the interrupt)
  L=<L> 1/<k>             --values --interpret L --interpret-every k

overhead = (target CPU + profiler CPU - the unprofiled target's CPU of the same round) / that;
the ratio to plain sampling's overhead is taken per round (paired). Target: L=4 at 1/2 costs at
most 1.5x plain sampling (the paper: 10.7% against 3.9%).

Two figures per contender: the overhead of the whole `record` run, and the steady state: the
same less the profiler's fixed cost (start-up: imports, kernel symbols, the first look at the
images; the final flush), measured in the same round by a run of the same contender on a
workload of --short seconds. The paper's daemon runs for days: its overhead is the steady state.

Usage: python bench/values.py [--runs 3] [--seconds 8] [--lengths 4,16,64] [--every 2,8,32]
"""

from __future__ import annotations

import argparse
import re
import tempfile
from pathlib import Path
from typing import Any

from common import Run, build, cyclescope_cmd, cyclescope_samples, fmt_spread, machine, median, run, save, workload_cpu


def contenders(lengths: list[int], every: list[int]) -> list[tuple[str, list[str]]]:
    out: list[tuple[str, list[str]]] = [("none", []), ("plain", []), ("capture", ["--values", "--interpret", "0"])]
    for L in lengths:
        for k in every:
            out.append((f"L={L} 1/{k}", ["--values", "--interpret", str(L), "--interpret-every", str(k)]))
    return out


def measure(name: str, flags: list[str], exe: Path, secs: float, tmp: Path, rate: int) -> dict[str, Any]:
    wl = [str(exe), str(secs)]
    cmd = wl if name == "none" else cyclescope_cmd("record", "--db", str(tmp / "db"), "-F", str(rate), *flags,
                                                    "--", *wl)
    r: Run = run(cmd)
    if r.returncode != 0:
        raise RuntimeError(f"{name} failed: {r.stderr[-800:]}")
    tcpu, _ = workload_cpu(r.stdout)
    interp = re.search(r"([\d,]+) interpreted runs, ([\d.]+) steps each \(stops: ([^)]*)\)", r.stderr)
    over = re.search(r"interpretation over CPU budget ([\d,]+)", r.stderr)
    return {
        "contender": name, "target_cpu": tcpu, "own_cpu": max(0.0, r.cpu_s - tcpu), "wall": r.wall_s,
        "samples": cyclescope_samples(r.stderr) if name != "none" else 0,
        "interpreted": int(interp.group(1).replace(",", "")) if interp else 0,
        "steps": float(interp.group(2)) if interp else 0.0, "stops": interp.group(3) if interp else "",
        "over_budget": int(over.group(1).replace(",", "")) if over else 0,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--rate", type=int, default=5000)
    ap.add_argument("--lengths", default="4,16,64")
    ap.add_argument("--every", default="2,8,32")
    ap.add_argument("--short", type=float, default=0.05, help="workload seconds of the fixed-cost run")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="cs-bench-values-"))
    exe = build("workload.c", tmp / "workload")
    cons = contenders([int(x) for x in args.lengths.split(",")], [int(x) for x in args.every.split(",")])
    for name, flags in cons[:3]:  # warm-up: kernel symbols, caches
        measure(name, flags, exe, 0.5, tmp, args.rate)
    rows: list[dict[str, Any]] = []
    for rnd in range(args.runs):
        order = cons[rnd % len(cons):] + cons[: rnd % len(cons)]
        for name, flags in order:
            m = measure(name, flags, exe, args.seconds, tmp, args.rate)
            m["round"] = rnd
            m["fixed_own"] = measure(name, flags, exe, args.short, tmp, args.rate)["own_cpu"] if name != "none" else 0.0
            rows.append(m)
            print(f"round {rnd} {name:>12}: target {m['target_cpu']:.2f} s, own {m['own_cpu']:.2f} s, "
                  f"{m['samples']} samples, {m['interpreted']} interpreted, {m['over_budget']} over budget", flush=True)
    base = {r["round"]: r["target_cpu"] for r in rows if r["contender"] == "none"}
    for r in rows:
        b = base[r["round"]]
        r["overhead"] = (r["target_cpu"] + r["own_cpu"] - b) / b
        r["steady"] = (r["target_cpu"] + r["own_cpu"] - r["fixed_own"] - b) / b
    plain = {r["round"]: r["overhead"] for r in rows if r["contender"] == "plain"}
    plain_steady = {r["round"]: r["steady"] for r in rows if r["contender"] == "plain"}
    print(f"\nValue sampling overhead at {args.rate} Hz, {args.runs} rounds of {args.seconds:g} s "
          "(median [quartiles]; overhead = extra CPU / unprofiled CPU)\n")
    print(f"{'configuration':>13}  {'overhead':>22}  {'x plain':>19}  {'steady state':>22}  {'x plain':>19}  "
          f"{'own CPU s':>19}  {'fixed s':>6}  {'interpreted':>11}  {'over budget':>11}  steps  stops")
    summary = {}
    for name, _ in cons[1:]:
        mine = [r for r in rows if r["contender"] == name]
        ov = [100 * r["overhead"] for r in mine]
        ratio = [r["overhead"] / plain[r["round"]] for r in mine if plain.get(r["round"])]
        own = [r["own_cpu"] for r in mine]
        st = [100 * r["steady"] for r in mine]
        st_ratio = [r["steady"] / plain_steady[r["round"]] for r in mine if plain_steady.get(r["round"], 0) > 0]
        fixed = median([r["fixed_own"] for r in mine])
        interp = median([r["interpreted"] for r in mine])
        over = median([r["over_budget"] for r in mine])
        steps = median([r["steps"] for r in mine])
        stops = mine[-1]["stops"] if mine else ""
        summary[name] = {"overhead_pct": ov, "ratio": ratio, "steady_pct": st, "steady_ratio": st_ratio,
                         "own_cpu": own, "fixed_own": fixed}
        print(f"{name:>13}  {fmt_spread(ov, '%', 1):>22}  {fmt_spread(ratio, 'x', 2):>19}  "
              f"{fmt_spread(st, '%', 1):>22}  {fmt_spread(st_ratio, 'x', 2):>19}  "
              f"{fmt_spread(own, '', 2):>19}  {fixed:6.2f}  {interp:>11,.0f}  {over:>11,.0f}  {steps:5.1f}  {stops}")
    path = save("values_overhead", {"machine": machine(), "args": vars(args), "rows": rows, "summary": summary})
    print(f"\ntarget: L=4 1/2 at most 1.5x plain; raw data: {path}")


if __name__ == "__main__":
    main()
