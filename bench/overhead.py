"""Overhead of sampling: nothing vs `perf record` vs `cyclescope record`, alternated in one run.

For each round and rate, the three contenders run the same calibrated CPU-bound
workload one after the other (the order rotates between rounds). Measured:
- the target's own CPU time (the workload reports its rusage),
- the profiler's own CPU time (the tree's rusage from wait4 minus the target's),
- extra CPU = target + profiler - the unprofiled target of the same round.
Ratios cyclescope/perf are taken per round (paired) and reported as
median [lower quartile, upper quartile].

The marginal user-space cost per sample is the slope of the profiler's own
user time against its sample count over two workload lengths (so the fixed
start-up of a Python process is separated from the per-sample cost).

With stacks and system-wide (issue 28): --system-wide samples every CPU (-a) while --copies
workloads run, and these contenders compare the collection paths:
  perf-fp, perf-dwarf   perf record -g (frame pointers) / --call-graph dwarf
  bpf, bpf-fp           cyclescope counting in the kernel (--collector bpf), flat / with -g fp
  bpf-dwarf             the same with -g dwarf: stacks walked in the kernel with .eh_frame
  ring, ring-fp         cyclescope reading every sample from the rings (--collector perf)
(all cyclescope contenders with --no-loop-counts, which need each sample's registers), e.g.
  python bench/overhead.py --system-wide --copies 2 --rates 5000 \
      --contenders perf,perf-fp,perf-dwarf,bpf,bpf-fp,ring,ring-fp --marginal-lengths 4
What calc's evidence costs per task: cyclescope (the default: loop counts, anchors and trip windows),
notrips (--no-trip-windows), nostack (--loop-stack 0: the samples carry no stack words), noanchors
(--no-anchors: no trip windows either), plain (--no-loop-counts), flat (--no-loop-counts --no-anchors: eBPF).
--marginal-rates 1000,10000 takes the per-sample slope between two rates at one length instead of
two lengths at one rate (work paid per second then cancels out).

Usage: python bench/overhead.py [--rates 1000,5000,10000] [--runs 5] [--seconds 8]
"""

from __future__ import annotations

import argparse
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

from common import (
    Run,
    build,
    cyclescope_cmd,
    cyclescope_samples,
    fmt_spread,
    machine,
    median,
    need,
    perf_samples,
    run,
    save,
    workload_cpu,
)

PATHS = {"bpf": ["--collector", "bpf"], "bpf-fp": ["--collector", "bpf", "-g", "fp"],
         "bpf-dwarf": ["--collector", "bpf", "-g", "dwarf"],
         "ring": ["--collector", "perf"], "ring-fp": ["--collector", "perf", "-g", "fp"]}
PERF_STACKS = {"perf": [], "perf-fp": ["-g"], "perf-dwarf": ["--call-graph", "dwarf"]}


def contender_cmd(name: str, rate: int, exe: Path, secs: float, tmp: Path, system_wide: bool = False,
                  copies: int = 1) -> list[str]:
    wl = [str(exe), str(secs)]
    if copies > 1:  # the workloads in parallel; each prints its own rusage
        wl = ["sh", "-c", " & ".join([f"{exe} {secs}"] * copies) + "; wait"]
    a = ["-a"] if system_wide else []
    if name == "none":
        return wl
    if name in PERF_STACKS:
        return ["perf", "record", *a, "-e", "cpu-clock", "-F", str(rate), *PERF_STACKS[name],
                "-o", str(tmp / "perf.data"), "--", *wl]
    if name == "plain":  # cyclescope without calc's evidence: flat samples only
        return cyclescope_cmd("record", "--db", str(tmp / "plain.db"), *a, "-F", str(rate), "--no-loop-counts",
                              "--", *wl)
    if name == "noanchors":  # the default less anchors (loop counts on, every sample from the rings)
        return cyclescope_cmd("record", "--db", str(tmp / "noanchors.db"), *a, "-F", str(rate), "--no-anchors", "--",
                              *wl)
    if name == "nostack":  # the default less the stack words its samples carry (registers alone)
        return cyclescope_cmd("record", "--db", str(tmp / "nostack.db"), *a, "-F", str(rate), "--loop-stack", "0",
                              "--", *wl)
    if name == "notrips":  # the default less trip windows (loop counts and anchors on)
        return cyclescope_cmd("record", "--db", str(tmp / "notrips.db"), *a, "-F", str(rate), "--no-trip-windows",
                              "--", *wl)
    if name == "flat":  # neither loop counts nor anchors: samples counted in the kernel by eBPF
        return cyclescope_cmd("record", "--db", str(tmp / "flat.db"), *a, "-F", str(rate), "--no-loop-counts",
                              "--no-anchors", "--", *wl)
    if name == "loops":  # loop counts on: what -a and the daemon did by default before the eBPF path
        return cyclescope_cmd("record", "--db", str(tmp / "loops.db"), *a, "-F", str(rate), "--loop-counts", "--", *wl)
    if name in PATHS:
        return cyclescope_cmd("record", "--db", str(tmp / f"{name}.db"), *a, "-F", str(rate), "--no-loop-counts",
                              *PATHS[name], "--", *wl)
    return cyclescope_cmd("record", "--db", str(tmp / "cs.db"), *a, "-F", str(rate), "--", *wl)


