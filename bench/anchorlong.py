"""Anchors on runs long enough for them: each anchored procedure's entry count, as the anchor
gives it and as calc gives it, against the exact count of a perf uprobe counting every entry.

bench/accuracy.py's recordings mostly last under a second, and anchors start at the first drain,
1 s in; there anchors barely count. Here the suite's compressors (xz, zstd, lzip: their hot
procedures are entered hundreds of thousands of times a second, so their anchors are costly and
counted in windows) compress the suite's input repeated ``--repeat`` times, recorded ``--runs``
times with default `record` settings; the entries of the ``--top`` hottest anchored procedures
are then counted exactly in one more run under `perf stat` with a `perf probe` at each entry
(counting mode, as the anchors), kept in DIR with ``--keep``.

With ``--old SRC``, each run also records with the `record` of another source tree (say a
worktree of the previous commit), alternated, and both are analyzed by this tree's calc.

Per procedure and run: the anchor's windows and window samples, its count / exact (leaving out the
samples where traps return, when the recording tallied them: AnchorStats.entries), the same
without that correction, calc's entry count / exact and its method, and the model's (calc without
loop counters, anchors or paths) / exact.

Usage: python bench/anchorlong.py [--programs xz,zstd,lzip] [--repeat 3] [--runs 3] [--top 4] [--old SRC]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from common import PY, hot_procedures, machine, perf_probes, save
from suite import programs, repeated_input


def exact_entries(exe: Path, args: list[str], entries: dict[str, int]) -> dict[str, int]:
    """Every entry of each procedure (name -> vaddr) counted by perf probes in one run."""
    names = {f"a{i}": name for i, name in enumerate(entries)}
    with perf_probes(exe, {ev: f"{entries[name]:#x}" for ev, name in names.items()}) as events, \
            tempfile.NamedTemporaryFile("r", suffix=".stat") as f:
        subprocess.run(["perf", "stat", "-x,", "-o", f.name, "-e", ",".join(events.values()), "--", str(exe), *args],
                       check=True, stdout=subprocess.DEVNULL)
        which = {full: names[ev] for ev, full in events.items()}
        out = {}
        for line in Path(f.name).read_text().splitlines():
            parts = line.split(",")
            if len(parts) > 2 and parts[2] in which:
                out[which[parts[2]]] = int(parts[0])
        return out


def record(db: Path, exe: Path, args: list[str], src: Path | None) -> None:
    env = dict(os.environ)
    if src is not None:
        env["PYTHONPATH"] = str(src)
    subprocess.run([PY, "-m", "cyclescope", "record", "-q", "--db", str(db), "--", str(exe), *args], check=True,
                   stdout=subprocess.DEVNULL, env=env)


def analyze(db: Path, image: str) -> dict[str, dict[str, float | str | None]]:
    """Per anchored procedure (name): its entry, tallies and the estimates of its entry count."""
    from cyclescope.analysis.anchors import near_samples
    from cyclescope.app.calc import calc_target

    profile, ev, hot = hot_procedures(db, image, 100)
    out: dict[str, dict[str, float | str | None]] = {}
    for samples, t in hot:
        a = profile.anchor_stats(t.info.key, t.start)
        if a is None or not a.hits:
            continue
        c = calc_target(profile, t, ev, None)
        first = calc_target(profile, t, ev, None, evidence=False)
        col = c.events.index(ev)
        near = near_samples([ins.address for ins in c.cfg.insns], c.samples[:, col], t.start)
        entry = next(b for b in c.cfg.blocks if b.start == t.start)
        out[t.name] = {"entry": t.start, "samples": samples, "hits": a.hits, "window_samples": a.samples,
                       "near": a.near, "windows": a.windows, "anchor": a.entries(samples, near),
                       "uncorrected": a.hits / a.samples * samples if a.samples else None,
                       "calc": c.executions(entry.id), "calc_method": c.freq.block_method[entry.id],
                       "calc_confidence": c.freq.block_confidence[entry.id],
                       "model": first.executions(entry.id)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--programs", default="xz,zstd,lzip")
    ap.add_argument("--repeat", type=int, default=3, help="the suite's input, this many times over")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--top", type=int, default=4, help="compare the anchors of this many hottest procedures")
    ap.add_argument("--old", metavar="SRC", help="also record with this source tree's cyclescope, alternated")
    ap.add_argument("--keep", metavar="DIR", help="keep the recordings in DIR")
    ap.add_argument("--save-as", default="anchorlong")
    args = ap.parse_args()
    progs, _ = programs(args.programs.split(","))
    big = repeated_input(args.repeat)
    tmp = Path(args.keep or tempfile.mkdtemp(prefix="cs-anchorlong-"))
    tmp.mkdir(parents=True, exist_ok=True)
    contenders = {"new": None} if not args.old else {"new": None, "old": Path(args.old)}
    results: dict[str, dict] = {}
    for p in progs:
        pargs = [a.replace("{input}", str(big)) for a in p.args]
        found: dict[str, dict[str, list[dict]]] = {k: {} for k in contenders}
        for r in range(args.runs):
            order = list(contenders) if r % 2 == 0 else list(reversed(contenders))
            for k in order:
                db = tmp / f"{p.name}-{k}-{r}.db"
                if not db.exists():
                    record(db, p.exe, pargs, contenders[k])
                for name, row in analyze(db, p.image).items():
                    found[k].setdefault(name, []).append(row)
        # The procedures with the most samples (probing every anchored entry of a long run costs
        # minutes: each probe traps at every entry).
        weight: dict[str, float] = {}
        for k in found:
            for name, rows in found[k].items():
                weight[name] = weight.get(name, 0.0) + sum(float(r["samples"]) for r in rows)
        top = sorted(weight, key=lambda n: -weight[n])[: args.top]
        entries = {name: int(rows[0]["entry"]) for k in found for name, rows in found[k].items() if name in top}
        # The exact counts, kept beside the recordings (probing every entry of a run costs minutes).
        cached = tmp / f"exact-{p.name}-x{args.repeat}.json"
        exact = json.loads(cached.read_text()) if cached.exists() else {}
        missing = {n: e for n, e in entries.items() if n not in exact}
        if missing:
            exact.update(exact_entries(p.exe, pargs, missing))
            cached.write_text(json.dumps(exact))
        results[p.name] = {"exact": exact, "runs": found}
        print(f"{p.name} ({' '.join(pargs)}):")
        print(f"  {'procedure':34s} {'exact':>12s} {'who':4s} {'windows':>8s} {'win smp':>8s} {'anchor':>16s} "
              f"{'uncorrected':>16s} {'calc':>16s} {'model':>8s}  calc's method")
        for name in sorted(entries, key=lambda n: -exact.get(n, 0)):
            ex = exact.get(name)
            if not ex:
                continue
            for k in contenders:
                rows = found[k].get(name, [])

                def ratios(key: str, rows: list[dict] = rows, ex: int = ex) -> str:
                    return " ".join(f"{r[key] / ex:.2f}" if r[key] else "-" for r in rows)

                print(f"  {name[:34]:34s} {ex:12,d} {k:4s} {sum(r['windows'] for r in rows):8d} "
                      f"{sum(r['window_samples'] for r in rows):8d} {ratios('anchor'):>16s} "
                      f"{ratios('uncorrected'):>16s} {ratios('calc'):>16s} "
                      f"{statistics.median([r['model'] / ex for r in rows if r['model']] or [float('nan')]):8.2f}  "
                      + ",".join(f"{r['calc_method']}/{r['calc_confidence']}" for r in rows))
    path = save(args.save_as, {"machine": machine(), "args": vars(args), "programs": results})
    print(f"raw data: {path}")


if __name__ == "__main__":
    main()
