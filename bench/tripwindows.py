"""Trip windows' counts (analysis/trips.py, collect/pointcount.py) against exact ones.

    python bench/tripwindows.py exact   [--program zstd] [--bytes 300000]
    python bench/tripwindows.py windows [--program xz] [--runs 4] [--window 0.002] [--gap 0.05]

``exact``: one uprobe_multi link over the points trip windows would count in the suite program's
hottest procedures (its entry, loop headers and sampled blocks, as a recording chose them: read
from a database's trips tallies, ``--db``, else recorded here), counting a whole run on the first
``--bytes`` of the suite's input, against callgrind's counts of the same run.

``windows``: the program on the suite's whole input, its hottest procedure's entry and first loop
header counted in windows of ``--window`` seconds opened at random steps (``--gap`` on average)
over ``--runs`` runs, in each of ``--modes`` alternated: gated (counting only while every probe of
the link is in), whole (gated, the header counted from the window's first entry on and the window
ended at an entry, its entries but one the runs: what trip windows do where a window holds a few
entries, collect/pointcount.program) and ungated (counting from the link's creation to its close);
the trips per entry each gives against callgrind's over the same input (``--callgrind FILE``
reuses a callgrind output of it).

    python bench/tripwindows.py windows --program xz --runs 4 --callgrind DIR/cg-xz.out

``pacing``: windows over a procedure's entry and blocks (``--points``, vaddrs, the entry first), on
the suite's input ``--repeat`` times over, opened at random steps and alternated within each run:
at once (the link in, then counting) or paced (the entry alone probed by a link of its own for
``--pace-entries`` entries first; tried in the recorder and not kept: docs/benchmarks.md); each
block's runs per entry pooled over each kind's windows against callgrind's (``--callgrind FILE``
reuses a callgrind output of the same input, say bench/accuracy.py's kept one), with 90% bootstrap
intervals over windows.

    python bench/tripwindows.py pacing --program lzip --repeat 16 --runs 3 \
        --points 0x9780,0x9920,0x9965,0x99c3,0x9834,0x9b1d --callgrind DIR/cg-lzip.out

The suite comes from bench/suite.py (bench/out/suite).
"""

from __future__ import annotations

import argparse
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from common import cyclescope_cmd, machine, save
from suite import programs, repeated_input


def callgrind(exe: Path, args: list[str], out: Path) -> dict[int, int]:
    from cyclescope.analysis.callgrind import parse_callgrind

    subprocess.run(["valgrind", "--tool=callgrind", "--dump-instr=yes", f"--callgrind-out-file={out}", str(exe),
                    *args], capture_output=True, check=True)
    prof = parse_callgrind(out.read_text())
    ob = prof.object_for(str(exe)) or prof.object_for(str(exe.resolve()))
    if ob is None:
        raise SystemExit(f"{exe} not in callgrind's profile")
    return prof.counts[ob]


def chosen_points(db: Path) -> dict[int, list[int]]:
    """Entry -> the points a recording's trip windows counted (its trips tallies)."""
    from cyclescope.db.layout import Database
    from cyclescope.db.tallies import TRIPS, load_tally

    d = Database.open(db)
    t = load_tally(d, TRIPS, d.epochs()).table.to_pydict()
    out: dict[int, list[int]] = {}
    for e, p in zip(t["entry"], t["point"], strict=True):
        out.setdefault(int(e), [])
        if int(p) not in out[int(e)]:
            out[int(e)].append(int(p))
    return out


def exact(args: argparse.Namespace, exe: Path, pargs: list[str], inp: Path, tmp: Path) -> dict[str, Any]:
    from cyclescope.collect.pointcount import PointCounter
    from cyclescope.images.elf import read_load_info

    db = Path(args.db) if args.db else tmp / "db"
    if not args.db:
        subprocess.run(cyclescope_cmd("record", "--db", str(db), "-q", "-F", "5000", "--", str(exe), *pargs),
                       check=True, stdout=subprocess.DEVNULL)
    pts = chosen_points(db)
    if not pts:
        raise SystemExit("the recording's trip windows counted nothing")
    small = tmp / "small.txt"
    small.write_bytes(inp.read_bytes()[: args.bytes])
    sargs = [a if a != str(inp) else str(small) for a in pargs]
    truth = callgrind(exe, sargs, tmp / "cg.out")
    info = read_load_info(str(exe))
    rows = []
    for entry, ps in pts.items():
        pc = PointCounter()
        try:
            pc.zero(len(ps))
            link = pc.attach(str(exe), [info.file_offset(p) or 0 for p in ps], 0)
            try:
                subprocess.run([str(exe), *sargs], capture_output=True, check=True)
            finally:
                os.close(link)
            got = pc.counts(len(ps)).tolist()
        finally:
            pc.close()
        for p, g in zip(ps, got, strict=True):
            rows.append({"entry": entry, "point": p, "counted": g, "exact": truth.get(p, 0)})
            print(f"{entry:#x} {p:#x}: counted {g:,}, callgrind {truth.get(p, 0):,}"
                  + ("" if g == truth.get(p, 0) else "  DIFFERENT"), flush=True)
    same = sum(r["counted"] == r["exact"] for r in rows)
    print(f"{same} of {len(rows)} points counted exactly as callgrind did")
    return {"rows": rows, "same": same}


