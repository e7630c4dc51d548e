"""How fast `cyclescope serve` renders, timed by the browser itself (headless Chromium, Performance API).

Two databases, both built from a real system-wide recording of this machine (`record -a -g fp` at
5 kHz while gcc compiles in a loop):
  hour:   one hour of 2 CPUs at 5 kHz (36 M samples): the recording's flat and stack tables written
          as 60 one-minute segments with their counts scaled, then compacted as the daemon does;
  stacks: 100,000 distinct call stacks, random paths through a call tree of the kernel's and the
          recorded images' real functions (frames named as in any profile).
For each view: the time from navigation start to the view's "rendered" mark (fetch, server work
and drawing), fresh page loads, several rounds. For the flame graph of `stacks`: a zoom (a click on
a frame, to the next painted frame) and a search (a term typed, to the next painted frame).

Usage: python bench/serve.py [--rounds N]    (root: it records system-wide)
Targets (issue 27): every view < 1 s; zoom and search < 100 ms.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import PY, ROOT, machine, median, save

SRC = ROOT / "src"
ENV = {**os.environ, "PYTHONPATH": str(SRC)}


def fmt_ms(xs: list[float]) -> str:
    return f"{median(xs):6.0f} ms [{min(xs):.0f}-{max(xs):.0f}]"


def cs(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([PY, "-m", "cyclescope", *args], check=True, capture_output=True, text=True, env=ENV)


def base_recording(work: Path) -> Path:
    """A real system-wide recording with stacks, while gcc compiles the demo workload in a loop."""
    db = work / "base.db"
    stop = work / "stop"
    loop = subprocess.Popen(["bash", "-c", f"while [ ! -e {stop} ]; do gcc -O2 -g -c -o {work}/w.o "
                             f"{SRC}/cyclescope/demo/workload.c; done"])
    try:
        cs("record", "--db", str(db), "-a", "-F", "5000", "-g", "fp", "-q", "-d", "4")
    finally:
        stop.touch()
        loop.wait()
    return db


def scaled(col: Any, scale: float) -> Any:
    """A count column times ``scale``, rounded, in its own type."""
    import pyarrow.compute as pc

    return pc.round(pc.multiply(col.cast("float64"), scale)).cast(col.type)


def hour_db(base: Path, out: Path) -> Path:
    """The base recording's tables as one hour of 2 CPUs at 5 kHz: 60 one-minute segments."""

    from cyclescope.db.layout import Database
    from cyclescope.db.segment import read_meta, read_table, write_segment
    from cyclescope.db.stacks import _link, _read, stack_files, stacks_dir

    src = Database.open(base)
    ep = src.epochs()[0]
    host = src.hosts(ep)[0]
    segs = [(read_meta(r.path), read_table(r.path)) for r in src.segments(ep, host)]
    stks = [_read(r.path) for r in stack_files(src, ep, host)]
    total = sum(m.total_samples for m, _ in segs)
    per_minute = 2 * 5000 * 60
    scale = per_minute / max(1, total)
    db = Database.create_or_open(out)
    e = db.new_epoch("hour")
    t0 = time.time() - 3600
    for sub in ("symbols", "binaries"):  # the recorded images' archive, as the daemon keeps it
        if (src.root / sub).exists():
            shutil.copytree(src.root / sub, db.root / sub, dirs_exist_ok=True)
    for minute in range(60):
        for meta, table in segs:
            m = type(meta).from_json(meta.to_json())
            m.start_time, m.end_time = t0 + 60 * minute, t0 + 60 * (minute + 1)
            for em in m.events.values():
                em.samples = int(em.samples * scale)
                em.period_sum = int(em.period_sum * scale)
            t = table
            for col in ("count", "weight"):  # samples, and the sum of their periods that weighs them
                if col in t.column_names and t.column(col).null_count < len(t):
                    t = t.set_column(t.column_names.index(col), col, scaled(t.column(col), scale))
            write_segment(db, e, host, t, m)
        d = db.ensure(stacks_dir(db, e, host))
        for i, (meta_s, t) in enumerate(stks):
            counts = scaled(t.column("count"), scale)
            seq = minute * len(stks) + i + 1
            _link(db, d, t.set_column(t.column_names.index("count"), "count", counts), {**meta_s, "epoch": e},
                  seq, seq)
    subprocess.run([PY, "-m", "cyclescope", "db", "compact", "--db", str(out)], check=True, env=ENV,
                   capture_output=True)
    return out


