"""What a small piece of work costs the collector right after it slept, against back to back.

The daemon sleeps between its wake-ups (a period redraw every 0.2 s, a drain every second) and does
a few milliseconds of work at each. Timed in a warm loop, a drain's pieces cost a fraction of what
they cost in the daemon (a BPF map update 2 us against 0.35 ms; reading the counts maps 0.06-0.2
ms against 1-2 ms): the first work after a sleep runs on cold caches, TLBs and branch predictors,
and on these VMs that costs more the longer the sleep was. This measures it: per sleep length,
the thread's CPU (CLOCK_THREAD_CPUTIME_ID) of one piece of work done right after the sleep, and
of the same piece done again at once (warm), the pieces and sleep lengths alternated, median
[quartiles] over --repeats.

Pieces: ``getppid`` (a system call), ``python`` (a loop of 1,000 additions), ``pages`` (a byte read
from each of 16,384 pages of a 64 MiB buffer touched before: what a drain's buffers, maps and
tables cost, per page) and ``bpf-update`` (one update of the eBPF program's control map, what a
drain's generation flip costs; as root, where the program loads).

    python bench/wakeup.py [--sleeps 0.01,0.05,0.2,1,3] [--repeats 10] [--busy N] [--save-as NAME]

--busy N runs N copies of bench/workload.c beside it (the CPUs busy, as in bench/collectorcpu.py).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from common import build, fmt_spread, machine, save


def pieces() -> dict[str, Callable[[], object]]:
    out: dict[str, Callable[[], object]] = {"getppid": os.getppid}

    def python() -> int:
        x = 0
        for i in range(1000):
            x += i
        return x

    out["python"] = python
    import numpy as np

    buf = np.ones(64 << 20, np.uint8)  # faulted in here: what is measured is a page touched before
    every_page = np.arange(0, len(buf), 4096)
    out["pages"] = lambda: int(buf[every_page].sum())
    try:
        from cyclescope.collect import ebpf

        bpf = ebpf.load(1 << 16, 0)
        out["bpf-update"] = bpf.flip
    except Exception as e:  # not root, or no BPF here: the other pieces still say it
        print(f"bpf-update left out: {e}", file=sys.stderr)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sleeps", default="0.01,0.05,0.2,1,3", help="sleep lengths before the work, seconds")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--busy", type=int, default=0, help="busy loops beside it (bench/workload.c)")
    ap.add_argument("--save-as", default="wakeup")
    args = ap.parse_args()
    sleeps = [float(s) for s in args.sleeps.split(",")]
    work = pieces()
    loops: list[subprocess.Popen[bytes]] = []
    if args.busy:
        exe = build("workload.c", Path(tempfile.mkdtemp()) / "workload")
        total = args.repeats * sum(sleeps) * len(work) + 30
        loops = [subprocess.Popen([str(exe), str(total)], stdout=subprocess.DEVNULL) for _ in range(args.busy)]
        time.sleep(0.5)
    cpu: dict[tuple[str, float], list[float]] = {(w, s): [] for w in work for s in sleeps}
    warm: dict[str, list[float]] = {w: [] for w in work}
    try:
        for r in range(args.repeats):
            order = [(w, s) for s in sleeps for w in work]
            order = order[r % len(order):] + order[: r % len(order)]  # rotated each round
            for w, s in order:
                f = work[w]
                time.sleep(s)
                c0 = time.thread_time_ns()
                f()
                c1 = time.thread_time_ns()
                f()
                cpu[(w, s)].append((c1 - c0) / 1000)
                warm[w].append((time.thread_time_ns() - c1) / 1000)
    finally:
        for p in loops:
            p.kill()
            p.wait()
    print(f"The thread's CPU for one piece of work right after sleeping (us), median [quartiles] of "
          f"{args.repeats}{f', {args.busy} busy loops beside it' if args.busy else ''}:\n")
    print("| sleep before | " + " | ".join(work) + " |")
    print("|---|" + "---|" * len(work))
    print("| again at once (warm) | " + " | ".join(fmt_spread(warm[w], digits=1) for w in work) + " |")
    for s in sleeps:
        print(f"| {s:g} s | " + " | ".join(fmt_spread(cpu[(w, s)], digits=1) for w in work) + " |")
    path = save(args.save_as, {"machine": machine(), "busy": args.busy, "repeats": args.repeats,
                               "cpu_us": {f"{w}@{s:g}": v for (w, s), v in cpu.items()},
                               "warm_us": warm})
    print(f"\nsaved {path}")


if __name__ == "__main__":
    main()
