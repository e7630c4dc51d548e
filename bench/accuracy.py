"""Accuracy of `calc`'s frequency estimates against exact counts (DCPI section 6.2).

For each program of the suite (bench/suite.py): callgrind --dump-instr=yes
--collect-jumps=yes gives the exact execution count of every instruction and
branch; the program is then profiled --runs times at --rate into one epoch;
every procedure of its image with at least --min-samples samples is run
through calc, and each instruction's estimated count F*P is compared with
the exact count times --runs.

Reported, as DCPI did: the share of CYCLES (cpu-clock) samples whose
estimate is within 5, 10 and 15% (DCPI on SPEC95: 73, 87, 92%); the share
of edge executions within 10% (DCPI: 58%); how much of the samples off by
more than 15% were marked low confidence; and the analysis time. Beyond DCPI's
figures, the share within a factor of 2 and the share off by more than 10 times:
how gross the errors outside 15% are.

The designs are measured from the same recordings (default `record` settings): calc as it is
(loop counters, anchors, trip windows and moving arguments where they hold, the model elsewhere),
calc without paths, calc without what the trip windows measured (their ratios, and how far
arguments move per entry), calc with DCPI's estimator, calc without any measured evidence (the
first design, DCPI's issue points), and the naive estimator (a block's samples over its
instructions). The blocks whose counts came from trip windows are reported
apart, against the same blocks' counts without them.

With ``--repeat N`` the programs that read the suite's input read it N times over (the kernels and
the demo run as always): runs of seconds, long enough for anchors to count (callgrind then takes
about 75 times as long).

Usage: python bench/accuracy.py [--programs kernels,demo,bzip2,gzip,xz,zlib,lua,sqlite,zstd,lzip] [--runs 3]
       [--repeat N] [--keep DIR]
"""

from __future__ import annotations

import argparse
import shlex
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from common import hot_procedures, machine, record_runs, run, save
from suite import Program, programs, repeated_input

BUCKETS = (0.05, 0.10, 0.15)


def callgrind_counts(p: Program, args: list[str], tmp: Path) -> Any:
    from cyclescope.analysis.callgrind import parse_callgrind

    out = tmp / f"cg-{p.name}.out"
    if out.exists():  # --keep: the program is deterministic, its counts do not change
        prof = parse_callgrind(out.read_text())
        return prof, prof.object_for(str(p.exe))
    r = run(["valgrind", "--tool=callgrind", "--dump-instr=yes", "--collect-jumps=yes",
             f"--callgrind-out-file={out}", str(p.exe), *args])
    if r.returncode != 0:
        raise SystemExit(f"callgrind failed for {p.name}: {r.stderr[-800:]}")
    prof = parse_callgrind(out.read_text())
    ob = prof.object_for(str(p.exe))
    if ob is None:
        raise SystemExit(f"{p.name}: {p.exe} not in the callgrind profile")
    return prof, ob


DESIGNS = ("calc", "nopaths", "notrips", "dcpi", "first", "naive")
DESIGN_NAMES = {"calc": "calc (anchors, loop counters, paths, then the model)",
                "nopaths": "calc without paths (anchors, loop counters, then the model)",
                "notrips": "calc without trip windows (their ratios, and arguments' moves per entry)",
                "dcpi": "calc --estimator dcpi",
                "first": "first design (issue points, DCPI)", "naive": "naive (block samples / instructions, CPI 1)"}


def _acc() -> dict[str, Any]:
    return {"samples": 0.0, "within": [0.0, 0.0, 0.0], "big_err": 0.0, "big_err_low": 0.0, "edge_exec": 0.0,
            "edge_within10": 0.0, "high_samples": 0.0, "high_within": [0.0, 0.0, 0.0], "by_method": {},
            "within_2x": 0.0, "off_10x": 0.0}


