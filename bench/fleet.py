"""A simulated fleet (issue 29): ingest, queries on DuckDB and on Dask from 10 to 1,000 hosts,
and size per host-hour before and after downsampling.

The fleet is built from real recordings: three workloads (CPython running a mixed script, gcc
compiling, the bench's C workload) recorded with frame-pointer stacks. Each (host, hour) of the
fleet holds one compacted segment and one stack file, as a host's daemon ships them: one of 48
variants (3 recordings x 16 random rescalings of each image's counts: varied shares), hard-linked
into place, so that building 24,000 files takes seconds; the engines decode every file they read
(page-cache hits alike for both: the whole fleet fits in memory here).

Measured, each contender alternating with the other, --runs times:
- ingest: files per second shipped from --ship-hosts host databases of 24 hourly epochs, to a
  path and to `serve --ingest` over loopback; and what one daemon's shipping pass costs (CPU of
  the `cyclescope ship` child after one flush);
- queries, over the whole fleet and over one host, at 10, 100 and 1,000 hosts: the flat counts
  behind prof (``query_counts``), prof itself (counts + symbols), stats by epoch (24 sets), and
  the stack aggregation behind flame graphs; embedded DuckDB against a local Dask cluster of
  --workers processes (whose start-up is reported apart: a cluster runs on);
- size on disk per host-hour with 24 hourly epochs and after `db retain --by day` (of the
  --size-hosts fleet: retention's time grows with the hosts, its ratio does not).

Usage: python bench/fleet.py [--hosts 10,100,1000] [--runs 3] [--workers 2] [--ship-hosts 20]
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from common import ROOT, build, cyclescope_cmd, fmt_spread, machine, run, save

sys.path.insert(0, str(ROOT / "src"))

from cyclescope.db.layout import Database
from cyclescope.db.query import Selection

SCRIPT = r"""
import json, re, sys, time, random
deadline = time.time() + float(sys.argv[1])
rng = random.Random(1)
while time.time() < deadline:
    d = {str(i): [rng.random() for _ in range(8)] for i in range(200)}
    s = json.dumps(d); json.loads(s); re.findall(r"[0-9]+\.[0-9]+", s[:5000])
    sum(x * x for x in range(5000))
"""
EPOCHS = 24
VARIANTS = 16
HOUR = 3600.0


def record_bases(tmp: Path, seconds: float) -> list[Database]:
    """Three real recordings with stacks, each compacted to one segment and one stack file."""
    script = tmp / "mixed.py"
    script.write_text(SCRIPT)
    exe = build("workload.c", tmp / "workload", "-O2", "-g", "-fno-omit-frame-pointer")
    src = ROOT / "bench" / "workload.c"
    loop = (f"end=$(( $(date +%s) + {int(seconds)} )); "
            f"while [ $(date +%s) -lt $end ]; do gcc -O2 -c {src} -o /dev/null; done")
    cmds = [[sys.executable, str(script), str(seconds)], ["sh", "-c", loop], [str(exe), "400000000"]]
    out = []
    for i, cmd in enumerate(cmds):
        db = tmp / f"base{i}"
        r = run(cyclescope_cmd("record", "--db", str(db), "-q", "-F", "2000", "-g", "fp", "-d", str(seconds), "--",
                               *cmd))
        if r.returncode != 0:
            raise SystemExit(f"record failed: {r.stderr[-600:]}")
        r = run(cyclescope_cmd("db", "compact", "--db", str(db)))
        out.append(Database.open(db))
    return out


def make_variants(bases: list[Database], tmp: Path, rng: np.random.Generator) -> list[tuple[Path, Path]]:
    """(segment, stack file) variants: each image's counts of a base scaled by a random factor."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from cyclescope.db.segment import read_meta, read_table, write_parquet
    from cyclescope.db.stacks import read_stack_file, stack_files

    out = []
    vdir = tmp / "variants"
    vdir.mkdir()
    for b, db in enumerate(bases):
        ep = db.epochs()[0]
        host = db.hosts(ep)[0]
        seg = db.segments(ep, host)[0].path
        meta, table = read_meta(seg), read_table(seg)
        stk_meta, stk = read_stack_file(stack_files(db, ep, host)[0].path)
        images = table.column("image").to_pylist()
        uniq = sorted(set(images))
        for v in range(VARIANTS):
            f = {k: rng.uniform(0.25, 2.0) for k in uniq}
            scale = np.array([f[k] for k in images])
            count = np.maximum(np.rint(table.column("count").to_numpy(zero_copy_only=False) * scale), 1)
            count = count.astype(np.uint64)
            weight = np.rint(table.column("weight").to_numpy(zero_copy_only=False) * scale).astype(np.uint64)
            t = table.set_column(4, "count", pa.array(count)).set_column(5, "weight", pa.array(weight))
            p = vdir / f"seg-{b}-{v}.parquet"
            write_parquet(t, p, meta)
            leaf = [im[0] if im else "" for im in stk.column("images").to_pylist()]
            sc = np.array([f.get(k, 1.0) for k in leaf])
            sn = np.maximum(np.rint(stk.column("count").to_numpy(zero_copy_only=False) * sc), 1).astype(np.uint64)
            s = stk.set_column(stk.column_names.index("count"), "count", pa.array(sn))
            sp = vdir / f"stk-{b}-{v}.parquet"
            import json

            pq.write_table(s.replace_schema_metadata({b"cyclescope-stacks": json.dumps(stk_meta).encode()}), sp,
                           compression="zstd")
            out.append((p, sp))
    return out


