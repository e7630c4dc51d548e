"""The daemon's own CPU per sample in steady state, flat and with stacks (issue 28's target).

`bench/overhead.py` takes a whole process's CPU, start-up, imports and the last flush included, and
its per-sample slopes between runs come out wider than the target (0.2 us a sample) because one
run's total moves by about 0.02 s from the next. Here the daemon runs beside `--copies` busy loops
(bench/workload.c, one per CPU) for --seconds, flushing every --flush-interval seconds, and its CPU
(every thread's sum_exec_runtime, /proc/PID/task/*/schedstat, in ns, and its children's: the
symbol archivers and compactions the flushes start are processes) is read at --warmup seconds
and again --window seconds later: drains, the period redraws, and the periodic flushes. Every run
starts from a copy of one database, warmed first by a daemon that archives the symbol tables of
the images it samples (a one-time cost per build-id), without its segments; a compaction's cost
is measured apart.

Per contender and rate: the CPU per second of the window and per sample (samples in the window
taken as the daemon's total times window / its run time: the loops keep both CPUs busy, so samples
come at an even pace), an upper bound of the per-sample cost since it includes the work paid per
second; and, paired by round, the marginal cost between the two rates, (CPU_hi - CPU_lo) /
(samples_hi - samples_lo), where work paid per second cancels out. Rates and contenders alternate
within each round.

--python makes one of the loops a CPython program 30 calls deep: with -g the daemon reads and
names its Python frames (collect/pyframes.py).

With --base REV each contender also runs as the tree committed at REV (MODE@REV), alternated.

Usage: python bench/collectorcpu.py [--rates 1000,16000] [--rounds 3]
       [--contenders flat,fp,dwarf,loops,loops-fp,loops-dwarf]
       [--python] [--base REV]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from common import build, contender_trees, cyclescope_cmd, fmt_spread, machine, median, run, save

# flat, fp, dwarf: without loop counts (the eBPF path's counts alone); loops, loops-fp, loops-dwarf: the
# daemon's default, loop counts on (the program sends the samples of procedures whose loops have a
# counter register, with their registers: collect/loopwatch.py; bench/workload.c's two loops have one,
# so nearly every sample of the busy loops is sent, the worst case).
CONTENDERS = {"flat": ["--no-loop-counts"], "fp": ["--no-loop-counts", "-g", "fp"],
              "dwarf": ["--no-loop-counts", "-g", "dwarf"], "loops": [], "loops-fp": ["-g", "fp"],
              "loops-dwarf": ["-g", "dwarf"]}
# --python: one of the busy loops is CPython's, 30 calls deep, whose frames the daemon names with -g.
PY_LOOP = """
import sys, time
def f(n, d):
    if d:
        return f(n, d - 1) + 1
    t = 0
    for i in range(n):
        t += i * i % 7
    return t
end = time.monotonic() + float(sys.argv[1])
while time.monotonic() < end:
    f(2000, 30)
"""


def start_loops(exe: Path, secs: float, args: argparse.Namespace) -> list[subprocess.Popen[bytes]]:
    cmds = [[str(exe), str(secs)] for _ in range(args.copies)]
    if args.python:
        cmds[0] = [sys.executable, "-c", PY_LOOP, str(secs)]
    return [subprocess.Popen(c, stdout=subprocess.DEVNULL) for c in cmds]


def _tasks_ns(pid: int) -> int:
    total = 0
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return 0  # gone
    for t in tasks:
        with contextlib.suppress(OSError, ValueError, IndexError):  # a thread that ended meanwhile
            total += int((t / "schedstat").read_text().split()[0])
    return total


def _children(pid: int) -> list[int]:
    """The daemon's child processes, from /proc/PID/task/TID/children: no scan of /proc (this
    script is a Python process, and the daemon names the frames of the Python processes it
    samples with -g: a poller that scans /proc four times a second cost it more than itself)."""
    out: list[int] = []
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return out
    for t in tasks:
        with contextlib.suppress(OSError, ValueError):
            out += [int(c) for c in (t / "children").read_text().split()]
    return out


def tree_cpu_ns(pid: int) -> int:
    """CPU the daemon has used so far, its children's included (the flusher's symbol archivers and
    compactions are processes): its threads', its waited-for children's (/proc/PID/stat cutime and
    cstime, in clock ticks) and its live children's."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    f = stat[stat.rindex(")") + 2 :].split()
    total = _tasks_ns(pid) + (int(f[13]) + int(f[14])) * 1_000_000_000 // os.sysconf("SC_CLK_TCK")
    return total + sum(_tasks_ns(c) for c in _children(pid))


