"""Why an entry count from a moving argument runs high when few trip windows measured its stride.

calc can count a procedure's entries from an argument that moves forward through the run
(analysis/progress.py): the sampled registers give how far it moved over the run, trip windows of
the entry alone give how far it moves per entry (the stride), and entries = move / stride. On the
suite's runs of a second or two a recording affords three to five such windows. This measures,
on one procedure and argument of a suite program:

1. the stride over the run, exactly: every entry's argument from a `perf probe` uprobe that
   records it (the run is slowed by the probe, but the sequence of calls and moves is the
   program's own), and the stride in each tenth of the run;
2. what windows of --window-ms opened at random times make of it: the argument's position over
   the run's undisturbed time from a plain `perf record` of the same input (the register that
   holds the argument inside the procedure, --reg, at the samples between --range's offsets),
   windows drawn over it and counted against the exact sequence, --sets simulated sets of
   K windows each. Two estimators of the entries over the sampled span:
   - ratio: the move over the span over the windows' stride, sum(moves) / sum(entries - 1),
     what calc does (progress.entries_from_progress);
   - local rate (not built): the mean over the windows of the move rate sampled around each
     (--around-ms on each side, from the plain recording) over the window's stride, times the
     span's time: entries per second, which varies less over the run than the stride.

    python bench/stridetime.py [--program xz --procedure hc_find_func --arg si --reg bx
                                --range 0xf:0x118] [--save-as stridetime_xz_zen3]

The defaults are xz's match finder: its second argument (pos, esi at entry) is copied to ebx by
its twelfth byte and held there until its epilogue pops rbx.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import numpy as np
from common import machine, need, perf_probes, save
from suite import programs


def traced(exe: Path, args: list[str], procedure: str, arg: str, tmp: Path) -> np.ndarray:
    """Every entry's argument, in order (a uprobe fetching it as a 32-bit value)."""
    with perf_probes(exe, {"stride_entry": f"{procedure} v=%{arg}:u32"}) as evs:
        data = tmp / "trace.data"
        subprocess.run(["perf", "record", "-q", "-e", evs["stride_entry"], "-o", str(data), "--", str(exe), *args],
                       check=True, stdout=subprocess.DEVNULL)
        out = subprocess.run(["perf", "script", "-i", str(data), "-F", "trace"], check=True, capture_output=True,
                             text=True).stdout
    return np.array([int(m.group(1)) for m in re.finditer(r"\bv=(\d+)", out)], np.float64)


def sampled(exe: Path, args: list[str], procedure: str, reg: str, lo: int, hi: int, rate: int,
            tmp: Path) -> tuple[np.ndarray, np.ndarray]:
    """The samples' times and the argument's value at those in the procedure's [lo, hi) bytes."""
    data = tmp / "samples.data"
    subprocess.run(["perf", "record", "-q", "-e", "cpu-clock", "-F", str(rate), f"--user-regs={reg}", "-o", str(data),
                    "--", str(exe), *args], check=True, stdout=subprocess.DEVNULL)
    out = subprocess.run(["perf", "script", "-i", str(data), "-F", "time,ip,sym,symoff,uregs"], check=True,
                         capture_output=True, text=True).stdout
    pat = re.compile(r"^\s*([\d.]+):\s+[0-9a-f]+\s+" + re.escape(procedure) + r"\+0x([0-9a-f]+).*\b" + reg.upper()
                     + r":0x([0-9a-f]+)", re.M)
    t, v = [], []
    for m in pat.finditer(out):
        off, val = int(m.group(2), 16), int(m.group(3), 16)
        if lo <= off < hi and val < 1 << 32:
            t.append(float(m.group(1)))
            v.append(float(val))
    ts, vs = np.array(t), np.array(v)
    keep = np.r_[True, np.diff(vs) >= 0]  # the argument only moves forward in this procedure's run
    return ts[keep], np.maximum.accumulate(vs[keep])


