"""Goal-directed value profiling against straightforward value profiling (the paper's Figure 2 and
Table 3, on sampling): extra CPU over plain sampling, bytes of value data, and the opportunities
kept; and, on the planted program, the saving `specialize` predicts against the speedup of the
version specialized by hand.

    python bench/specialize.py                       # planted, gzip, lua, sqlite; 3 rounds
    python bench/specialize.py --programs planted --rounds 5
    python bench/specialize.py --programs planted,planted-wide --goal-budget 0.1
    python bench/specialize.py --lengths 1,4         # each program at two lengths: fixed and marginal costs

"planted-wide" is the planted program with 65,536 elements per call instead of 256: its candidates'
entries run a few thousand times a second, so that `record --goal` can probe them at every execution
(values/probes.py) within a budget of a few percent; in "planted" they run 600,000 times a second
and only samples can afford them.

Each round runs, alternated: the program alone, `record` (plain sampling), `record --values`
(straightforward: every module, every sampled instruction's operands, results and loads) and
`record --goal PLAN` (the plan `specialize --plan` wrote from one plain recording beforehand).
Extra cost = CPU of the whole tree (recorder and program) minus the program alone.

With ``--lengths 1,K`` every round also runs each program K times as long (planted's calls, the
suite's input K times over), alternated with the others, and each contender's value cost (its extra
CPU minus plain sampling's in the same round) is split into a fixed part and a marginal part: the
value cost per second of the program's own time, the slope between the two lengths. The paper's
time figure compares instrumentation paid per execution; the marginal part is its counterpart here,
and the fixed part (the recorder's start-up with value capture, the plan, the values files) is
reported beside it.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, build, cyclescope_cmd, fmt_spread, machine, median, run, save

RATE = "2000"


def value_bytes(db: Path) -> int:
    return sum(f.stat().st_size for f in db.rglob("*") if f.is_file() and "values" in f.parts)


def value_data_bytes(db: Path) -> int:
    """The stored value data: the compressed size of the values files' column chunks (hotlist keys,
    values, counts), without the files' fixed part (schema, footer, per-file metadata)."""
    import pyarrow.parquet as pq

    total = 0
    for f in db.rglob("*.parquet"):
        if "values" not in f.parts:
            continue
        md = pq.ParquetFile(f).metadata
        total += sum(md.row_group(g).column(c).total_compressed_size
                     for g in range(md.num_row_groups) for c in range(md.num_columns))
    return total


def value_rows(db: Path) -> int:
    """Hotlist rows in the values files (the paper's space counts profile entries)."""
    import pyarrow.parquet as pq

    return sum(pq.ParquetFile(f).metadata.num_rows for f in db.rglob("*.parquet") if "values" in f.parts)


def specialize(db: Path, *extra: str) -> dict[str, Any]:
    r = run(cyclescope_cmd("specialize", "--db", str(db), "--json", *extra))
    if r.returncode != 0:
        raise SystemExit(f"specialize failed: {r.stderr[-600:]}")
    return json.loads(r.stdout)


def kept_share(straight: dict[str, Any], goal: dict[str, Any]) -> float | None:
    """Of straightforward profiling's opportunities, the share (weighted by net benefit) that goal-directed
    profiling also finds (the same procedure, register and value)."""
    found = {(o["procedure"], o["what"], o["value"]) for o in goal["opportunities"]}
    tot = sum(o["net"] for o in straight["opportunities"])
    if tot <= 0:
        return None
    return sum(o["net"] for o in straight["opportunities"] if (o["procedure"], o["what"], o["value"]) in found) / tot