def child_kinds(pid: int, seen: dict[int, str]) -> None:
    """Note the daemon's live children by what they do (symbol archiving, compaction)."""
    for c in _children(pid):
        if c not in seen:
            try:
                cmd = Path(f"/proc/{c}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            seen[c] = "symbols" if "cyclescope.db.symbols" in cmd else "compact" if "compact" in cmd else "other"


def daemon_cmd(db: Path, secs: float, rate: int, flush_s: float, extra: list[str]) -> list[str]:
    # A run's few segments are not compacted (the default waits for 8); compaction is measured apart.
    return cyclescope_cmd("daemon", "--db", str(db), "-d", str(secs), "-F", str(rate), "--flush-interval",
                          str(flush_s), "--collector", "bpf", *extra)


def fresh_db(warm: Path, dest: Path) -> Path:
    """A database with the warm one's archived symbols and binaries, and no segment: every run
    starts from the same state (one database for all runs grew to a hundred segments, which each
    flush then listed)."""
    shutil.copytree(warm, dest, ignore=shutil.ignore_patterns("epoch=*", "control"))
    return dest


def one(name: str, rate: int, exe: Path, args: argparse.Namespace, db: Path, src: Path) -> dict[str, Any]:
    """One daemon run of contender ``name`` (a mode, or MODE@REV: that tree's) with ``src`` on its
    PYTHONPATH."""
    secs = args.seconds
    loops = start_loops(exe, secs + 3, args)
    cmd = daemon_cmd(db, secs, rate, args.flush_interval, CONTENDERS[name.split("@")[0]])
    d = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                         env=dict(os.environ, PYTHONPATH=str(src)))
    time.sleep(args.warmup)
    a = tree_cpu_ns(d.pid)
    kids: dict[int, str] = {}
    end = time.monotonic() + args.window
    while (left := end - time.monotonic()) > 0:
        child_kinds(d.pid, kids)
        time.sleep(min(1.0, left))
    b = tree_cpu_ns(d.pid)
    _, err = d.communicate(timeout=secs + 120)
    for p in loops:
        p.kill()
        p.wait()
    if d.returncode != 0:
        raise RuntimeError(f"{name} at {rate} Hz failed: {err[-500:]}")
    m = re.search(r"stopped after ([\d.]+) s: ([\d,]+) samples, lost ([\d,]+)", err)
    if not m:
        raise RuntimeError(f"no summary from the daemon: {err[-500:]}")
    run_s, samples, lost = float(m.group(1)), int(m.group(2).replace(",", "")), int(m.group(3).replace(",", ""))
    in_window = samples * args.window / run_s
    cpu = (b - a) / 1e9
    return {"contender": name, "rate": rate, "cpu_s": cpu, "samples": samples, "run_s": run_s, "lost": lost,
            "children": sorted(kids.values()), "window_samples": in_window,
            "us_per_sample": cpu / in_window * 1e6 if in_window else None,
            "cpu_per_s_ms": cpu / args.window * 1e3}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rates", default="1000,16000", help="two sampling rates per CPU (at most 20,000 here)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--contenders", default="flat,fp,dwarf")
    ap.add_argument("--seconds", type=float, default=45.0, help="each daemon's run")
    ap.add_argument("--warmup", type=float, default=12.0)
    ap.add_argument("--window", type=float, default=30.0)
    ap.add_argument("--flush-interval", type=float, default=10.0)
    ap.add_argument("--copies", type=int, default=2, help="busy loops beside the daemon (default: one per CPU)")
    ap.add_argument("--python", action="store_true",
                    help="one busy loop is a CPython program 30 calls deep (its frames named with -g)")
    ap.add_argument("--base", metavar="REV",
                    help="also run each contender as the tree committed at REV (MODE@REV), alternated")
    ap.add_argument("--save-as", default="collectorcpu")
    args = ap.parse_args()
    rates = [int(r) for r in args.rates.split(",")]
    names = args.contenders.split(",")
    if len(rates) != 2 or max(rates) > 20000 or any(n not in CONTENDERS for n in names):
        ap.error(f"--rates takes two rates of at most 20,000; --contenders: {', '.join(CONTENDERS)}")
    if args.warmup + args.window > args.seconds - 1:
        ap.error("--warmup + --window must end a second before --seconds")
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="cs-bench-collectorcpu-") as td:
        tmp = Path(td)
        # Each contender per tree: MODE for the head, MODE@REV for --base's.
        trees = contender_trees(args.base, tmp)
        srcs = {n if rev == "head" else f"{n}@{rev}": src for n in names for rev, src in trees.items()}
        names = list(srcs)
        exe = build("workload.c", tmp / "workload")
        db = tmp / "db"
        # One database for every run, its symbol tables archived first: a fresh database archives
        # those of every image the machine runs, and then those of the archivers' own libraries
        # (pyarrow's, numpy's), a one-time cost per build-id that is not the steady state.
        print("warming the database (symbol tables archived)...", flush=True)
        loops = start_loops(exe, 43, args)
        subprocess.run(daemon_cmd(db, 40, max(rates), 5, ["-g", "dwarf"]), check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for p in loops:
            p.kill()
            p.wait()
        for rnd in range(args.rounds):
            order = [(n, r) for n in names for r in rates]
            k = rnd % len(order)
            for n, r in order[k:] + order[:k]:  # rotated each round
                row = one(n, r, exe, args, fresh_db(db, tmp / f"run-{len(rows)}"), srcs[n])
                row["round"] = rnd
                rows.append(row)
                print(f"round {rnd} {n:5s} {r:6d} Hz: {row['cpu_per_s_ms']:.2f} ms/s, "
                      f"{row['us_per_sample']:.3f} us/sample, lost {row['lost']}", flush=True)
        # What a compaction costs, apart: the defaults merge 8 segments of 60 s every 8 minutes;
        # here the last run's segments (one a --flush-interval) are merged.
        last = tmp / f"run-{len(rows) - 1}"
        segs = len(list(last.glob("epoch=*/host=*/seg-*.parquet")))
        comp = run(cyclescope_cmd("db", "compact", "--db", str(last)))
    lo, hi = rates
    out: dict[str, Any] = {"machine": machine(), "args": vars(args), "rows": rows, "summary": {},
                           "compaction": {"cpu_s": comp.cpu_s, "segments_before": segs, "returncode": comp.returncode}}
    print(f"\nThe daemon's own CPU in steady state ({args.window:.0f} s windows after {args.warmup:.0f} s, "
          f"flushing every {args.flush_interval:.0f} s, {args.copies} busy loops), median [quartiles] of "
          f"{args.rounds} rounds:\n")
    print(f"| contender | CPU at {lo} Hz | per sample | CPU at {hi} Hz | per sample | marginal per sample | lost |")
    print("|---|---|---|---|---|---|---|")
    for n in names:
        at = {r: [x for x in rows if x["contender"] == n and x["rate"] == r] for r in rates}
        marg = []
        for rnd in range(args.rounds):
            a = [x for x in at[lo] if x["round"] == rnd]
            b = [x for x in at[hi] if x["round"] == rnd]
            if a and b and b[0]["window_samples"] > a[0]["window_samples"]:
                marg.append((b[0]["cpu_s"] - a[0]["cpu_s"]) / (b[0]["window_samples"] - a[0]["window_samples"]) * 1e6)
        s = {"cpu_per_s_ms": {r: median([x["cpu_per_s_ms"] for x in at[r]]) for r in rates},
             "us_per_sample": {r: median([x["us_per_sample"] for x in at[r]]) for r in rates},
             "marginal_us": marg, "lost": sum(x["lost"] for r in rates for x in at[r])}
        out["summary"][n] = s
        print(f"| {n} | {fmt_spread([x['cpu_per_s_ms'] for x in at[lo]], ' ms/s', 2)} | "
              f"{fmt_spread([x['us_per_sample'] for x in at[lo]], ' us', 3)} | "
              f"{fmt_spread([x['cpu_per_s_ms'] for x in at[hi]], ' ms/s', 2)} | "
              f"{fmt_spread([x['us_per_sample'] for x in at[hi]], ' us', 3)} | "
              f"{fmt_spread(marg, ' us', 3) if marg else '-'} | {s['lost']} |")
    kids = [(x["contender"], x["rate"], x["round"], x["children"]) for x in rows if x["children"]]
    print(f"\nRuns with children in their window (symbol archivers of images first sampled then): "
          f"{len(kids)} of {len(rows)}" + "".join(f"\n  {n} {r} Hz round {k}: {', '.join(c)}" for n, r, k, c in kids))
    print(f"A compaction of the {segs} segments the runs left: {comp.cpu_s:.2f} s of CPU (exit {comp.returncode}); "
          f"the defaults compact 8 segments every 8 minutes")
    print(f"\nsaved {save(args.save_as, out)}")


if __name__ == "__main__":
    main()