def stacks_db(base: Path, out: Path, distinct: int = 100_000, seed: int = 1) -> Path:
    """``distinct`` different stacks: random root-to-leaf paths through a call tree of real functions."""
    import numpy as np

    from cyclescope.binaries.symbolize import Symbolizer
    from cyclescope.db.layout import Database
    from cyclescope.db.query import Selection, open_profile
    from cyclescope.db.stacks import _link, _read, _table, stack_files, stacks_dir

    src = Database.open(base)
    profile_set = open_profile(src, Selection(epochs="all"))
    sym = Symbolizer(src)
    funcs: list[tuple[str, int]] = []
    for key, info in profile_set.images.items():
        t = sym.table(info)
        funcs += [(key, int(s)) for s in np.unique(t.starts)[:20000]]
    rng = random.Random(seed)
    rng.shuffle(funcs)
    # A call tree: each function calls 2-12 others; a stack is a path of depth 4-40 from a root.
    kids: dict[int, list[int]] = {}
    roots = list(range(8))
    seen: set[tuple[int, ...]] = set()
    while len(seen) < distinct:
        path = [rng.choice(roots)]
        for _ in range(rng.randint(3, 39)):
            ch = kids.setdefault(path[-1], [rng.randrange(len(funcs)) for _ in range(rng.randint(2, 12))])
            path.append(rng.choice(ch))
        seen.add(tuple(path))
    stacks = list(seen)
    counts = [max(1, int(rng.paretovariate(1.2))) for _ in stacks]
    ep0 = src.epochs()[0]
    host = src.hosts(ep0)[0]
    meta0, _ = _read(stack_files(src, ep0, host)[0].path)
    shutil.copytree(src.root, out)
    db = Database.open(out)
    ev = next(iter(profile_set.events))
    table = _table([ev] * len(stacks), ["synthetic"] * len(stacks), counts,
                   [[funcs[f][0] for f in reversed(s)] for s in stacks],
                   [[funcs[f][1] for f in reversed(s)] for s in stacks])
    for r in stack_files(db, ep0, host):
        r.path.unlink()
    d = db.ensure(stacks_dir(db, ep0, host))
    _link(db, d, table, {**meta0, "epoch": ep0}, 1, 1)
    return out


def browser() -> Any:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    o = webdriver.ChromeOptions()
    o.binary_location = "/usr/bin/chromium"
    for a in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
              "--disable-background-networking", "--disable-component-update", "--disable-sync",
              "--window-size=1280,1000", f"--user-data-dir={tempfile.mkdtemp()}"):
        o.add_argument(a)
    return webdriver.Chrome(service=Service("/usr/bin/chromedriver"), options=o)


def serve(db: Path) -> tuple[subprocess.Popen[str], str]:
    p = subprocess.Popen([PY, "-m", "cyclescope", "serve", "--db", str(db), "--port", "0"], stdout=subprocess.PIPE,
                         stderr=subprocess.DEVNULL, text=True, env=ENV)
    assert p.stdout is not None
    return p, p.stdout.readline().strip()


def view_ms(drv: Any, base: str, view: str, mark: str, timeout: float = 120) -> float:
    """A fresh load of ``view``; ms from navigation start to the end of the page's ``mark`` measure."""
    from selenium.webdriver.support.ui import WebDriverWait

    drv.get("about:blank")
    drv.get(base + "/#/" + view)
    WebDriverWait(drv, timeout).until(lambda d: d.execute_script(
        "return performance.getEntriesByName(arguments[0]).length > 0", mark))
    e = drv.execute_script("const m = performance.getEntriesByName(arguments[0])[0];"
                           "return m.startTime + m.duration", mark)
    return float(e)


ZOOM_JS = """
const done = arguments[arguments.length - 1];
const frames = [...document.querySelectorAll('#flame g.frame')].filter(g => g.getAttribute('name') !== 'all');
const g = frames[Math.floor(frames.length / %d) %% frames.length];
const t0 = performance.now();
g.dispatchEvent(new MouseEvent('click', {bubbles: true}));
requestAnimationFrame(() => requestAnimationFrame(() => {
  const t = performance.now() - t0; window.cyclescope.chart().resetZoom();
  requestAnimationFrame(() => done([t, frames.length]));
}));
"""

