"""What closing uprobes costs: N perf uprobe counters against one BPF uprobe_multi link over the same
N instructions (issue 30: counting a loop's header beside its procedure's entry in one window).

    python bench/uprobemulti.py                  # 8 functions, 4 rounds, alternated
    python bench/uprobemulti.py --probes 2 --rounds 6

A program calls N small functions in a loop and prints its calls every 10 ms. Each round, alternated:
the N entries are counted by N perf uprobe counters (collect/kernel.open_uprobe_counter, as the
anchors do) or by one BPF program attached to all N at once (BPF_TRACE_UPROBE_MULTI, kernel 6.6 and
later), for 0.3 s; then the counters are closed. Measured: how long the open and the close take, and
the program's call rate while they close against its rate before, so that the traps paid while
probes wait to close are seen.

The BPF side is collect/pointcount.py's program (the trip windows' counter: raw bpf(2) calls,
since the libbpf this project loads, Debian 12's 1.1, has no uprobe_multi attach function).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from common import machine, median, save

PROGRAM = """
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#define F(n) __attribute__((noinline)) int f##n(int x) { __asm__ volatile(""); return x + n; }
F(0) F(1) F(2) F(3) F(4) F(5) F(6) F(7) F(8) F(9) F(10) F(11) F(12) F(13) F(14) F(15)
typedef int (*fn)(int);
static fn fs[16] = {f0, f1, f2, f3, f4, f5, f6, f7, f8, f9, f10, f11, f12, f13, f14, f15};
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }
int main(int argc, char **argv) {
    double dur = atof(argv[1]); int n = atoi(argv[2]); volatile long s = 0; long calls = 0;
    double t0 = now(), last = t0;
    for (;;) {
        for (int i = 0; i < 100; i++) for (int k = 0; k < n; k++) s += fs[k](i);
        calls += 100 * n;
        double t = now();
        if (t - last >= 0.01) { printf("%.6f %ld\\n", t, calls); fflush(stdout); calls = 0; last = t; }
        if (t - t0 > dur) break;
    }
    return 0;
}
"""


class MultiCounter:
    """collect/pointcount.py's program on one link over all the offsets, its counts summed."""

    def __init__(self, n: int) -> None:
        from cyclescope.collect.pointcount import PointCounter

        self.pc, self.n = PointCounter(), n
        self.pc.zero(n)

    def attach(self, path: str, offsets: list[int], pid: int) -> int:
        return int(self.pc.attach(path, offsets, pid))

    def hits(self) -> int:
        return int(self.pc.counts(self.n).sum())


def rate(lines: list[tuple[float, int]], a: float, b: float) -> float:
    """Calls a second over [a, b) from the program's lines (each: its time, calls since the last)."""
    calls, span, prev = 0, 0.0, None
    for t, c in lines:
        if prev is not None and a <= prev and t <= b:
            calls += c
            span += t - prev
        prev = t
    return calls / span if span > 0 else float("nan")


def one(exe: Path, offsets: list[int], how: str, multi: MultiCounter) -> dict[str, Any]:
    from cyclescope.collect import kernel

    child = subprocess.Popen([str(exe), "1.6", str(len(offsets))], stdout=subprocess.PIPE, text=True)
    lines: list[tuple[float, int]] = []

    def read() -> None:
        assert child.stdout is not None
        for line in child.stdout:
            t, c = line.split()
            lines.append((float(t), int(c)))

    th = threading.Thread(target=read)
    th.start()
    time.sleep(0.4)
    before = multi.hits()
    t_open = time.monotonic()
    if how == "multi":
        fds = [multi.attach(str(exe), offsets, child.pid)]
    else:
        pmu = kernel.uprobe_pmu_type()
        if pmu is None:
            raise SystemExit("no uprobe PMU here")
        fds = [kernel.open_uprobe_counter(pmu, str(exe), o, child.pid, -1) for o in offsets]
        for fd in fds:
            kernel.ioctl_enable(fd)
    t_opened = time.monotonic()
    time.sleep(0.3)
    hits = multi.hits() - before if how == "multi" else sum(kernel.read_counter(fd)[0] for fd in fds)
    t_close = time.monotonic()
    for fd in fds:
        os.close(fd)
    t_closed = time.monotonic()
    th.join()
    child.wait()
    return {"open_ms": 1e3 * (t_opened - t_open), "close_ms": 1e3 * (t_closed - t_close), "hits": hits,
            "rate_before": rate(lines, t_open - 0.3, t_open), "rate_counting": rate(lines, t_opened, t_close),
            "rate_closing": rate(lines, t_close, t_closed), "rate_after": rate(lines, t_closed + 0.02, t_closed + 0.3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--probes", type=int, default=8, help="functions probed (1-16)")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--save-as", default="uprobemulti")
    a = ap.parse_args()
    if not 1 <= a.probes <= 16:
        raise SystemExit("--probes: 1 to 16")
    tmp = Path(tempfile.mkdtemp(prefix="cs-uprobemulti-"))
    (tmp / "calls.c").write_text(PROGRAM)
    exe = tmp / "calls"
    subprocess.run(["gcc", "-O2", "-o", str(exe), str(tmp / "calls.c")], check=True)
    from cyclescope.images.elf import read_load_info, read_symbols

    syms = read_symbols(str(exe))
    info = read_load_info(str(exe))
    by_name = {n: int(s) for s, n in zip(syms.starts.tolist(), syms.names, strict=True)}
    offsets = [info.file_offset(by_name[f"f{i}"]) for i in range(a.probes)]
    if any(o is None for o in offsets):
        raise SystemExit("a probed function has no file offset")
    multi = MultiCounter(a.probes)
    out: dict[str, list[dict[str, Any]]] = {"perf": [], "multi": []}
    for r in range(a.rounds):
        for how in (("perf", "multi") if r % 2 == 0 else ("multi", "perf")):
            res = one(exe, [int(o) for o in offsets if o is not None], how, multi)
            out[how].append(res)
            print(f"round {r} {how:5s}: open {res['open_ms']:6.1f} ms, close {res['close_ms']:6.1f} ms, "
                  f"{res['hits']:,} hits in 0.3 s; calls/s before {res['rate_before']:,.0f}, counting "
                  f"{res['rate_counting']:,.0f}, closing {res['rate_closing']:,.0f}, after {res['rate_after']:,.0f}",
                  flush=True)
    for how in ("perf", "multi"):
        rs = out[how]
        closing = median([x["rate_closing"] / x["rate_before"] for x in rs])
        per_hit = median([0.3 / x["hits"] * 1e6 for x in rs if x["hits"]])
        print(f"{how}: {a.probes} probes, close {median([x['close_ms'] for x in rs]):.1f} ms (median), open "
              f"{median([x['open_ms'] for x in rs]):.1f} ms; while closing the program ran at {100 * closing:.0f}% "
              f"of its speed before; counting, {per_hit:.1f} us of the program's time a hit")
    print(f"saved {save(a.save_as, {'machine': machine(), 'probes': a.probes, 'rounds': out})}")


if __name__ == "__main__":
    main()