def build_fleet(root: Path, hosts: int, variants: list[tuple[Path, Path]], rng: np.random.Generator,
                start: float) -> Database:
    """``hosts`` x 24 hourly epochs, one segment and one stack file each (hard links)."""
    db = Database.create_or_open(root)
    import json

    for e in range(1, EPOCHS + 1):
        d = db.epoch_dir(e)
        d.mkdir()
        (d / "epoch.json").write_text(json.dumps({"id": e, "created": start + (e - 1) * HOUR, "name": None,
                                                  "shared": True}))
        for h in range(hosts):
            seg, stk = variants[int(rng.integers(len(variants)))]
            hd = d / f"host=h{h:04d}"
            (hd / "stacks").mkdir(parents=True)
            os.link(seg, hd / "seg-00000001-00000001.parquet")
            os.link(stk, hd / "stacks" / "stk-00000001-00000001.parquet")
    return db


def timed(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def queries(db: Database, engine: Any, host: str | None) -> dict[str, Callable[[], Any]]:
    from cyclescope.app.compare import sample_sets, set_counts
    from cyclescope.app.prof import prof_report
    from cyclescope.app.profile import Profile
    from cyclescope.binaries.symbolize import Symbolizer
    from cyclescope.db.query import open_profile, query_counts

    sel = Selection(epochs="all", hosts=(host,) if host else ())
    sym = Symbolizer(db)

    def prof_counts() -> Any:
        return query_counts(open_profile(db, sel, engine))

    def prof() -> Any:
        return prof_report(Profile(open_profile(db, sel, engine), sym))

    def stats() -> Any:
        for _, sdb, s in sample_sets([db], "all", "epoch", [host] if host else [], sel):
            set_counts(Profile(open_profile(sdb, s, engine), sym), None, False)

    def flame() -> Any:
        return Profile(open_profile(db, sel, engine), sym).stack_arrays()

    return {"counts": prof_counts, "prof": prof, "stats": stats, "flame": flame}


def bench_queries(fleets: dict[int, Database], runs: int, workers: int) -> dict[str, Any]:
    from cyclescope.fleet.engine import DaskEngine

    t0 = time.perf_counter()
    dask = DaskEngine(workers=workers)
    startup = time.perf_counter() - t0
    out: dict[str, Any] = {"dask_startup_s": startup, "workers": workers, "results": {}}
    print(f"dask local cluster of {workers} workers: started in {startup:.2f} s", flush=True)
    for n, db in fleets.items():
        for scope in ("fleet", "host"):
            host = "h0000" if scope == "host" else None
            for name in ("counts", "prof", "stats", "flame"):
                times: dict[str, list[float]] = {"duckdb": [], "dask": []}
                for r in range(runs):
                    order = [("duckdb", None), ("dask", dask)] if r % 2 == 0 else [("dask", dask), ("duckdb", None)]
                    for label, eng in order:
                        times[label].append(timed(queries(db, eng, host)[name]))
                ratio = [a / b for a, b in zip(times["dask"], times["duckdb"], strict=True)]
                out["results"][f"{n}/{scope}/{name}"] = {**times, "ratio_dask_over_duckdb": ratio}
                print(f"{n:5d} hosts {scope:5s} {name:6s}  duckdb {fmt_spread(times['duckdb'], ' s')}  "
                      f"dask {fmt_spread(times['dask'], ' s')}  dask/duckdb {fmt_spread(ratio)}", flush=True)
    dask.close()
    return out


def bench_ingest(variants: list[tuple[Path, Path]], tmp: Path, hosts: int, runs: int) -> dict[str, Any]:
    """Host databases of 24 epochs (a segment, a stack file, a timeline each) shipped to a path
    and to `serve --ingest`, alternating."""
    from cyclescope.fleet.ship import HttpDestination, PathDestination, ship

    rng = np.random.default_rng(3)
    srcs = []
    for h in range(hosts):
        db = Database.create_or_open(tmp / f"src{h}")
        for _ in range(EPOCHS):
            ep = db.new_epoch()
            seg, stk = variants[int(rng.integers(len(variants)))]
            hd = db.ensure(db.host_dir(ep, f"s{h:03d}") / "stacks")
            os.link(seg, hd.parent / "seg-00000001-00000001.parquet")
            os.link(stk, hd / "stk-00000001-00000001.parquet")
        srcs.append(db)
    files = hosts * EPOCHS * 2
    token = "bench-ingest-token-0123456789"
    res: dict[str, list[float]] = {"path": [], "http": []}
    for r in range(runs):
        for kind in (("path", "http") if r % 2 == 0 else ("http", "path")):
            central = tmp / f"central-{kind}-{r}"
            for db in srcs:
                shutil.rmtree(db.root / "ship", ignore_errors=True)
            srv = None
            if kind == "http":
                env = {**os.environ, "CYCLESCOPE_INGEST_TOKEN": token, "PYTHONPATH": str(ROOT / "src")}
                srv = subprocess.Popen(cyclescope_cmd("serve", "--db", str(central), "--ingest", "--port", "0"),
                                       stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
                assert srv.stdout is not None
                url = srv.stdout.readline().strip().split("/?", 1)[0]
                dest: Any = HttpDestination(url, token)
            else:
                dest = PathDestination(str(central))
            t0 = time.perf_counter()
            sent = sum(ship(db, dest).stored for db in srcs)
            dt = time.perf_counter() - t0
            if srv is not None:
                srv.send_signal(signal.SIGTERM)
                srv.wait(30)
            assert sent == files, (sent, files)
            res[kind].append(files / dt)
            shutil.rmtree(central, ignore_errors=True)
    for k, v in res.items():
        print(f"ingest {k:4s}: {fmt_spread(v, ' files/s', 0)} ({files} files from {hosts} hosts)", flush=True)
    # A pass after one flush: what the daemon spends (in its worker thread), and what a `cyclescope
    # ship` run from cron spends (a process: mostly Python's and the imports' start-up).
    db = srcs[0]
    central = tmp / "central-pass"
    dest = PathDestination(str(central))
    ship(db, dest)
    inproc, child = [], []
    for i in range(2 * (runs + 2)):
        ep = db.epochs()[-1]
        seg, _ = variants[0]
        n = db.next_seq(ep, "s000")
        os.link(seg, db.host_dir(ep, "s000") / f"seg-{n:08d}-{n:08d}.parquet")
        if i % 2 == 0:
            c0 = time.process_time()
            ship(db, dest)
            inproc.append(time.process_time() - c0)
        else:
            child.append(run(cyclescope_cmd("ship", "--db", str(db.root), "--to", str(central), "-q")).cpu_s)
    print(f"one shipping pass after a flush: in the daemon {fmt_spread(inproc, ' CPU-s')}, "
          f"as a `cyclescope ship` process {fmt_spread(child, ' CPU-s')}", flush=True)
    return {"files_per_s": res, "files": files, "pass_cpu_s_daemon": inproc, "pass_cpu_s_process": child}


def bench_size(db: Database, hosts: int) -> dict[str, Any]:
    from cyclescope.fleet.retain import dir_size, retain

    # Epochs the fleet's link farm shares between hosts count once per host: measure the bytes
    # each host-hour's files hold, not the inodes.
    def fleet_bytes() -> int:
        total = 0
        for ep in db.epochs():
            for h in db.hosts(ep):
                for f in db.host_dir(ep, h).rglob("*.parquet"):
                    total += f.stat().st_size
        return total

    before = fleet_bytes()
    t0 = time.perf_counter()
    report = retain(db, 0, "day", now=time.time() + 10 * 86400)
    took = time.perf_counter() - t0
    after = fleet_bytes()
    hh = hosts * EPOCHS
    print(f"size per host-hour: {before / hh / 1024:.1f} KiB with hourly epochs, {after / hh / 1024:.1f} KiB after "
          f"merging each day ({len(report.merged)} merge(s), {took:.1f} s for {hosts} hosts)", flush=True)
    return {"bytes_before": before, "bytes_after": after, "host_hours": hh, "retain_s": took,
            "dir_size_after": dir_size(db.root)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hosts", default="10,100,1000")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--ship-hosts", type=int, default=20)
    ap.add_argument("--size-hosts", type=int, default=100,
                    help="the fleet whose size is measured before and after merging its days (default: 100)")
    ap.add_argument("--seconds", type=float, default=3.0, help="length of each base recording")
    ap.add_argument("--parts", default="ingest,queries,size", help="what to measure (default: all three)")
    ap.add_argument("--save-as", default="fleet")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="cs-fleet-"))
    rng = np.random.default_rng(1)
    try:
        bases = record_bases(tmp, args.seconds)
        variants = make_variants(bases, tmp, rng)
        start = time.time() - 3 * 86400
        fleets = {}
        for n in [int(x) for x in args.hosts.split(",")]:
            t0 = time.perf_counter()
            fleets[n] = build_fleet(tmp / f"fleet{n}", n, variants, rng, start - start % 86400)
            print(f"fleet of {n} hosts x {EPOCHS} epochs built in {time.perf_counter() - t0:.1f} s", flush=True)
        result: dict[str, Any] = {"machine": machine(), "args": vars(args)}
        parts = args.parts.split(",")
        if "ingest" in parts:
            result["ingest"] = bench_ingest(variants, tmp, args.ship_hosts, args.runs)
        if "queries" in parts:
            result["queries"] = bench_queries(fleets, args.runs, args.workers)
        if "size" in parts:
            n = args.size_hosts if args.size_hosts in fleets else max(fleets)
            result["size"] = bench_size(fleets[n], n)
        print(f"saved {save(args.save_as, result)}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