def analyze(p: Program, db: Path, prof: Any, ob: str, runs: int, min_samples: int,
            paths_from: Path | None = None, mcpu: str | None = None) -> dict[str, Any]:
    """Each design's estimates against the exact counts, from the same recordings: calc as it is
    (loop counters where they hold, the model elsewhere), calc without the loop counters (the first
    design), and the naive estimator (a block's samples over its instruction count at one cycle
    per instruction, BOLT's no-LBR rule made absolute)."""
    from cyclescope.app.calc import calc_target
    from cyclescope.app.profile import open_profile
    from cyclescope.db.layout import Database
    from cyclescope.db.query import Selection

    profile, ev, hot = hot_procedures(db, p.image, min_samples)
    other = open_profile(Database.open(paths_from), Selection(epochs="all")) if paths_from else None
    counts = prof.counts[ob]
    jumps = prof.jumps[ob]
    cond = prof.cond_exec[ob]
    out: dict[str, Any] = {k: _acc() for k in DESIGNS}
    out.update({"procedures": [], "time": 0.0, "never_ran": 0.0})
    for samples, t in hot:
        t0 = time.perf_counter()
        c = calc_target(profile, t, ev, mcpu, outcomes_from=other)
        dt = time.perf_counter() - t0
        out["time"] += dt
        c1 = calc_target(profile, t, ev, mcpu, estimator="dcpi", evidence=False)
        cg = calc_target(profile, t, ev, mcpu, estimator="dcpi")
        cn = calc_target(profile, t, ev, mcpu, paths=False)
        ct = calc_target(profile, t, ev, mcpu, trip_windows=False)
        if c.period_cycles is None:
            raise SystemExit("the clock was not measured: cannot compare absolute counts")
        ecol = c.events.index(ev)
        proc = {"name": t.name, "samples": samples, "seconds": dt, "blocks": []}
        for blk in c.cfg.blocks:
            s = float(c.samples[blk.first : blk.last + 1, ecol].sum())
            exact = counts.get(c.cfg.insns[blk.first].address, 0) * runs
            n = blk.last - blk.first + 1
            est = {"calc": (c.freq.block[blk.id] or 0.0) * c.period_cycles,
                   "nopaths": (cn.freq.block[blk.id] or 0.0) * c.period_cycles,
                   "notrips": (ct.freq.block[blk.id] or 0.0) * c.period_cycles,
                   "dcpi": (cg.freq.block[blk.id] or 0.0) * c.period_cycles,
                   "first": (c1.freq.block[blk.id] or 0.0) * c.period_cycles,
                   "naive": s / n * c.period_cycles}
            conf = {"calc": c.freq.block_confidence[blk.id], "nopaths": cn.freq.block_confidence[blk.id],
                    "notrips": ct.freq.block_confidence[blk.id],
                    "dcpi": cg.freq.block_confidence[blk.id], "first": c1.freq.block_confidence[blk.id], "naive": "low"}
            method = {"calc": c.freq.block_method[blk.id], "nopaths": cn.freq.block_method[blk.id],
                      "notrips": ct.freq.block_method[blk.id],
                      "dcpi": cg.freq.block_method[blk.id], "first": c1.freq.block_method[blk.id], "naive": "naive"}
            if s > 0:
                proc["blocks"].append({"start": blk.start, "samples": s, "exact": exact,
                                       **{f"est_{k}": v for k, v in est.items()},
                                       "confidence": conf["calc"], "method": method["calc"]})
            for kk in range(blk.first, blk.last + 1):
                si = float(c.samples[kk, ecol])
                if si <= 0:
                    continue
                ex = counts.get(c.cfg.insns[kk].address, 0) * runs
                if ex == 0 and exact == 0:
                    # Samples on code callgrind never saw run: programs that pick code by CPUID
                    # (xz) take other paths under valgrind's CPU. Not a valid comparison.
                    out["never_ran"] += si
                    continue
                for dname in DESIGNS:
                    a = out[dname]
                    e = abs((est[dname] - ex) / ex) if ex else float("inf")
                    a["samples"] += si
                    bm = a["by_method"].setdefault(method[dname], [0.0, 0.0])
                    bm[0] += si
                    high = conf[dname] == "high"
                    if high:
                        a["high_samples"] += si
                    for b, lim in enumerate(BUCKETS):
                        if e <= lim:
                            a["within"][b] += si
                            if high:
                                a["high_within"][b] += si
                    r = est[dname] / ex if ex else float("inf")
                    if 0.5 <= r <= 2:
                        a["within_2x"] += si
                    elif not 0.1 <= r <= 10:
                        a["off_10x"] += si
                    if e <= 0.15:
                        bm[1] += si
                    else:
                        a["big_err"] += si
                        if conf[dname] == "low":
                            a["big_err_low"] += si
        # Edges: exact counts from callgrind's jumps, fall-throughs from executions minus jumps.
        for dname, cc in (("calc", c), ("nopaths", cn), ("notrips", ct), ("dcpi", cg), ("first", c1)):
            for e in cc.cfg.edges:
                if e.src < 0 or e.dst < 0 or cc.freq.edge[e.id] is None:
                    continue
                last = cc.cfg.insns[cc.cfg.blocks[e.src].last]
                first_dst = cc.cfg.blocks[e.dst].start
                if e.kind in ("taken", "jump", "table"):
                    ex = jumps.get((last.address, first_dst), 0)
                elif e.kind == "fall":
                    ran = counts.get(last.address, 0)
                    taken = sum(v for (src, _), v in jumps.items() if src == last.address)
                    ex = ran - taken if last.address in cond or taken else ran
                else:
                    continue
                ex *= runs
                if ex <= 0:
                    continue
                est_e = (cc.freq.edge[e.id] or 0.0) * c.period_cycles
                out[dname]["edge_exec"] += ex
                if abs(est_e - ex) <= 0.10 * ex:
                    out[dname]["edge_within10"] += ex
        out["procedures"].append(proc)
    return out


