"""`list` on a hot procedure of a large library with DWARF, cold and warm; `stats` over 8 epochs.

1. The pyenv Python (whose libpython3.11 carries DWARF 5) runs a workload
   under `cyclescope record`; the hottest libpython procedure is then listed
   with an empty decode cache (cold) and again with it filled (warm),
   alternately, several times. Target: under 1 s warm.
2. The same workload is recorded 8 times (8 epochs); `cyclescope stats`
   over them is timed and its top rows shown, then `diff` of two epochs.

Usage: python bench/listing.py [--runs 5]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from common import cyclescope_cmd, fmt_spread, machine, run, save

SCRIPT = r"""
import json, re, sys, random
rng = random.Random(int(sys.argv[2]) if len(sys.argv) > 2 else 1)
n = int(float(sys.argv[1]) * 25)
for _ in range(n):
    d = {str(i): [rng.random() for _ in range(8)] for i in range(300)}
    s = json.dumps(d)
    json.loads(s)
    re.findall(r"[0-9]+\.[0-9]+", s[:8000])
    sum(x * x for x in range(20000))
"""


def timed(cmd: list[str], env: dict[str, str]) -> tuple[float, str]:
    t0 = time.monotonic()
    r = run(cmd, env=env)
    if r.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed: {r.stderr}")
    return time.monotonic() - t0, r.stdout


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--python", default=shutil.which("python3.11") or sys.executable)
    ap.add_argument("--seconds", type=float, default=4.0)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="cs-list-"))
    script = tmp / "work.py"
    script.write_text(SCRIPT)
    db = tmp / "db"
    r = run(cyclescope_cmd("record", "--db", str(db), "-F", "5000", "--", args.python, str(script),
                           str(args.seconds)))
    if r.returncode != 0:
        raise SystemExit(r.stderr)
    env = dict(os.environ)
    prof = json.loads(run(cyclescope_cmd("prof", "--db", str(db), "--json", "--image", "libpython3.11.so.1.0"),
                          env=env).stdout)
    hot = prof["rows"][0]
    proc = hot["procedure"]
    print(f"hottest libpython procedure: {proc} ({hot['samples']['cpu-clock']} samples)")
    cold: list[float] = []
    warm: list[float] = []
    lines = 0
    for i in range(args.runs):
        cache = tmp / f"cache-{i}"
        env_c = dict(env, CYCLESCOPE_CACHE=str(cache))
        cmd = cyclescope_cmd("list", proc, "--db", str(db), "--image", "libpython3.11.so.1.0")
        t, out = timed(cmd, env_c)
        cold.append(t)
        t, out = timed(cmd, env_c)
        warm.append(t)
        lines = len(out.splitlines())
        print(f"round {i}: cold {cold[-1]:.2f} s, warm {warm[-1]:.2f} s ({lines} lines)", flush=True)
    print(f"list {proc}: cold {fmt_spread(cold, ' s', 2)}, warm {fmt_spread(warm, ' s', 2)}; {lines} lines of output")
    # stats over 8 epochs of the same workload, different seeds
    sdb = tmp / "stats.db"
    for k in range(8):
        r = run(cyclescope_cmd("record", "--db", str(sdb), "-q", "-F", "5000", "--", args.python, str(script),
                               "2", str(k)))
        if r.returncode != 0:
            raise SystemExit(r.stderr)
    st_times = []
    out = ""
    for _ in range(args.runs):
        t, out = timed(cyclescope_cmd("stats", "--db", str(sdb), "--limit", "8"), env)
        st_times.append(t)
    print(out)
    print(f"stats over 8 epochs: {fmt_spread(st_times, ' s', 2)}")
    dt, dout = timed(cyclescope_cmd("diff", "1", "8", "--db", str(sdb), "--limit", "8"), env)
    print(dout)
    print(f"diff of two epochs: {dt:.2f} s")
    save("listing", {"machine": machine(), "procedure": proc, "cold_s": cold, "warm_s": warm,
                     "list_lines": lines, "stats_s": st_times, "stats_output": out, "diff_output": dout,
                     "diff_s": dt, "median_warm_s": statistics.median(warm)})
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