def lost_of(name: str, stderr: str) -> int:
    """Samples lost (cyclescope's summary line), or chunks lost (perf's warning: it counts no samples)."""
    m = re.search(r"lost (\d+) chunks" if name.startswith("perf") else r"; lost ([\d,]+);", stderr)
    return int(m.group(1).replace(",", "")) if m else 0


def measure(name: str, rate: int, exe: Path, secs: float, tmp: Path, system_wide: bool = False,
            copies: int = 1) -> dict[str, Any]:
    r: Run = run(contender_cmd(name, rate, exe, secs, tmp, system_wide, copies))
    if r.returncode != 0:
        raise RuntimeError(f"{name} failed: {r.stderr[-500:]}")
    tcpu = tuser = 0.0
    for line in r.stdout.splitlines():
        if "cpu_ns" in line:
            c, u = workload_cpu(line)
            tcpu, tuser = tcpu + c, tuser + u
    if name.startswith("perf"):
        samples = perf_samples(r.stderr)
    else:
        samples = cyclescope_samples(r.stderr) if name != "none" else 0
    return {"lost": lost_of(name, r.stderr),
        "contender": name, "rate": rate, "seconds": secs, "target_cpu": tcpu, "target_user": tuser,
        "own_cpu": max(0.0, r.cpu_s - tcpu), "own_user": max(0.0, r.user_s - tuser), "wall": r.wall_s,
        "samples": samples, "maxrss_kib": r.maxrss_kib,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rates", default="1000,5000,10000")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--marginal-rate", type=int, default=5000)
    ap.add_argument("--marginal-lengths", default="4,16")
    ap.add_argument("--marginal-rates", default=None,
                    help="two rates (e.g. 1000,10000): the marginal cost per sample is then the slope between "
                         "them at the first --marginal-lengths length, so that work paid per second (drains, "
                         "wake-ups) does not count as work per sample")
    ap.add_argument("--contenders", default="none,perf,cyclescope",
                    help="none, perf, cyclescope (default settings), plain (cyclescope --no-loop-counts), loops "
                         "(--loop-counts), and the collection paths: perf-fp, perf-dwarf, bpf, bpf-fp, bpf-dwarf, "
                         "ring, ring-fp")
    ap.add_argument("--system-wide", action="store_true", help="profilers sample every CPU (-a)")
    ap.add_argument("--save-as", default="overhead", help="name of the results file in bench/out/")
    ap.add_argument("--copies", type=int, default=1, help="workloads run in parallel (default: 1)")
    args = ap.parse_args()
    need("perf")
    rates = [int(x) for x in args.rates.split(",")]
    tmp = Path(tempfile.mkdtemp(prefix="cs-bench-"))
    exe = build("workload.c", tmp / "workload")
    contenders = args.contenders.split(",")
    if "none" not in contenders:
        contenders.insert(0, "none")
    # Warm-up: the first cyclescope run into a database stores kernel symbols; perf fills its caches.
    for c in contenders:
        measure(c, rates[0], exe, 0.5, tmp, args.system_wide, args.copies)
    rows: list[dict[str, Any]] = []
    for rnd in range(args.runs):
        for rate in rates:
            k = rnd % len(contenders)
            order = contenders[k:] + contenders[:k]
            for c in order:
                m = measure(c, rate, exe, args.seconds, tmp, args.system_wide, args.copies)
                m["round"] = rnd
                rows.append(m)
                print(f"round {rnd} {rate:>6} Hz {c:>10}: target {m['target_cpu']:.3f} s, own {m['own_cpu']:.3f} s"
                      f", {m['samples']} samples, {m['lost']} lost", flush=True)
    # Marginal cost per sample: two workload lengths (or two rates at one length), alternated.
    lengths = [float(x) for x in args.marginal_lengths.split(",")]
    points = ([(lengths[0], int(r)) for r in args.marginal_rates.split(",")] if args.marginal_rates
              else [(secs, args.marginal_rate) for secs in lengths])
    marg: list[dict[str, Any]] = []
    for rnd in range(args.runs if len(points) > 1 else 0):
        for secs, mrate in points:
            for c in [x for x in contenders if x != "none"]:
                m = measure(c, mrate, exe, secs, tmp, args.system_wide, args.copies)
                m["round"] = rnd
                marg.append(m)
                print(f"marginal round {rnd} {secs:>5} s {mrate:>6} Hz {c:>10}: own user {m['own_user']:.3f} s, "
                      f"{m['samples']} samples", flush=True)
    shutil.rmtree(tmp, ignore_errors=True)
    report = summarize(rows, marg, rates, points, contenders)
    path = save(args.save_as, {"machine": machine(), "args": vars(args), "rows": rows, "marginal": marg,
                             "summary": report})
    print("\n".join(report["lines"]))
    print(f"raw data: {path}")