SEARCH_JS = """
const done = arguments[arguments.length - 1];
const t0 = performance.now();
window.cyclescope.search(arguments[0]);
requestAnimationFrame(() => requestAnimationFrame(() => {
  const t = performance.now() - t0; window.cyclescope.search('');
  requestAnimationFrame(() => done(t));
}));
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--keep", metavar="DIR", type=Path,
                    help="build the databases in DIR and keep them; use those already there")
    args = ap.parse_args()
    work = args.keep or Path(tempfile.mkdtemp(prefix="cyclescope-bench-serve-"))
    work.mkdir(parents=True, exist_ok=True)
    hour, many = work / "hour.db", work / "stacks.db"
    if not (hour.exists() and many.exists()):
        for d in (work / "base.db", hour, many):
            shutil.rmtree(d, ignore_errors=True)
        print("recording the base (4 s, system-wide, 5 kHz, -g fp, gcc in a loop)...", file=sys.stderr)
        base = base_recording(work)
        print("building the hour database...", file=sys.stderr)
        hour_db(base, hour)
        print("building the 100,000-stack database...", file=sys.stderr)
        stacks_db(base, many)
    top = subprocess.run([PY, "-m", "cyclescope", "prof", "--db", str(hour), "--epoch", "all", "--json"],
                         check=True, capture_output=True, text=True, env=ENV).stdout
    import json

    report = json.loads(top)
    user = [r for r in report["rows"]
            if r["image"] and not r["image"].startswith("[") and not r["procedure"].startswith("[")]
    # The hottest user procedure is the recorder's own interpreter loop (10,000 instructions, about as
    # large as procedures come); the compiler's hottest is a more usual size.
    hot = user[0]["procedure"]
    cc1 = next((r["procedure"] for r in user if r["image"].endswith("/cc1")), hot)
    total = sum(report["totals"].values())
    print(f"hour database: {total:,} samples; hot user procedure {hot}; cc1's {cc1}", file=sys.stderr)
    results: dict[str, Any] = {"machine": machine(), "hour_samples": total, "rounds": args.rounds,
                               "procedures": {"hot": hot, "cc1": cc1}}
    drv = browser()
    try:
        views = {
            "overview": ("overview", "view:overview"),
            "flame": ("flame", "view:flame"),
            "listing": (f"proc?name={hot}", "proc:listing"),
            "listing+calc": (f"proc?name={hot}", "view:proc"),
            "cc1 listing": (f"proc?name={cc1}", "proc:listing"),
            "cc1 listing+calc": (f"proc?name={cc1}", "view:proc"),
            "diff": ("diff?a=all&b=all", "view:diff"),
            "stats (by host)": ("stats?by=host", "view:stats"),
        }
        p, url = serve(hour)
        try:
            drv.get(url)
            base_url = url.split("/?")[0]
            for k in ("listing+calc", "cc1 listing+calc"):  # calc's model cache, once
                view_ms(drv, base_url, views[k][0], "view:proc", 300)
            times: dict[str, list[float]] = {k: [] for k in views}
            for _ in range(args.rounds):
                for k, (v, mark) in views.items():
                    times[k].append(view_ms(drv, base_url, v, mark))
        finally:
            p.terminate()
            p.wait()
        results["hour"] = times
        p, url = serve(many)
        try:
            drv.get(url)
            base_url = url.split("/?")[0]
            flame_ms, zoom_ms, search_ms = [], [], []
            frames = 0
            drv.set_script_timeout(60)
            for _r in range(args.rounds):
                flame_ms.append(view_ms(drv, base_url, "flame", "view:flame"))
                for k in range(3):
                    t, frames = drv.execute_async_script(ZOOM_JS % (k + 2))
                    zoom_ms.append(float(t))
                for term in ("sched", "^ext4", "irq"):
                    search_ms.append(float(drv.execute_async_script(SEARCH_JS, term)))
            results["stacks"] = {"distinct": 100_000, "frames_drawn": frames, "flame": flame_ms, "zoom": zoom_ms,
                                 "search": search_ms}
        finally:
            p.terminate()
            p.wait()
    finally:
        drv.quit()
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    print(f"\ncyclescope serve, browser timings (median [min-max] of {args.rounds} rounds; views are fresh page loads)")
    print(f"hour database ({total:,} samples, 2 CPUs x 5 kHz x 1 h, compacted); listings of {hot} and, "
          f"in cc1, {cc1}:")
    for k, xs in results["hour"].items():
        print(f"  {k:18s} {fmt_ms(xs)}{'   over 1 s' if median(xs) > 1000 else ''}")
    s = results["stacks"]
    print(f"100,000 distinct stacks ({s['frames_drawn']:,} frames drawn):")
    print(f"  {'flame view':18s} {fmt_ms(s['flame'])}")
    print(f"  {'zoom':18s} {fmt_ms(s['zoom'])}{'   over 100 ms' if median(s['zoom']) > 100 else ''}")
    print(f"  {'search':18s} {fmt_ms(s['search'])}"
          f"{'   over 100 ms' if median(s['search']) > 100 else ''}")
    path = save("serve", results)
    print(f"saved {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