def exact_counts(args: argparse.Namespace, exe: Path, pargs: list[str], tmp: Path) -> dict[int, int]:
    """callgrind's counts of ``exe pargs``: from ``--callgrind`` (a kept output of the same program
    and input) where given, else from a run of it here."""
    if not args.callgrind:
        return callgrind(exe, pargs, tmp / "cg.out")
    from cyclescope.analysis.callgrind import parse_callgrind

    prof = parse_callgrind(Path(args.callgrind).read_text())
    ob = prof.object_for(str(exe)) or prof.object_for(str(exe.resolve()))
    if ob is None:
        raise SystemExit(f"{exe} not in {args.callgrind}")
    return prof.counts[ob]


def windows(args: argparse.Namespace, exe: Path, pargs: list[str], tmp: Path) -> dict[str, Any]:
    from cyclescope.analysis.loopcount import loop_table
    from cyclescope.collect.pointcount import GATE, PointCounter
    from cyclescope.images.disasm import read_code
    from cyclescope.images.elf import read_load_info

    truth = exact_counts(args, exe, pargs, tmp)
    # The hottest procedure with a loop: the one whose loop header runs most, by callgrind.
    from elftools.elf.elffile import ELFFile

    with open(exe, "rb") as f:
        syms = [(s["st_value"], s["st_value"] + s["st_size"], s.name)
                for s in ELFFile(f).get_section_by_name(".symtab").iter_symbols()
                if s["st_info"]["type"] == "STT_FUNC" and s["st_size"] > 0]
    best: tuple[int, int, int, str] | None = None
    for start, end, name in syms:
        if truth.get(start, 0) == 0:
            continue
        t = loop_table(read_code(str(exe), start, end), start, end)
        for h in t.headers.tolist():
            if best is None or truth.get(h, 0) > best[0]:
                best = (truth.get(h, 0), start, h, name)
    if best is None:
        raise SystemExit("no loop ran")
    _, entry, header, name = best
    want = truth[header] / truth[entry]
    print(f"{name}: entry {entry:#x} ({truth[entry]:,} runs), header {header:#x} ({truth[header]:,}): "
          f"{want:.2f} trips per entry by callgrind", flush=True)
    info = read_load_info(str(exe))
    offs = [info.file_offset(entry) or 0, info.file_offset(header) or 0]
    pc = PointCounter()
    modes = args.modes.split(",")
    out: dict[str, Any] = {"procedure": name, "exact": want, **{m: [] for m in modes}}
    try:
        for r in range(args.runs):
            for how in (modes if r % 2 == 0 else modes[::-1]):
                tot = [0, 0]
                n = 0
                p = subprocess.Popen([str(exe), *pargs], stdout=subprocess.DEVNULL)
                time.sleep(random.uniform(0, args.gap))
                while p.poll() is None:
                    pc.zero(2, 0 if how == "ungated" else GATE, whole=how == "whole")
                    link = pc.attach(str(exe), offs, p.pid)
                    if how != "ungated":
                        pc.set_skip(0)
                    time.sleep(args.window)
                    ended = False
                    if how == "whole" and pc.counts(1)[0]:
                        pc.end_at_entry()
                        t0 = time.monotonic()
                        while pc.skip_left() <= 0 and time.monotonic() - t0 < 0.02:
                            pass
                        ended = pc.skip_left() > 0
                    if how != "ungated" and not ended:
                        pc.set_skip(GATE)
                    os.close(link)
                    c = pc.counts(2).tolist()
                    if ended:
                        c[0] -= 1  # its entries but one are whole runs
                    tot = [a + b for a, b in zip(tot, c, strict=True)]
                    n += 1
                    time.sleep(random.uniform(0, 2 * args.gap))
                ratio = tot[1] / tot[0] if tot[0] else float("nan")
                out[how].append({"entries": tot[0], "headers": tot[1], "windows": n, "ratio": ratio})
                print(f"run {r} {how:8s}: {n} windows, {tot[0]:,} entries, {tot[1]:,} header runs: "
                      f"{ratio:.2f} trips per entry ({ratio / want:.2f} of exact)", flush=True)
    finally:
        pc.close()
    for how in modes:
        e = sum(r["entries"] for r in out[how])
        h = sum(r["headers"] for r in out[how])
        out[f"{how}_pooled"] = h / e if e else float("nan")
        print(f"{how}: {h:,} header runs per {e:,} entries over {len(out[how])} runs: "
              f"{out[f'{how}_pooled']:.2f} trips per entry ({out[f'{how}_pooled'] / want:.2f} of exact)")
    return out