def summarize(rows: list[dict[str, Any]], marg: list[dict[str, Any]], rates: list[int],
              points: list[tuple[float, int]], contenders: list[str]) -> dict[str, Any]:
    lines = ["", "Overhead (median [quartiles] over rounds; CPU seconds)", ""]
    out: dict[str, Any] = {"rates": {}}
    hdr = (f"{'rate':>6} {'contender':>10} {'target CPU':>24} {'profiler CPU':>24} {'extra CPU':>24} "
           f"{'samples':>8} {'lost':>7} {'own us/sample':>14}")
    lines.append(hdr)
    for rate in rates:
        base = {r["round"]: r["target_cpu"] for r in rows if r["rate"] == rate and r["contender"] == "none"}
        per: dict[str, dict[str, list[float]]] = {}
        for c in contenders:
            rs = [r for r in rows if r["rate"] == rate and r["contender"] == c]
            extra = [r["target_cpu"] + r["own_cpu"] - base[r["round"]] for r in rs]
            per[c] = {
                "target": [r["target_cpu"] for r in rs], "own": [r["own_cpu"] for r in rs], "extra": extra,
                "samples": [r["samples"] for r in rs], "lost": [r.get("lost", 0) for r in rs],
                "own_us_per_sample": [1e6 * r["own_user"] / r["samples"] for r in rs if r["samples"]],
                "target_slowdown": [r["target_cpu"] / base[r["round"]] - 1 for r in rs],
            }
            lines.append(f"{rate:>6} {c:>10} {fmt_spread(per[c]['target']):>24} {fmt_spread(per[c]['own']):>24} "
                         f"{fmt_spread(per[c]['extra']):>24} {median(per[c]['samples']):>8.0f} "
                         f"{median(per[c]['lost']):>7.0f} "
                         f"{median(per[c]['own_us_per_sample']) if per[c]['own_us_per_sample'] else 0:>14.1f}")
        for a, b in (("cyclescope", "perf"), ("cyclescope", "plain"), ("plain", "perf"), ("bpf", "perf"),
                     ("cyclescope", "loops"), ("loops", "perf"),
                     ("bpf", "ring"), ("bpf-fp", "perf-dwarf"), ("bpf-fp", "perf-fp"), ("bpf-fp", "bpf"),
                     ("bpf-dwarf", "perf-dwarf"), ("bpf-dwarf", "bpf"), ("bpf-dwarf", "bpf-fp"),
                     ("ring-fp", "perf-fp")):
            if a not in contenders or b not in contenders:
                continue
            ratio = []
            for rnd in sorted(base):
                pa = [r for r in rows if r["rate"] == rate and r["contender"] == a and r["round"] == rnd]
                pb = [r for r in rows if r["rate"] == rate and r["contender"] == b and r["round"] == rnd]
                if pa and pb:
                    ea = pa[0]["target_cpu"] + pa[0]["own_cpu"] - base[rnd]
                    eb = pb[0]["target_cpu"] + pb[0]["own_cpu"] - base[rnd]
                    if eb > 0:
                        ratio.append(ea / eb)
            per[f"ratio_extra_{a}_over_{b}"] = {"values": ratio}  # type: ignore[dict-item]
            lines.append(f"{'':>6} {'ratio':>10} extra CPU {a} / {b}: {fmt_spread(ratio, digits=2)}")
        lines.append("")
        out["rates"][rate] = per
    # Marginal per-sample user cost: slope between the first and last (length, rate), per round.
    def at(c: str, rnd: int, point: tuple[float, int]) -> list[dict[str, Any]]:
        return [m for m in marg if m["contender"] == c and m["round"] == rnd and (m["seconds"], m["rate"]) == point]

    for c in [x for x in contenders if x != "none"]:
        slopes = []
        for rnd in sorted({m["round"] for m in marg}):
            lo, hi = at(c, rnd, points[0]), at(c, rnd, points[-1])
            if lo and hi and hi[0]["samples"] > lo[0]["samples"]:
                slopes.append(1e6 * (hi[0]["own_user"] - lo[0]["own_user"]) / (hi[0]["samples"] - lo[0]["samples"]))
        fixed = [m["own_user"] - median(slopes) * m["samples"] / 1e6 for m in marg if m["contender"] == c]
        lines.append(f"{c:>10}: marginal own user-space cost {fmt_spread(slopes, ' us/sample', 2)}; "
                     f"fixed cost {fmt_spread(fixed, ' s', 2)}")
        out[f"marginal_{c}"] = {"us_per_sample": slopes, "fixed_s": fixed}
    out["lines"] = lines
    return out


if __name__ == "__main__":
    main()