def marginal(cpu: dict[int, dict[str, list[float]]], lengths: list[int]) -> dict[str, Any]:
    """Each contender's value cost (its CPU minus plain sampling's, round by round) at the shortest and
    longest length, split into a fixed part and a marginal part per second of the program alone:
    slope = (cost(long) - cost(short)) / (alone(long) - alone(short)), fixed = cost(short) - slope x
    alone(short); per round (rounds pair the lengths), and the slopes' ratio goal / straightforward."""
    lo, hi = min(lengths), max(lengths)
    alone = {k: median(cpu[k]["alone"]) for k in lengths}
    cost = {k: {h: [c - p for c, p in zip(cpu[k][h], cpu[k]["plain"], strict=True)]
                for h in ("straightforward", "goal")} for k in lengths}
    dt = alone[hi] - alone[lo]
    slope = {h: [(b - x) / dt for x, b in zip(cost[lo][h], cost[hi][h], strict=True)] for h in cost[lo]}
    fixed = {h: [x - s * alone[lo] for x, s in zip(cost[lo][h], slope[h], strict=True)] for h in cost[lo]}
    ratio = [g / s if s > 0 else float("nan") for g, s in zip(slope["goal"], slope["straightforward"], strict=True)]
    return {"alone": {str(k): v for k, v in alone.items()}, "value_cost": {str(k): v for k, v in cost.items()},
            "slope": slope, "fixed": fixed, "slope_ratio": ratio}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--programs", default="planted,gzip,lua,sqlite")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--save-as", default="specialize")
    ap.add_argument("--goal-budget", default=None,
                    help="record --goal's --goal-budget (default: the recorder's)")
    ap.add_argument("--lengths", default="1", metavar="K[,K]",
                    help="run each program at these multiples of its length, alternated (two: fixed and "
                         "marginal costs apart)")
    a = ap.parse_args()
    lengths = [int(x) for x in a.lengths.split(",")]
    if not lengths or any(k < 1 for k in lengths) or len(set(lengths)) != len(lengths):
        raise SystemExit("--lengths: distinct positive integers, e.g. 1,4")
    tmp = Path(tempfile.mkdtemp(prefix="cs-bench-spec-"))
    # name, its command at each length, and (planted) the command of the version specialized by hand
    progs: list[tuple[str, dict[int, list[str]], list[str] | None]] = []
    names = a.programs.split(",")
    if "planted" in names:
        exe = build("../tests/programs/specialize.c", tmp / "specialize")
        progs.append(("planted", {k: [str(exe), str(1500000 * k)] for k in lengths},
                      [str(exe), str(1500000 * lengths[0]), "spec"]))
    if "planted-wide" in names:
        exe = build("../tests/programs/specialize.c", tmp / "specialize")
        progs.append(("planted-wide", {k: [str(exe), str(12000 * k), "x", "65536"] for k in lengths},
                      [str(exe), str(12000 * lengths[0]), "spec", "65536"]))
    rest = [n for n in names if n not in ("planted", "planted-wide")]
    if rest:
        from suite import programs, repeated_input

        profile_set, _ = programs(rest)
        inputs = {k: repeated_input(k) for k in lengths}
        for p in profile_set:
            if any("{input}" in x for x in p.args):  # longer: the input k times over
                cmds = {k: [str(p.exe), *(x.replace("{input}", str(inputs[k])) for x in p.args)] for k in lengths}
            else:  # a fixed script (Lua's, SQLite's): run k times, one after the other
                cmds = {k: [str(p.exe), *p.args] if k == 1 else
                        ["/bin/sh", "-c", f'i=0; while [ $i -lt {k} ]; do "$0" "$@" || exit 1; i=$((i+1)); done',
                         str(p.exe), *p.args] for k in lengths}
            progs.append((p.name, cmds, None))
    results: dict[str, Any] = {"machine": machine(), "rate": RATE, "programs": {}}
    for name, by_length, spec_cmd in progs:
        args = by_length[lengths[0]]
        plain0, plan = tmp / f"{name}-plain0", tmp / f"{name}-plan.json"
        r = run(cyclescope_cmd("record", "--db", str(plain0), "-q", "-F", RATE, "--", *args))
        if r.returncode:
            raise SystemExit(f"{name}: record failed: {r.stderr[-600:]}")
        static = specialize(plain0, "--plan", str(plan))
        hows = ("plain", "straightforward", "goal")
        # per length: CPU of each contender per round, and the values files' bytes, data and rows
        cpu: dict[int, dict[str, list[float]]] = {k: {h: [] for h in ("alone", *hows)} for k in lengths}
        space: dict[int, dict[str, list[float]]] = {k: {h: [] for h in hows[1:]} for k in lengths}
        data: dict[int, dict[str, list[float]]] = {k: {h: [] for h in hows[1:]} for k in lengths}
        rows: dict[int, dict[str, list[float]]] = {k: {h: [] for h in hows[1:]} for k in lengths}
        reps: dict[str, dict[str, Any]] = {}
        probed: list[str] = []
        goal_args = ["--goal", str(plan)] + (["--goal-budget", a.goal_budget] if a.goal_budget else [])
        for i in range(a.rounds):
            for k in (lengths if i % 2 == 0 else lengths[::-1]):
                kargs = by_length[k]
                cpu[k]["alone"].append(run(kargs).cpu_s)
                for how, extra in (("plain", []), ("straightforward", ["--values"]), ("goal", goal_args)):
                    db = tmp / f"{name}-{how}-{i}-{k}"
                    quiet = ["-q"] if how != "goal" else []
                    rr = run(cyclescope_cmd("record", "--db", str(db), *quiet, "-F", RATE, *extra, "--", *kargs))
                    if rr.returncode:
                        raise SystemExit(f"{name} {how}: {rr.stderr[-600:]}")
                    if how == "goal" and k == lengths[0]:
                        probed += [x.strip().split(";")[0] for x in rr.stderr.split("exact:")[1:2]]
                    cpu[k][how].append(rr.cpu_s)
                    if how != "plain":
                        space[k][how].append(value_bytes(db))
                        data[k][how].append(value_data_bytes(db))
                        rows[k][how].append(value_rows(db))
                        if i == 0 and k == lengths[0]:
                            reps[how] = specialize(db)
                    shutil.rmtree(db, ignore_errors=True)
        k0 = lengths[0]
        alone = median(cpu[k0]["alone"])
        extra_cost = {h: [c - alone for c in cpu[k0][h]] for h in hows}
        ratio = [(g - p) / (s - p) if s > p else float("nan")
                 for g, s, p in zip(cpu[k0]["goal"], cpu[k0]["straightforward"], cpu[k0]["plain"], strict=True)]
        def share(d: dict[str, list[float]]) -> float:
            return median(d["goal"]) / max(1.0, median(d["straightforward"]))

        out: dict[str, Any] = {
               "counts": static["counts"], "cpu": cpu[k0], "extra": extra_cost, "goal_over_straight_extra": ratio,
               "space": space[k0], "space_ratio": share(space[k0]), "data": data[k0], "data_ratio": share(data[k0]),
               "rows": rows[k0], "rows_ratio": share(rows[k0]),
               "opportunities_kept": kept_share(reps["straightforward"], reps["goal"]),
               "top_goal": reps["goal"]["opportunities"][:5], "probes": probed,
               "top_straight": reps["straightforward"]["opportunities"][:5]}
        if len(lengths) > 1:
            out["lengths"] = {str(k): {"cpu": cpu[k], "space": space[k], "data": data[k], "rows": rows[k]}
                              for k in lengths}
            out["marginal"] = marginal(cpu, lengths)
        if spec_cmd is not None:
            t_gen, t_spec = [], []
            for _ in range(max(5, a.rounds)):
                t_gen.append(run(args).cpu_s)
                t_spec.append(run(spec_cmd).cpu_s)
            measured = 1 - median(t_spec) / median(t_gen)
            pred = sum(o["share"] for o in reps["goal"]["opportunities"]
                       if o["procedure"] in ("bucket_sum", "scaled") and o["kind"] == "argument")
            out["truth"] = {"generic_s": t_gen, "specialized_s": t_spec, "measured_saving": measured,
                            "predicted_saving": pred}
        results["programs"][name] = out
        c = static["counts"]
        print(f"{name}: {c['instructions']:,} instructions in the hot procedures, {c['candidates']:,} candidates, "
              f"{c['loads']:,} loads, {c['kept']:,} kept ({100 * c['kept'] / max(1, c['candidates']):.1f}%)")
        for h in ("plain", "straightforward", "goal"):
            print(f"  extra CPU {h:16s} {fmt_spread(extra_cost[h], ' s')}")
        print(f"  goal's extra over straightforward's (values only, plain subtracted): {fmt_spread(ratio)}")
        print(f"  value bytes: straightforward {median(space[k0]['straightforward']):,.0f}, goal "
              f"{median(space[k0]['goal']):,.0f} ({100 * out['space_ratio']:.1f}%); value data (column chunks): "
              f"straightforward {median(data[k0]['straightforward']):,.0f}, goal {median(data[k0]['goal']):,.0f} "
              f"({100 * out['data_ratio']:.1f}%)")
        print(f"  hotlist rows: straightforward {median(rows[k0]['straightforward']):,.0f}, goal "
              f"{median(rows[k0]['goal']):,.0f} ({100 * out['rows_ratio']:.1f}%)")
        if "marginal" in out:
            mg = out["marginal"]
            for k in lengths:
                print(f"  x{k}: program alone {median(cpu[k]['alone']):.2f} s; value cost straightforward "
                      f"{fmt_spread(mg['value_cost'][str(k)]['straightforward'], ' s')}, goal "
                      f"{fmt_spread(mg['value_cost'][str(k)]['goal'], ' s')}; value data straightforward "
                      f"{median(data[k]['straightforward']):,.0f}, goal {median(data[k]['goal']):,.0f}; rows "
                      f"{median(rows[k]['straightforward']):,.0f} / {median(rows[k]['goal']):,.0f}")
            for h in ("straightforward", "goal"):
                print(f"  {h}: marginal value cost {fmt_spread(mg['slope'][h], ' s', 4)} a second of the "
                      f"program, fixed {fmt_spread(mg['fixed'][h], ' s')}")
            print(f"  goal's marginal value cost / straightforward's: {fmt_spread(mg['slope_ratio'])}")
        if probed:
            print(f"  probes (record --goal): {probed[0]}")
        ks = out["opportunities_kept"]
        print(f"  opportunities of straightforward profiling also found by goal (by net benefit): "
              f"{'-' if ks is None else f'{100 * ks:.0f}%'} ({len(reps['straightforward']['opportunities'])} vs "
              f"{len(reps['goal']['opportunities'])})")
        if "truth" in out:
            t = out["truth"]
            print(f"  truth: specializing bucket_sum and scaled by hand saves {100 * t['measured_saving']:.1f}% of the "
                  f"CPU; specialize predicted {100 * t['predicted_saving']:.1f}%")
    print(f"saved {save(a.save_as, results)}")
    shutil.rmtree(tmp, ignore_errors=True)
    _ = ROOT


if __name__ == "__main__":
    main()