def pacing(args: argparse.Namespace, exe: Path, pargs: list[str], tmp: Path) -> dict[str, Any]:
    import numpy as np

    from cyclescope.collect.pointcount import GATE, PointCounter
    from cyclescope.images.elf import read_load_info

    if not args.points:
        raise SystemExit("pacing needs --points ENTRY,BLOCK,... (vaddrs, the procedure's entry first)")
    pts = [int(x, 0) for x in args.points.split(",")]
    truth = exact_counts(args, exe, pargs, tmp)
    if not truth.get(pts[0]):
        raise SystemExit(f"{pts[0]:#x} never ran under callgrind: not the procedure's entry?")
    want = np.array([truth.get(x, 0) / truth[pts[0]] for x in pts])
    info = read_load_info(str(exe))
    offs = [info.file_offset(x) or 0 for x in pts]
    pa, pb = PointCounter(), PointCounter()
    rows: list[dict[str, Any]] = []
    k = 0
    try:
        for _ in range(args.runs):
            p = subprocess.Popen([str(exe), *pargs], stdout=subprocess.DEVNULL)
            time.sleep(random.uniform(0, args.gap))
            while p.poll() is None:
                paced, k = k % 2 == 1, k + 1
                la = None
                try:
                    if paced:
                        pa.zero(1)
                        la = pa.attach(str(exe), offs[:1], p.pid)
                        start = time.monotonic()
                        while int(pa.counts(1)[0]) < args.pace_entries and time.monotonic() - start < 0.005:
                            time.sleep(0.0002)
                    pb.zero(len(pts), GATE)
                    lb = pb.attach(str(exe), offs, p.pid)
                    pb.set_skip(0)
                    time.sleep(args.window)
                    pb.set_skip(GATE)
                    os.close(lb)
                    if la is not None:
                        os.close(la)
                except OSError:  # the program ended meanwhile
                    break
                rows.append({"paced": paced, "counts": pb.counts(len(pts)).tolist(),
                             "paced_entries": int(pa.counts(1)[0]) if paced else 0})
                time.sleep(random.uniform(0, 2 * args.gap))
    finally:
        pa.close()
        pb.close()
    rng = np.random.default_rng(0)
    out: dict[str, Any] = {"points": pts, "exact_per_entry": want.tolist(), "windows": rows}
    for paced in (False, True):
        c = np.array([r["counts"] for r in rows if r["paced"] == paced], float)
        if not len(c) or not c[:, 0].sum():
            continue
        est = c.sum(0) / c[:, 0].sum() / np.where(want > 0, want, np.nan)
        boot = [(lambda b: b.sum(0) / max(b[:, 0].sum(), 1.0))(c[rng.integers(0, len(c), len(c))]) / want
                for _ in range(400)]
        lo, hi = np.nanpercentile(boot, [5, 95], axis=0)
        name = "paced" if paced else "at once"
        out[name] = {"windows": len(c), "of_exact": est.tolist(), "lo": lo.tolist(), "hi": hi.tolist()}
        print(f"{name}: {len(c)} windows, {c[:, 0].mean():.1f} entries a window")
        for x, w, e, a, b in zip(pts[1:], want[1:], est[1:], lo[1:], hi[1:], strict=True):
            print(f"   {x:#x} ({w:.3f} runs an entry by callgrind): {e:.3f} [{a:.3f}, {b:.3f}] of exact", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", choices=("exact", "windows", "pacing"))
    ap.add_argument("--program", default=None, help="a suite program (exact: zstd, windows: xz)")
    ap.add_argument("--db", help="exact: the points from this database's trips tallies")
    ap.add_argument("--bytes", type=int, default=300_000)
    ap.add_argument("--runs", type=int, default=4)
    ap.add_argument("--window", type=float, default=0.002)
    ap.add_argument("--gap", type=float, default=0.05)
    ap.add_argument("--points", help="pacing: the entry's and the blocks' vaddrs, comma-separated")
    ap.add_argument("--repeat", type=int, default=1, help="pacing: the suite's input this many times over")
    ap.add_argument("--callgrind", help="windows, pacing: a callgrind output of the same program and input to reuse")
    ap.add_argument("--modes", default="gated,whole", help="windows: of gated, whole, ungated")
    ap.add_argument("--pace-entries", type=int, default=1000)
    ap.add_argument("--save-as", default=None)
    args = ap.parse_args()
    name = args.program or ("zstd" if args.mode == "exact" else "xz")
    progs, inp = programs([name])
    if args.mode == "pacing":
        inp = repeated_input(args.repeat)
    p = progs[0]
    pargs = [a.replace("{input}", str(inp)) for a in p.args]
    with tempfile.TemporaryDirectory(prefix="cs-tw-") as d:
        tmp = Path(d)
        res = (exact(args, p.exe, pargs, inp, tmp) if args.mode == "exact" else
               pacing(args, p.exe, pargs, tmp) if args.mode == "pacing" else windows(args, p.exe, pargs, tmp))
    path = save(args.save_as or f"tripwindows_{args.mode}", {"machine": machine(), "args": vars(args), **res})
    print(f"raw data: {path}")


if __name__ == "__main__":
    main()