def simulate(seq: np.ndarray, ts: np.ndarray, ps: np.ndarray, ks: list[int], window_s: float, around_s: float,
             sets: int, seed: int) -> list[dict[str, Any]]:
    """Both estimators over ``sets`` sets of k random windows, against the span's exact entries."""
    rng = np.random.default_rng(seed)
    exact = int(np.searchsorted(seq, ps[-1], "right") - np.searchsorted(seq, ps[0], "left"))
    move, span = ps[-1] - ps[0], ts[-1] - ts[0]

    def window(tau: float) -> tuple[int, float] | None:
        i0 = int(np.searchsorted(seq, np.interp(tau, ts, ps), "left"))
        i1 = int(np.searchsorted(seq, np.interp(tau + window_s, ts, ps), "right"))
        return (i1 - i0 - 1, float(seq[i1 - 1] - seq[i0])) if i1 - i0 >= 2 else None

    out = []
    for k in ks:
        ratio, local = [], []
        for _ in range(sets):
            got = [(tau, w) for tau in rng.uniform(ts[0] + around_s, ts[-1] - window_s - around_s, k)
                   if (w := window(float(tau))) is not None and w[1] > 0]
            if not got:
                continue
            ratio.append(move / (sum(w[1] for _, w in got) / sum(w[0] for _, w in got)) / exact)
            rates = [(np.interp(tau + window_s + around_s, ts, ps) - np.interp(tau - around_s, ts, ps))
                     / (window_s + 2 * around_s) * w[0] / w[1] for tau, w in got]
            local.append(span * float(np.mean(rates)) / exact)
        row: dict[str, Any] = {"windows": k}
        for name, xs in (("ratio", ratio), ("local", local)):
            a = np.array(xs)
            row[name] = {"median": float(np.median(a)), "p10": float(np.quantile(a, 0.1)),
                         "p90": float(np.quantile(a, 0.9)), "mean": float(a.mean()),
                         "within15": float(np.mean(np.abs(a - 1) <= 0.15))}
        out.append(row)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--program", default="xz")
    ap.add_argument("--procedure", default="hc_find_func")
    ap.add_argument("--arg", default="si", help="the argument's register at entry (perf probe's name)")
    ap.add_argument("--reg", default="bx", help="the register that holds it inside the procedure")
    ap.add_argument("--range", default="0xc:0x113", help="the procedure's bytes where --reg holds it (LO:HI)")
    ap.add_argument("--rate", type=int, default=5000)
    ap.add_argument("--window-ms", type=float, default=1.3,
                    help="a window's undisturbed length (a 2 ms window of traps covers less of the run)")
    ap.add_argument("--around-ms", type=float, default=10.0)
    ap.add_argument("--windows", default="2,4,8,16,64")
    ap.add_argument("--sets", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--save-as", default="stridetime")
    a = ap.parse_args()
    need("perf")
    progs, inp = programs([a.program])
    p = progs[0]
    args = [x.replace("{input}", str(inp)) for x in p.args]
    lo, hi = (int(x, 0) for x in a.range.split(":"))
    with tempfile.TemporaryDirectory(prefix="cs-stride-") as d:
        tmp = Path(d)
        seq = traced(p.exe, args, a.procedure, a.arg, tmp)
        ts, ps = sampled(p.exe, args, a.procedure, a.reg, lo, hi, a.rate, tmp)
    n = len(seq)
    stride = (seq[-1] - seq[0]) / (n - 1)
    print(f"{p.name} {a.procedure}: {n:,} entries, the argument moved {seq[-1] - seq[0]:,.0f}: {stride:.3f} a call")
    tenths = []
    for q in range(10):
        part = seq[q * n // 10 : (q + 1) * n // 10]
        tenths.append(float((part[-1] - part[0]) / (len(part) - 1)))
    print("stride in each tenth of the calls: " + ", ".join(f"{s:.2f}" for s in tenths))
    print(f"plain recording: {len(ts):,} samples in the procedure's range over {ts[-1] - ts[0]:.2f} s")
    rows = simulate(seq, ts, ps, [int(k) for k in a.windows.split(",")], a.window_ms / 1000, a.around_ms / 1000,
                    a.sets, a.seed)
    print(f"{a.sets:,} simulated sets of K windows of {a.window_ms} ms: entries estimated / exact, "
          "median [10th, 90th percentile], share within 15%")
    for r in rows:
        print(f"  K={r['windows']:3d}  ratio (calc's) {r['ratio']['median']:.3f} [{r['ratio']['p10']:.3f}, "
              f"{r['ratio']['p90']:.3f}] {100 * r['ratio']['within15']:4.1f}%   local rate "
              f"{r['local']['median']:.3f} [{r['local']['p10']:.3f}, {r['local']['p90']:.3f}] "
              f"{100 * r['local']['within15']:4.1f}%")
    path = save(a.save_as, {"machine": machine(), "args": vars(a), "entries": n, "stride": stride,
                            "tenths": tenths, "sampled": len(ts), "simulated": rows})
    print(f"raw data: {path}")


if __name__ == "__main__":
    main()
