"""How far traps disturb what anchors count: per anchored procedure of the accuracy suite, the
entries counted in windows against callgrind's exact entry count, and the time each trap adds to
the procedure's own time in the windows.

Reads the databases and callgrind output that `bench/accuracy.py --keep DIR` kept (it records
nothing). For each procedure with an anchor that counted at least 10 entries: its samples, the
anchor's hits and window samples, entries estimated / exact, the procedure's time per entry in the
windows and outside them (its samples in the profile times the mean period over the exact entry
count), and the difference: what a trap adds to the procedure's own time.

Usage: python bench/anchorbias.py --keep DIR [--programs kernels,demo,...] [--runs 3]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from common import hot_procedures, machine, save
from suite import programs


def near_entry(profile: Any, t: Any, ev: str) -> float:
    """The procedure's samples in its entry's first NEAR_BYTES, which anchors leave out on both
    sides where their tallies counted them apart (AnchorStats.entries)."""
    from cyclescope.analysis.anchors import near_samples
    from cyclescope.app.calc import calc_target

    c = calc_target(profile, t, ev, None, evidence=False)
    return near_samples([ins.address for ins in c.cfg.insns], c.samples[:, c.events.index(ev)], t.start)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--keep", metavar="DIR", required=True, help="what bench/accuracy.py --keep DIR kept")
    ap.add_argument("--programs", default="kernels,demo,bzip2,gzip,xz,zlib,lua,sqlite,zstd,lzip")
    ap.add_argument("--runs", type=int, default=3, help="recordings per database (callgrind's counts times this)")
    ap.add_argument("--min-samples", type=int, default=100)
    args = ap.parse_args()
    from cyclescope.analysis.callgrind import parse_callgrind

    keep = Path(args.keep)
    progs, _ = programs(args.programs.split(","))
    rows = []
    print(f"{'program':8s} {'procedure':32s} {'samples':>8s} {'hits':>7s} {'in win':>6s} {'est/exact':>9s} "
          f"{'us/entry in windows':>19s} {'outside':>8s} {'added us/hit':>12s}")
    for p in progs:
        cg, db = keep / f"cg-{p.name}.out", keep / f"{p.name}.db"
        if not cg.exists() or not db.exists():
            print(f"{p.name}: not kept in {keep}, skipped")
            continue
        prof = parse_callgrind(cg.read_text())
        ob = prof.object_for(str(p.exe))
        profile, ev, hot = hot_procedures(db, p.image, args.min_samples)
        period_us = profile.profile_set.events[ev].mean_period / 1e3  # cpu-clock: ns
        for samples, t in hot:
            a = profile.anchor_stats(t.info.key, t.start)
            exact = prof.counts[ob].get(t.start, 0) * args.runs if ob else 0
            if a is None or a.hits < 10 or not exact:
                continue
            near = near_entry(profile, t, ev) if a.near else 0.0
            est = a.entries(samples, near) or 0.0
            inside = (a.samples - a.near) * period_us / a.hits
            outside = (samples - near) * period_us / exact
            rows.append({"program": p.name, "procedure": t.name, "samples": samples, "hits": a.hits,
                         "window_samples": a.samples, "est_over_exact": est / exact, "us_in_windows": inside,
                         "us_outside": outside, "added_us": inside - outside})
            print(f"{p.name:8s} {t.name[:32]:32s} {samples:8.0f} {a.hits:7d} {a.samples:6d} {est / exact:9.2f} "
                  f"{inside:19.3f} {outside:8.3f} {inside - outside:12.3f}")
    path = save("anchorbias", {"machine": machine(), "args": vars(args), "rows": rows})
    print(f"raw data: {path}")


if __name__ == "__main__":
    main()
