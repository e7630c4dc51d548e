"""Goal-directed value profiling against straightforward value profiling (the paper's Figure 2 and
Table 3, on sampling): extra CPU over plain sampling, bytes of value data, and the opportunities
kept; and, on the planted program, the saving `specialize` predicts against the speedup of the
version specialized by hand.

    python bench/specialize.py                       # planted, gzip, lua, sqlite; 3 rounds
    python bench/specialize.py --programs planted --rounds 5
    python bench/specialize.py --programs planted,planted-wide --goal-budget 0.1

"planted-wide" is the planted program with 65,536 elements per call instead of 256: its candidates'
entries run a few thousand times a second, so that `record --goal` can probe them at every execution
(values/probes.py) within a budget of a few percent; in "planted" they run 600,000 times a second
and only samples can afford them.

Each round runs, alternated: the program alone, `record` (plain sampling), `record --values`
(straightforward: every module, every sampled instruction's operands, results and loads) and
`record --goal PLAN` (the plan `specialize --plan` wrote from one plain recording beforehand).
Extra cost = CPU of the whole tree (recorder and program) minus the program alone.
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--programs", default="planted,gzip,lua,sqlite")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--save-as", default="specialize")
    ap.add_argument("--goal-budget", default=None,
                    help="record --goal's --goal-budget (default: the recorder's)")
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="cs-bench-spec-"))
    progs: list[tuple[str, Path, list[str]]] = []
    names = a.programs.split(",")
    if "planted" in names:
        exe = build("../tests/programs/specialize.c", tmp / "specialize")
        progs.append(("planted", exe, ["1500000"]))
    if "planted-wide" in names:
        exe = build("../tests/programs/specialize.c", tmp / "specialize")
        progs.append(("planted-wide", exe, ["12000", "x", "65536"]))
    rest = [n for n in names if n not in ("planted", "planted-wide")]
    if rest:
        from suite import programs

        profile_set, inp = programs(rest)
        progs += [(p.name, p.exe, [x.replace("{input}", str(inp)) for x in p.args]) for p in profile_set]
    results: dict[str, Any] = {"machine": machine(), "rate": RATE, "programs": {}}
    for name, exe, args in progs:
        plain0, plan = tmp / f"{name}-plain0", tmp / f"{name}-plan.json"
        r = run(cyclescope_cmd("record", "--db", str(plain0), "-q", "-F", RATE, "--", str(exe), *args))
        if r.returncode:
            raise SystemExit(f"{name}: record failed: {r.stderr[-600:]}")
        static = specialize(plain0, "--plan", str(plan))
        cpu: dict[str, list[float]] = {"alone": [], "plain": [], "straightforward": [], "goal": []}
        space: dict[str, list[int]] = {"straightforward": [], "goal": []}
        data: dict[str, list[int]] = {"straightforward": [], "goal": []}
        reps: dict[str, dict[str, Any]] = {}
        probed: list[str] = []
        goal_args = ["--goal", str(plan)] + (["--goal-budget", a.goal_budget] if a.goal_budget else [])
        for i in range(a.rounds):
            cpu["alone"].append(run([str(exe), *args]).cpu_s)
            for how, extra in (("plain", []), ("straightforward", ["--values"]), ("goal", goal_args)):
                db = tmp / f"{name}-{how}-{i}"
                quiet = ["-q"] if how != "goal" else []
                rr = run(cyclescope_cmd("record", "--db", str(db), *quiet, "-F", RATE, *extra, "--", str(exe), *args))
                if rr.returncode:
                    raise SystemExit(f"{name} {how}: {rr.stderr[-600:]}")
                if how == "goal":
                    probed += [x.strip().split(";")[0] for x in rr.stderr.split("exact:")[1:2]]
                cpu[how].append(rr.cpu_s)
                if how != "plain":
                    space[how].append(value_bytes(db))
                    data[how].append(value_data_bytes(db))
                    if i == 0:
                        reps[how] = specialize(db)
                if i > 0:
                    shutil.rmtree(db, ignore_errors=True)
        alone = median(cpu["alone"])
        extra_cost = {h: [c - alone for c in cpu[h]] for h in ("plain", "straightforward", "goal")}
        ratio = [(g - p) / (s - p) if s > p else float("nan")
                 for g, s, p in zip(cpu["goal"], cpu["straightforward"], cpu["plain"], strict=True)]
        out = {"counts": static["counts"], "cpu": cpu, "extra": extra_cost, "goal_over_straight_extra": ratio,
               "space": space, "space_ratio": median(space["goal"]) / max(1, median(space["straightforward"])),
               "data": data, "data_ratio": median(data["goal"]) / max(1, median(data["straightforward"])),
               "opportunities_kept": kept_share(reps["straightforward"], reps["goal"]),
               "top_goal": reps["goal"]["opportunities"][:5], "probes": probed,
               "top_straight": reps["straightforward"]["opportunities"][:5]}
        if name.startswith("planted"):
            t_gen, t_spec = [], []
            for _ in range(max(5, a.rounds)):
                t_gen.append(run([str(exe), *args]).cpu_s)
                t_spec.append(run([str(exe), *args, "spec"]).cpu_s)
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
        print(f"  value bytes: straightforward {median(space['straightforward']):,.0f}, goal "
              f"{median(space['goal']):,.0f} ({100 * out['space_ratio']:.1f}%); value data (column chunks): "
              f"straightforward {median(data['straightforward']):,.0f}, goal {median(data['goal']):,.0f} "
              f"({100 * out['data_ratio']:.1f}%)")
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
