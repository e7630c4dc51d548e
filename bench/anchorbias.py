"""How far traps disturb what anchors count: per anchored procedure of the accuracy suite, the
entries counted in windows against callgrind's exact entry count, and the time each trap adds to
the procedure's own time in the windows.

Reads the databases and callgrind output that `bench/accuracy.py --keep DIR` kept (it records
nothing). For each procedure with an anchor that counted at least 10 entries: its samples, the
anchor's hits and window samples, entries estimated / exact, the procedure's time per entry in the
windows and outside them (its samples in the profile times the mean period over the exact entry
count), and the difference: what a trap adds to the procedure's own time. Where the anchors tallied
the probed threads' other user samples in the windows (`other`), a second estimate weighs the windows
by those instead: hits / other x the program's user samples outside the procedure.

Usage: python bench/anchorbias.py --keep DIR [--programs kernels,demo,...] [--runs 3]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from common import hot_procedures, machine, save
from suite import programs


def user_samples(db: Path, event: str) -> float:
    """The recording's samples of ``event`` in user mode in a known image (every image but the
    kernel's and the unknown one): what the anchors' ``other`` tally counts in windows."""
    from cyclescope.app.prof import prof_report
    from cyclescope.app.profile import open_profile
    from cyclescope.db.layout import Database
    from cyclescope.db.query import Selection

    profile = open_profile(Database.open(db), Selection(epochs="all"))
    rep = prof_report(profile, by_image=True)
    i = rep.events.index(event)
    kinds = {k: info.kind for k, info in profile.ps.images.items()}
    return float(sum(r.counts[i] for r in rep.rows if kinds.get(r.image_key) not in ("kernel", "module", "unknown")))


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
          f"{'us/entry in windows':>19s} {'outside':>8s} {'added us/hit':>12s} {'other':>6s} {'by other/exact':>14s}")
    for p in progs:
        cg, db = keep / f"cg-{p.name}.out", keep / f"{p.name}.db"
        if not cg.exists() or not db.exists():
            print(f"{p.name}: not kept in {keep}, skipped")
            continue
        prof = parse_callgrind(cg.read_text())
        ob = prof.object_for(str(p.exe))
        profile, ev, hot = hot_procedures(db, p.image, args.min_samples)
        period_us = profile.ps.events[ev].mean_period / 1e3  # cpu-clock: ns
        user = user_samples(db, ev)
        for samples, t in hot:
            a = profile.anchor_stats(t.info.key, t.start)
            exact = prof.counts[ob].get(t.start, 0) * args.runs if ob else 0
            if a is None or a.hits < 10 or not exact:
                continue
            est = a.entries(samples) or 0.0
            inside = a.samples * period_us / a.hits
            outside = samples * period_us / exact
            by_other = a.hits / a.other * (user - samples) / exact if a.other else float("nan")
            rows.append({"program": p.name, "procedure": t.name, "samples": samples, "hits": a.hits,
                         "window_samples": a.samples, "est_over_exact": est / exact, "us_in_windows": inside,
                         "us_outside": outside, "added_us": inside - outside, "other": a.other,
                         "by_other_over_exact": by_other})
            print(f"{p.name:8s} {t.name[:32]:32s} {samples:8.0f} {a.hits:7d} {a.samples:6d} {est / exact:9.2f} "
                  f"{inside:19.3f} {outside:8.3f} {inside - outside:12.3f} {a.other:6d} {by_other:14.2f}")
    path = save("anchorbias", {"machine": machine(), "args": vars(args), "rows": rows})
    print(f"raw data: {path}")


if __name__ == "__main__":
    main()