def median_ratio(acc: dict[str, Any], design: str = "calc") -> float:
    """The sample-weighted median of estimate / exact over the analyzed blocks: below 1, the
    counts are low across the board (a bias, not noise)."""
    pairs = sorted((b[f"est_{design}"] / b["exact"], b["samples"]) for pr in acc["procedures"] for b in pr["blocks"]
                   if b["exact"] > 0)
    half, run = sum(w for _, w in pairs) / 2, 0.0
    for r, w in pairs:
        run += w
        if run >= half:
            return r
    return float("nan")


def trip_window_blocks(per_program: dict[str, Any]) -> dict[str, Any] | None:
    """The blocks whose count calc took from trip windows, and the same blocks' counts without
    them: estimate / exact (median and quartiles, weighted by samples) and the share within 15%
    (of samples, by block)."""
    blocks = [b for acc in per_program.values() for pr in acc["procedures"] for b in pr["blocks"]
              if b["method"] == "trip-window" and b["exact"] > 0]
    if not blocks:
        return None
    out: dict[str, Any] = {"samples": sum(b["samples"] for b in blocks)}
    for design in ("calc", "notrips"):
        pairs = sorted((b[f"est_{design}"] / b["exact"], b["samples"]) for b in blocks)
        total, qs, run, at = sum(w for _, w in pairs), [], 0.0, 0
        for q in (0.25, 0.5, 0.75):
            while at < len(pairs) - 1 and run + pairs[at][1] < q * total:
                run += pairs[at][1]
                at += 1
            qs.append(pairs[at][0])
        out[design] = f"{qs[1]:.2f} [{qs[0]:.2f}, {qs[2]:.2f}]"
        out[f"{design}_within"] = 100 * sum(w for r, w in pairs if abs(r - 1) <= 0.15) / total
    return out


