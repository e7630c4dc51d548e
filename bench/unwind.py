"""Cost and completeness of call stacks on code without frame pointers, alternated in one run.

Contenders, each profiling bench/workload.c built with -O2 -fomit-frame-pointer at the same rate:
- none (the workload alone: the base of the extra CPU);
- cyclescope record through perf's rings (--collector perf): flat, -g fp, -g dwarf (stack
  snapshots unwound in Python);
- cyclescope record counting in the kernel (--collector bpf): -g fp, -g dwarf (stacks walked by
  the eBPF program with unwind rows from .eh_frame: collect/bpfunwind.py);
- perf record -g dwarf, plus `perf script` over its file (perf unwinds at report time, so its
  unwinding cost is there: counted as its own CPU as well).
cyclescope's contenders run with --no-loop-counts (loop counts need each sample's registers: the
rings only). Measured per contender: the profiler's own CPU per sample (the tree's rusage minus
the target's), the extra CPU per sample (target and profiler, less the unprofiled target of the
round: the eBPF program's work is charged to the sampled task), lost samples, and the share of
samples whose stack reaches main (the workload's stacks are _start <- __libc_start_main <- ... <-
main <- kernel_a/kernel_b: a walk that gets there is whole). The order rotates between rounds;
figures are median [quartiles] over rounds.

Usage: python bench/unwind.py [--rounds 3] [--seconds 4] [--rate 5000]
"""

from __future__ import annotations

import argparse
import re
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from common import (
    build,
    cyclescope_cmd,
    cyclescope_samples,
    fmt_spread,
    machine,
    need,
    perf_samples,
    run,
    save,
    workload_cpu,
)

CONTENDERS = ["none", "cyclescope", "cyclescope-fp", "cyclescope-dwarf", "bpf-fp", "bpf-dwarf", "perf-dwarf"]
CYCLESCOPE = {"cyclescope": ["--collector", "perf"], "cyclescope-fp": ["--collector", "perf", "-g", "fp"],
              "cyclescope-dwarf": ["--collector", "perf", "-g", "dwarf"],
              "bpf-fp": ["--collector", "bpf", "-g", "fp"], "bpf-dwarf": ["--collector", "bpf", "-g", "dwarf"]}


def reaches_main_collapsed(text: str) -> tuple[int, int]:
    total = whole = 0
    for line in text.splitlines():
        stack, _, n = line.rpartition(" ")
        if not n.isdigit():
            continue
        total += int(n)
        if ";main;" in f";{stack};":
            whole += int(n)
    return whole, total


def reaches_main_perf(tmp: Path) -> tuple[int, int, float]:
    """(samples whose stack reaches main, samples, CPU seconds of perf script)."""
    r = run(["perf", "script", "-i", str(tmp / "perf.data"), "-F", "comm,ip,sym"])
    whole = total = 0
    cur: list[str] = []
    for line in [*r.stdout.splitlines(), ""]:
        if not line.strip():
            if cur:
                total += 1
                whole += any(re.search(r"\bmain\b", f) for f in cur[1:])
            cur = []
        else:
            cur.append(line)
    return whole, total, r.cpu_s


def measure(name: str, rate: int, exe: Path, secs: float, tmp: Path) -> dict[str, Any]:
    wl = [str(exe), str(secs)]
    db = tmp / f"{name}.db"
    if name == "none":
        cmd = wl
    elif name == "perf-dwarf":
        cmd = ["perf", "record", "-e", "cpu-clock", "-F", str(rate), "--call-graph", "dwarf", "-o",
               str(tmp / "perf.data"), "--", *wl]
    else:
        cmd = cyclescope_cmd("record", "--db", str(db), "-F", str(rate), "--no-loop-counts", *CYCLESCOPE[name],
                             "--", *wl)
    r = run(cmd)
    if r.returncode != 0:
        raise RuntimeError(f"{name} failed: {r.stderr[-500:]}")
    tcpu, _ = workload_cpu(r.stdout)
    own = max(0.0, r.cpu_s - tcpu)
    lost = 0
    if name == "none":
        return {"contender": name, "samples": 0, "own_cpu": 0.0, "us_per_sample": 0.0, "lost": 0, "whole": 0.0,
                "target_cpu": tcpu}
    if name == "perf-dwarf":
        samples = perf_samples(r.stderr)
        whole, total, script_cpu = reaches_main_perf(tmp)
        own += script_cpu
        m = re.search(r"lost (\d+) chunks", r.stderr)
        lost = int(m.group(1)) if m else 0
    else:
        samples = cyclescope_samples(r.stderr)
        m = re.search(r"lost ([\d,]+)", r.stderr)
        lost = int(m.group(1).replace(",", "")) if m else 0
        p = subprocess.run(cyclescope_cmd("export", "collapsed", "--db", str(db)), capture_output=True, text=True)
        whole, total = reaches_main_collapsed(p.stdout)
    return {"contender": name, "samples": samples, "own_cpu": own, "us_per_sample": 1e6 * own / max(samples, 1),
            "lost": lost, "whole": whole / max(total, 1), "target_cpu": tcpu}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=4.0)
    ap.add_argument("--rate", type=int, default=5000)
    args = ap.parse_args()
    need("perf")
    with tempfile.TemporaryDirectory(prefix="cs-bench-unwind-") as t:
        tmp = Path(t)
        exe = build("workload.c", tmp / "workload_nofp", "-O2", "-g", "-fomit-frame-pointer")
        # Warm the per-user caches (unwind tables and rows of libc and the workload), as any second
        # run finds them.
        measure("cyclescope-dwarf", args.rate, exe, 0.5, tmp)
        measure("bpf-dwarf", args.rate, exe, 0.5, tmp)
        rows: list[dict[str, Any]] = []
        for k in range(args.rounds):
            order = CONTENDERS[k % len(CONTENDERS):] + CONTENDERS[: k % len(CONTENDERS)]
            got = {}
            for name in order:
                got[name] = measure(name, args.rate, exe, args.seconds, tmp)
                print(f"round {k + 1}: {name:17s} {got[name]['us_per_sample']:7.1f} us/sample  "
                      f"whole {got[name]['whole']:.1%}  lost {got[name]['lost']}", flush=True)
            base = got["none"]["target_cpu"]
            for r in got.values():
                r["round"] = k
                extra = r["target_cpu"] + r["own_cpu"] - base
                r["extra_us_per_sample"] = 1e6 * extra / r["samples"] if r["samples"] else 0.0
            rows.extend(got.values())
    summary: dict[str, Any] = {}
    print(f"\n{'contender':18s} {'own CPU per sample (us)':>26s} {'extra CPU per sample (us)':>26s} "
          f"{'stacks reaching main':>22s} {'lost':>6s}")
    for name in CONTENDERS[1:]:
        rs = [r for r in rows if r["contender"] == name]
        us = [r["us_per_sample"] for r in rs]
        ex = [r["extra_us_per_sample"] for r in rs]
        wh = [r["whole"] for r in rs]
        lost = sum(r["lost"] for r in rs)
        summary[name] = {"us_per_sample": us, "extra_us_per_sample": ex, "whole": wh, "lost": lost}
        print(f"{name:18s} {fmt_spread(us, digits=1):>26s} {fmt_spread(ex, digits=1):>26s} "
              f"{fmt_spread([100 * w for w in wh], '%', 1):>22s} {lost:>6d}")
    save("unwind", {"machine": machine(), "args": vars(args), "rows": rows, "summary": summary})


if __name__ == "__main__":
    main()
