"""Daemon soak: system-wide at 5 kHz on every CPU, under process churn (DCPI's gcc case).

Runs `cyclescope daemon` for --minutes while one compile loop per CPU runs
gcc on C files over and over (every compile is several short-lived
processes: the driver, cc1, as). Reports the unknown share, lost samples,
the daemon's RSS over time and its peak, the same for its analysis worker
(the loop counter's child, analysis/worker.py), the anonymous memory of both
(Pss_Anon: what each holds of its own, without the shared libraries' pages),
their CPU time, and the number of processes seen.

Usage: python bench/soak.py [--minutes 10] [--rate 5000] [--daemon-args ARGS] [--keep DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

from common import ROOT, cyclescope_cmd, machine, save

from cyclescope.analysis.worker import own_mib  # Pss_Anon: what a process holds of its own

SOURCES = [
    ROOT / "tests" / "programs" / "hotcold.c", ROOT / "tests" / "programs" / "forker.c",
    ROOT / "tests" / "programs" / "jit.c", ROOT / "src" / "cyclescope" / "demo" / "workload.c",
    ROOT / "bench" / "workload.c", ROOT / "tests" / "data" / "inl.c",
]


def rss_kib(pid: int) -> tuple[int, int]:
    rss = hwm = 0
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1])
            elif line.startswith("VmHWM:"):
                hwm = int(line.split()[1])
    return rss, hwm


def cpu_s(pid: int) -> float:
    """The process's user and system CPU so far (its own threads, not its children)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def worker_pids(pid: int) -> list[int]:
    """The daemon's analysis workers (``python -m cyclescope.analysis.worker``) among its children."""
    out = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            kids = (task / "children").read_text().split()
        except OSError:
            continue
        for k in kids:
            try:
                cmd = Path(f"/proc/{k}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"cyclescope.analysis.worker" in cmd:
                out.append(int(k))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--rate", type=int, default=5000)
    ap.add_argument("--flush-interval", type=float, default=60.0)
    ap.add_argument("--daemon-args", default="", help="more options for the daemon, e.g. --no-loop-counts")
    ap.add_argument("--name", default="soak", help="bench/out/NAME.json (default: soak)")
    ap.add_argument("--keep", type=Path, help="keep the database in this directory (it must not exist)")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="cs-soak-"))
    db = tmp / "db"
    loop = "while :; do for f in " + " ".join(map(str, SOURCES)) + "; do gcc -O2 -c \"$f\" -o /dev/null; done; done"
    daemon = subprocess.Popen(cyclescope_cmd("daemon", "--db", str(db), "-F", str(args.rate), "--flush-interval",
                                             str(args.flush_interval), *shlex.split(args.daemon_args)),
                              stderr=subprocess.PIPE, text=True)
    time.sleep(3)
    loops = [subprocess.Popen(["sh", "-c", loop], start_new_session=True) for _ in range(os.cpu_count() or 1)]
    t0 = time.monotonic()
    series = []
    workers_cpu: dict[int, float] = {}  # each analysis worker's CPU when last seen
    try:
        while time.monotonic() - t0 < args.minutes * 60:
            time.sleep(10)
            rss, hwm = rss_kib(daemon.pid)
            anon = round(own_mib(daemon.pid) * 1024)
            d_cpu = cpu_s(daemon.pid)
            w_rss = w_hwm = w_anon = 0
            for w in worker_pids(daemon.pid):
                try:
                    r, h = rss_kib(w)
                    a = round(own_mib(w) * 1024)
                    workers_cpu[w] = cpu_s(w)
                except OSError:  # exited meanwhile
                    continue
                w_rss, w_hwm, w_anon = w_rss + r, w_hwm + h, w_anon + a
            st = subprocess.run(cyclescope_cmd("status", "--db", str(db), "--json"), capture_output=True, text=True)
            s = json.loads(st.stdout) if st.returncode == 0 else {}
            series.append({"t": round(time.monotonic() - t0), "rss_kib": rss, "hwm_kib": hwm, "anon_kib": anon,
                           "worker_rss_kib": w_rss, "worker_hwm_kib": w_hwm, "worker_anon_kib": w_anon,
                           "cpu_s": d_cpu, "worker_cpu_s": sum(workers_cpu.values()), **s})
            print(f"{series[-1]['t']:>4} s: RSS {rss / 1024:6.1f} MiB (peak {hwm / 1024:6.1f}, anon "
                  f"{anon / 1024:5.1f}), worker {w_rss / 1024:5.1f} MiB (anon {w_anon / 1024:5.1f}), "
                  f"CPU {d_cpu:6.1f} s + {sum(workers_cpu.values()):5.1f} s, samples "
                  f"{s.get('samples', 0):>9,}, unknown {s.get('unknown', 0):>6,}, lost "
                  f"{s.get('lost_records', 0) + s.get('lost_samples', 0):>5,}, processes tracked "
                  f"{s.get('processes', 0):>4}, images {s.get('images', 0)}", flush=True)
    finally:
        for p in loops:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
        daemon.send_signal(signal.SIGTERM)
        _, err = daemon.communicate(timeout=120)
    print(err.strip())
    prof = subprocess.run(cyclescope_cmd("prof", "--db", str(db), "--json", "--epoch", "all"), capture_output=True,
                          text=True, check=True)
    report = json.loads(prof.stdout)
    summ = report["summary"]
    images = subprocess.run(cyclescope_cmd("prof", "--db", str(db), "--images", "--epoch", "all", "--limit", "8"),
                            capture_output=True, text=True).stdout
    print(images)
    out = {
        "machine": machine(), "args": vars(args), "series": series, "daemon_stderr": err,
        "samples": summ["recorded_samples"], "unknown_share": summ["unknown_share"],
        "unknown_reasons": summ["unknown_reasons"], "lost_records": summ["lost_records"],
        "lost_samples": summ["lost_samples"], "peak_rss_kib": max(s["hwm_kib"] for s in series),
        "worker_peak_rss_kib": max(s["worker_hwm_kib"] for s in series),
        "anon_max_kib": max(s["anon_kib"] for s in series),
        "worker_anon_max_kib": max(s["worker_anon_kib"] for s in series),
        "cpu_s": series[-1]["cpu_s"], "worker_cpu_s": series[-1]["worker_cpu_s"],
        "window_s": series[-1]["t"],
        "db_bytes": sum(f.stat().st_size for f in db.rglob("*") if f.is_file()),
    }
    print(f"unknown {100 * out['unknown_share']:.3f}% {out['unknown_reasons']}, lost records "
          f"{out['lost_records']}, lost samples {out['lost_samples']}, peak RSS {out['peak_rss_kib'] / 1024:.1f} MiB "
          f"(anonymous at most {out['anon_max_kib'] / 1024:.1f}; its analysis worker's peak "
          f"{out['worker_peak_rss_kib'] / 1024:.1f} MiB, anonymous at most {out['worker_anon_max_kib'] / 1024:.1f}); "
          f"CPU {out['cpu_s']:.1f} s and the worker's {out['worker_cpu_s']:.1f} s in {out['window_s']} s, "
          f"database {out['db_bytes'] / 1e6:.1f} MB")
    print(f"raw data: {save(args.name, out)}")
    if args.keep is not None:
        shutil.move(str(db), str(args.keep))
        print(f"database kept: {args.keep}")
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