def line(name: str, a: dict[str, Any]) -> str:
    s = a["samples"] or 1.0
    return (f"{name}: " + ", ".join(f"within {int(100 * b)}% {100 * w / s:5.1f}%" for b, w in zip(BUCKETS, a["within"],
                                                                                             strict=True))
            + f"; within 2x {100 * a['within_2x'] / s:5.1f}%, off by over 10x {100 * a['off_10x'] / s:5.1f}%"
            + f"; edges within 10% {100 * a['edge_within10'] / max(1, a['edge_exec']):5.1f}%"
            + f"; >15% errors marked low {100 * a['big_err_low'] / max(1, a['big_err']):5.1f}%"
            + f"; high confidence {100 * a['high_samples'] / s:4.1f}% of samples, "
            + f"{100 * a['high_within'][2] / max(1, a['high_samples']):5.1f}% of them within 15%")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--programs", default="kernels,demo,bzip2,gzip,xz,zlib,lua,sqlite,zstd,lzip")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--rate", type=int, default=5000)
    ap.add_argument("--min-samples", type=int, default=100)
    ap.add_argument("--record-args", metavar="ARGS", default="",
                    help="more options of `record`, as one string (say, '--no-paths')")
    ap.add_argument("--paths-from", metavar="DIR",
                    help="calc's branch outcomes from the databases in DIR (kept recordings of the same "
                         "programs, say with `--values edges --exact interpret`) instead of the recordings' own")
    ap.add_argument("--keep", metavar="DIR", help="keep (and reuse) recordings and callgrind output in DIR")
    ap.add_argument("--save-as", default="accuracy", help="bench/out/NAME.json")
    ap.add_argument("--repeat", type=int, default=1,
                    help="the suite's input this many times over: runs long enough for anchors (bench/anchorlong.py)")
    ap.add_argument("--mcpu", metavar="CPU", help="calc's llvm-mca CPU model (default: this machine's)")
    ap.add_argument("--exe", metavar="PATH", help="with one program: analyze this build of it instead of the "
                                                   "suite's (say, the clang build bench/optimize.py uses)")
    args = ap.parse_args()
    progs, _ = programs(args.programs.split(","))
    inp = repeated_input(args.repeat)
    if args.exe:
        if len(progs) != 1:
            raise SystemExit("--exe needs exactly one program in --programs")
        exe = Path(args.exe).resolve()
        progs = [Program(progs[0].name, exe, progs[0].args, exe.name)]
    tmp = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="cs-acc-"))
    tmp.mkdir(parents=True, exist_ok=True)
    totals: dict[str, Any] = {k: _acc() for k in DESIGNS}
    totals.update({"time": 0.0, "never_ran": 0.0})
    per_program = {}
    for p in progs:
        pargs = [a.replace("{input}", str(inp)) for a in p.args]
        prof, ob = callgrind_counts(p, pargs, tmp)
        db = tmp / f"{p.name}.db"
        record_runs(db, args.runs, args.rate, p.exe, pargs, p.name, shlex.split(args.record_args))
        acc = analyze(p, db, prof, ob, args.runs, args.min_samples,
                      Path(args.paths_from) / f"{p.name}.db" if args.paths_from else None, args.mcpu)
        per_program[p.name] = acc
        print(f"{p.name}: {len(acc['procedures'])} procedures, {acc['calc']['samples']:,.0f} samples analyzed, "
              f"analysis {acc['time']:.1f} s; weighted median of estimate/exact: "
              + ", ".join(f"{k} {median_ratio(acc, k):.2f}" for k in DESIGNS), flush=True)
        for k in DESIGNS:
            print("   " + line(k, acc[k]), flush=True)
        for k in DESIGNS:
            t, a = totals[k], acc[k]
            for f in ("samples", "big_err", "big_err_low", "edge_exec", "edge_within10", "high_samples",
                      "within_2x", "off_10x"):
                t[f] += a[f]
            for b in range(3):
                t["within"][b] += a["within"][b]
                t["high_within"][b] += a["high_within"][b]
            for m, (n, w) in a["by_method"].items():
                tm = t["by_method"].setdefault(m, [0.0, 0.0])
                tm[0] += n
                tm[1] += w
        totals["time"] += acc["time"]
        totals["never_ran"] += acc["never_ran"]
    print("\nall programs (DCPI on SPEC95: within 5/10/15% 73/87/92%, edges within 10% 58%):")
    for k in DESIGNS:
        print("  " + line(DESIGN_NAMES[k], totals[k]))
    c = totals["calc"]
    print("calc's samples by what their block's count rests on (share of samples, share of those within 15%): "
          + ", ".join(f"{m} {100 * n / max(1, c['samples']):.1f}% ({100 * w / max(1, n):.0f}%)"
                      for m, (n, w) in sorted(c["by_method"].items(), key=lambda kv: -kv[1][0])))
    tw = trip_window_blocks(per_program)
    if tw:
        print(f"blocks counted by trip windows: {tw['samples']:,.0f} samples; estimate/exact, sample-weighted "
              f"median [quartiles]: calc {tw['calc']}, without trip windows {tw['notrips']}; within 15%: "
              f"{tw['calc_within']:.1f}% against {tw['notrips_within']:.1f}%")
    print(f"left out: {totals['never_ran']:,.0f} samples on code callgrind never saw run (CPU dispatch differs "
          "under valgrind)")
    print(f"analysis time (calc, all procedures analyzed): {totals['time']:.1f} s")
    path = save(args.save_as, {"machine": machine(), "args": vars(args), "programs": per_program,
                             "totals": totals})
    print(f"raw data: {path}")
    if not args.keep:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
