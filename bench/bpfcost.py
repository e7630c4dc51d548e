"""What the eBPF program costs per sample, in the kernel, from the kernel's own statistics.

With kernel.bpf_stats_enabled set, the kernel times every run of every BPF program and shows the
sum (run_time_ns) and the count (run_cnt) in the program's /proc/PID/fdinfo. This bench records a
workload with `record --collector bpf` and reads the recorder's programs' fdinfo every 50 ms while
it runs (the last reading before it exits): nanoseconds per run of the sampling program, that is
per sample, charged to the sampled task (the daemon's own CPU is bench/collectorcpu.py's). The
exit tracepoint's program is reported apart (runs: processes that exited while recording; cost:
per Python process, copying its code objects).

Contenders: the tree at the head, and where --base REV is given, the same tree as committed at REV
(`git archive REV src`, run with PYTHONPATH pointing there): its BPF objects and its user space.
Modes: flat (no stacks), fp (-g fp) and dwarf (-g dwarf); workloads: tests/programs/pyshares.py
under CPython 3.11 and 3.12 (Python frames read by the program) and bench/workload.c (native).
Each round runs every (workload, mode, contender) once, contenders alternated.

With --execs N: the exec waker's program instead (collect/bpf/exec.bpf.c, loaded by
collect/ebpf.ExecWaker as a system-wide recording does), its nanoseconds per exec over N execs of
/bin/true and N/10 of a CPython (which it wakes for), in this process, per round.

Usage: python bench/bpfcost.py [--rounds 3] [--modes flat,fp,dwarf] [--base REV]
       [--workloads py3.11,py3.12,native] [--execs N] [--save-as NAME]
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from common import ROOT, build, contender_trees, cpython, fmt_spread, machine, save

STATS = Path("/proc/sys/kernel/bpf_stats_enabled")
PERF_EVENT, TRACEPOINT = 7, 5  # enum bpf_prog_type, as fdinfo's prog_type gives it
PYSHARES = ROOT / "tests" / "programs" / "pyshares.py"


def workloads(names: list[str], tmp: Path) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for name in names:
        if name == "native":
            exe = build("workload.c", tmp / "workload")
            out[name] = [str(exe), "2"]
            continue
        v = name.removeprefix("py")
        exe = cpython(v)
        if exe is None:
            print(f"bpfcost: no CPython {v} here: {name} left out", file=sys.stderr)
            continue
        out[name] = [exe, str(PYSHARES), "400"]
    return out


def prog_stats(pid: int) -> dict[str, tuple[int, int]]:
    """Per BPF program open in ``pid`` (by its type and name): (run_time_ns, run_cnt)."""
    out: dict[str, tuple[int, int]] = {}
    try:
        fds = os.listdir(f"/proc/{pid}/fdinfo")
    except OSError:
        return out
    for fd in fds:
        try:
            text = Path(f"/proc/{pid}/fdinfo/{fd}").read_text()
        except OSError:
            continue
        if "run_time_ns" not in text or "prog_type" not in text:
            continue
        f = dict(re.findall(r"^(\w+):\s+(\S+)", text, re.M))
        key = f"{f.get('prog_type')}:{f.get('prog_tag')}"
        ns, cnt = int(f.get("run_time_ns", 0)), int(f.get("run_cnt", 0))
        old = out.get(key, (0, 0))
        out[key] = (max(old[0], ns), max(old[1], cnt))  # one program, several fds (links)
    return out


def one(src: Path, mode: str, cmd: list[str], tmp: Path) -> dict[str, Any]:
    db = tmp / "db"
    subprocess.run(["rm", "-rf", str(db)], check=True)
    how = {"flat": [], "fp": ["-g", "fp"], "dwarf": ["-g", "dwarf"]}[mode]
    env = dict(os.environ, PYTHONPATH=str(src))
    p = subprocess.Popen([sys.executable, "-m", "cyclescope", "record", "--db", str(db), "-q", "--collector", "bpf",
                          "--no-loop-counts", "-F", "2000", *how, "--", *cmd], env=env,
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    last: dict[str, tuple[int, int]] = {}
    while p.poll() is None:
        now = prog_stats(p.pid)
        if now:
            last = now
        time.sleep(0.05)
    err = p.stderr.read() if p.stderr else ""
    if p.returncode != 0:
        raise RuntimeError(f"record exited {p.returncode}: {err[-400:]}")
    sample = {k: v for k, v in last.items() if k.startswith(f"{PERF_EVENT}:")}
    exits = {k: v for k, v in last.items() if k.startswith(f"{TRACEPOINT}:")}
    ns, cnt = (sum(v[i] for v in sample.values()) for i in (0, 1))
    ens, ecnt = (sum(v[i] for v in exits.values()) for i in (0, 1))
    return {"runs": cnt, "ns_per_run": ns / cnt if cnt else float("nan"), "exit_runs": ecnt,
            "exit_ns_per_run": ens / ecnt if ecnt else float("nan")}


def exec_cost(n: int) -> dict[str, Any]:
    """The exec waker's program, per exec: N execs of /bin/true and N/10 of a CPython."""
    sys.path.insert(0, str(ROOT / "src"))
    from cyclescope.collect import kernel
    from cyclescope.collect.ebpf import ExecWaker

    python = cpython("3.12") or sys.executable
    outputs = {cpu: kernel.open_bpf_output_waker(cpu) for cpu in sorted(os.sched_getaffinity(0))}
    waker = ExecWaker(outputs)
    try:
        before = prog_stats(os.getpid())
        for i in range(n):
            subprocess.run(["/bin/true"], check=True)
            if i % 10 == 0:
                subprocess.run([python, "-S", "-c", "pass"], check=True)
        after = prog_stats(os.getpid())
    finally:
        waker.close()
        for fd in outputs.values():
            kernel.close_fd(fd)
    ns = sum(after[k][0] - before.get(k, (0, 0))[0] for k in after)
    runs = sum(after[k][1] - before.get(k, (0, 0))[1] for k in after)
    return {"ns_per_run": ns / runs if runs else float("nan"), "runs": runs}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--modes", default="flat,fp,dwarf")
    ap.add_argument("--workloads", default="py3.11,py3.12,native")
    ap.add_argument("--base", help="a git revision to compare with the head")
    ap.add_argument("--execs", type=int, default=0, metavar="N",
                    help="measure the exec waker's program over N execs a round instead")
    ap.add_argument("--save-as", default="bpfcost")
    args = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("bpfcost: needs root (BPF statistics and the eBPF collector)")
    before = STATS.read_text().strip()
    results: dict[str, Any] = {"machine": machine(), "args": vars(args), "runs": []}
    if args.execs:
        STATS.write_text("1\n")
        try:
            for r in range(args.rounds):
                res = exec_cost(args.execs)
                res.update(round=r)
                results["runs"].append(res)
                print(f"round {r} exec waker {res['ns_per_run']:6.0f} ns/exec ({res['runs']:,} execs)", flush=True)
        finally:
            STATS.write_text(before + "\n")
        xs = [x["ns_per_run"] for x in results["runs"]]
        print(f"\nns per exec in the kernel, median [quartiles] of the rounds: {fmt_spread(xs, digits=0)}")
        print(f"saved {save(args.save_as, results)}")
        return
    with tempfile.TemporaryDirectory(prefix="bpfcost-") as d:
        tmp = Path(d)
        trees = contender_trees(args.base, tmp)
        loads = workloads(args.workloads.split(","), tmp)
        STATS.write_text("1\n")
        try:
            for r in range(args.rounds):
                for name, cmd in loads.items():
                    for mode in args.modes.split(","):
                        order = list(trees.items()) if r % 2 == 0 else list(reversed(trees.items()))
                        for label, src in order:
                            res = one(src, mode, cmd, tmp)
                            res.update(round=r, workload=name, mode=mode, tree=label)
                            results["runs"].append(res)
                            print(f"round {r} {name:7} {mode:5} {label:10} {res['ns_per_run']:8.0f} ns/sample "
                                  f"({res['runs']:,} samples; exit program {res['exit_runs']} runs)", flush=True)
        finally:
            STATS.write_text(before + "\n")
    print("\nns per sample in the kernel, median [quartiles] of the rounds:")
    for name in loads:
        for mode in args.modes.split(","):
            row = []
            for label in trees:
                xs = [x["ns_per_run"] for x in results["runs"] if (x["workload"], x["mode"], x["tree"]) ==
                      (name, mode, label)]
                row.append(f"{label} {fmt_spread(xs, digits=0)}")
            if len(trees) == 2:
                pairs: dict[int, dict[str, float]] = {}
                for x in results["runs"]:
                    if (x["workload"], x["mode"]) == (name, mode):
                        pairs.setdefault(x["round"], {})[x["tree"]] = x["ns_per_run"]
                ratio = [v["head"] / v[args.base] for v in pairs.values() if len(v) == 2 and v[args.base]]
                row.append(f"head / {args.base} {fmt_spread(ratio, digits=3)}")
            print(f"  {name:7} {mode:5} " + "; ".join(row))
    print(f"saved {save(args.save_as, results)}")


if __name__ == "__main__":
    main()
