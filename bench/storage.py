"""Storage: bytes on disk per sample and per distinct (image, offset, event), against perf.data.

The same workload (the pyenv Python interpreter running a mixed script, so
that samples spread over tens of thousands of distinct instructions in
libpython) is recorded at the same rate by `perf record` and by
`cyclescope record` for increasing lengths. cyclescope's epoch is compacted
before it is measured. The target: at most 16 B per distinct
(image, offset, event), flat as the run grows longer.

Usage: python bench/storage.py [--lengths 10,30,90] [--rate 5000]
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

from common import cyclescope_cmd, machine, perf_samples, run, save

SCRIPT = r"""
import json, re, sys, time, random
deadline = time.time() + float(sys.argv[1])
rng = random.Random(1)
words = ["alpha", "beta", "gamma", "delta", "epsilon"] * 20
while time.time() < deadline:
    d = {str(i): [rng.random() for _ in range(8)] for i in range(200)}
    s = json.dumps(d)
    json.loads(s)
    re.findall(r"[0-9]+\.[0-9]+", s[:5000])
    sorted(words, key=lambda w: (len(w), w))
    sum(x * x for x in range(5000))
    "-".join(w.upper() for w in words)
"""


def dir_bytes(p: Path) -> int:
    return sum(f.stat().st_size for f in p.rglob("*.parquet") if "epoch=" in str(f))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", default="10,30,90")
    ap.add_argument("--rate", type=int, default=5000)
    ap.add_argument("--python", default=shutil.which("python3.11") or sys.executable)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="cs-storage-"))
    script = tmp / "work.py"
    script.write_text(SCRIPT)
    rows: list[dict[str, Any]] = []
    for secs in [float(x) for x in args.lengths.split(",")]:
        wl = [args.python, str(script), str(secs)]
        pdata = tmp / f"perf-{secs}.data"
        r = run(["perf", "record", "-e", "cpu-clock", "-F", str(args.rate), "-o", str(pdata), "--", *wl])
        psamples = perf_samples(r.stderr)
        db = tmp / f"cs-{secs}.db"
        r2 = run(cyclescope_cmd("record", "--db", str(db), "-F", str(args.rate), "--flush-interval", "10", "--", *wl))
        if r2.returncode != 0:
            raise SystemExit(r2.stderr)
        before = dir_bytes(db)
        run(cyclescope_cmd("db", "compact", "--db", str(db)))
        after = dir_bytes(db)
        import duckdb

        files = [str(f) for f in db.rglob("seg-*.parquet")]
        con = duckdb.connect()
        samples, rows_n, distinct = con.execute(
            'SELECT sum("count"), count(*), count(DISTINCT (image, "offset", event)) FROM read_parquet(?)', [files]
        ).fetchone()
        row = {
            "seconds": secs, "perf_bytes": pdata.stat().st_size, "perf_samples": psamples,
            "perf_bytes_per_sample": pdata.stat().st_size / max(1, psamples),
            "cs_samples": int(samples), "cs_rows": int(rows_n), "cs_distinct_image_offset_event": int(distinct),
            "cs_bytes_before_compaction": before, "cs_bytes": after,
            "cs_bytes_per_sample": after / max(1, int(samples)),
            "cs_bytes_per_distinct": after / max(1, int(distinct)),
            "cs_bytes_per_row": after / max(1, int(rows_n)),
        }
        rows.append(row)
        print(f"{secs:>5.0f} s: perf.data {row['perf_bytes']:>10,} B for {psamples:>7,} samples "
              f"({row['perf_bytes_per_sample']:.1f} B/sample) | cyclescope {after:>8,} B for {int(samples):>7,} "
              f"samples, {int(distinct):>6,} distinct (image, offset, event), {int(rows_n):,} rows: "
              f"{row['cs_bytes_per_sample']:.2f} B/sample, {row['cs_bytes_per_distinct']:.2f} B/distinct "
              f"(before compaction {before:,} B)", flush=True)
    shutil.rmtree(tmp, ignore_errors=True)
    print(f"raw data: {save('storage', {'machine': machine(), 'args': vars(args), 'rows': rows})}")


if __name__ == "__main__":
    main()
