"""Does a trap cost a procedure the same wherever it is probed? The question behind correcting an
anchor's entry count for its traps' disturbance by extrapolating to no trap.

An anchor counts a procedure's entries exactly in windows, and the procedure's samples in the
same windows give its time per entry; each trap adds time of its own (the kernel's handling, and
caches and predictors disturbed after it), so short entries come out counted low (0.6-0.9 of
exact: docs/benchmarks.md). If the time per entry grows linearly in the traps per entry,
t(h) = t0 + h * delta, whatever instruction each trap is at, two kinds of window (one trap per
entry, and many: a trip window's entry, loop headers and hot blocks) give t0 and with it an
unbiased count. This measures whether the program's CPU time is linear in the hits: the
procedure probed for a whole run at its entry only and at its entry plus its 1, 3 and 7 hottest
blocks (each at the first instruction of its block the kernel emulates, as trip windows do),
alternated over --rounds, against the run without probes.

    python bench/trapline.py --program zstd --procedure ZSTD_DUBT_findBestMatch [--rounds 3]

Prints, per configuration, the hits, the CPU time over the unprobed run and that per hit, and
the slope and intercept of CPU time against hits over all runs.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import numpy as np
from common import machine, median, save


def sites(exe: Path, procedure: str, hot: int, samples_db: Path | None) -> tuple[int, list[int], list[bool]]:
    """The procedure's entry and its blocks' probe sites (file offsets), hottest first by a quick
    recording's samples, and whether each site is emulated."""
    from cyclescope.analysis.loopcount import analyze_procedure
    from cyclescope.binaries.code import open_binary
    from cyclescope.binaries.symbolize import Symbolizer
    from cyclescope.images.elf import read_load_info
    from cyclescope.images.registry import ImageInfo

    li = read_load_info(str(exe))
    info = ImageInfo(li.build_id or str(exe), str(exe), "elf", li.build_id)
    b: Any = open_binary(info, Symbolizer(None))
    start = next(s for s, n in zip(b.table.starts, b.table.names, strict=True) if n == procedure)
    table, _ = analyze_procedure(b, int(start))
    blocks = table.blocks.tolist()
    weights = np.zeros(len(blocks))
    if samples_db is not None:  # the blocks' samples in a plain recording, from calc's listing
        import json
        import subprocess

        from common import cyclescope_cmd

        doc = json.loads(subprocess.run(cyclescope_cmd("calc", procedure, "--db", str(samples_db), "--json"),
                                        capture_output=True, text=True, check=True).stdout)
        by_start = {int(b["start"], 16) if isinstance(b["start"], str) else int(b["start"]): float(b["samples"])
                    for b in doc["blocks"]}
        weights = np.array([by_start.get(a, 0.0) for a in blocks])
    order = [i for i in np.argsort(-weights, kind="stable").tolist() if blocks[i] != start][:hot]
    off = lambda a: int(li.file_offset(a))  # noqa: E731
    site = dict(zip(blocks, table.sites.tolist(), strict=True))
    emu = dict(zip(blocks, table.site_emulated.tolist(), strict=True))
    pts = [int(start)] + [blocks[i] for i in order]
    return int(start), [off(site.get(p, p)) for p in pts], [bool(emu.get(p, False)) for p in pts]


def run_probed(exe: Path, args: list[str], path: str, offsets: list[int]) -> tuple[float, float, np.ndarray]:
    """User and system CPU seconds of one run with ``offsets`` counted throughout, and the hits."""
    from cyclescope.collect.pointcount import PointCounter

    counter = PointCounter() if offsets else None
    link = None
    try:
        if counter is not None:
            counter.zero(len(offsets), 0)
            link = counter.attach(path, offsets, 0)
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child
            fd = os.open(os.devnull, os.O_WRONLY)
            os.dup2(fd, 1)
            os.execv(str(exe), [str(exe), *args])
        _, status, ru = os.wait4(pid, 0)
        if status != 0:
            raise SystemExit(f"{exe} exited with {status}")
        hits = counter.counts(len(offsets)) if counter is not None else np.zeros(0, np.uint64)
        return ru.ru_utime, ru.ru_stime, hits
    finally:
        if counter is not None:
            if link is not None:
                counter.detach(link)
            counter.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--program", default="zstd")
    ap.add_argument("--procedure", default="ZSTD_DUBT_findBestMatch")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--hot", default="0,1,3,7", help="blocks probed beside the entry, per configuration")
    ap.add_argument("--save-as", default="trapline")
    args = ap.parse_args()
    import suite
    from common import cyclescope_cmd, run

    progs, inp = suite.programs([args.program])
    p = progs[0]
    pargs = [a.replace("{input}", str(inp)) for a in p.args]
    db = Path(f"/tmp/cs-trapline-{os.getpid()}.db")
    run(cyclescope_cmd("record", "--db", str(db), "-q", "--no-loop-counts", "--", str(p.exe), *pargs))
    hots = [int(x) for x in args.hot.split(",")]
    entry, offsets, emulated = sites(p.exe, args.procedure, max(hots), db)
    print(f"{args.procedure} at {entry:#x}: sites {[hex(o) for o in offsets]}, emulated {emulated}")
    configs = [("none", [])] + [(f"entry+{h}", offsets[: 1 + h]) for h in hots]
    rows: list[dict[str, Any]] = []
    for rnd in range(args.rounds):
        k = rnd % len(configs)
        for name, offs in configs[k:] + configs[:k]:
            t0 = time.monotonic()
            user, sys_s, hits = run_probed(p.exe, pargs, str(p.exe), offs)
            cpu = user + sys_s
            rows.append({"round": rnd, "config": name, "cpu_s": cpu, "user_s": user, "sys_s": sys_s,
                         "hits": hits.tolist(),
                         "entries": int(hits[0]) if len(hits) else 0, "wall_s": time.monotonic() - t0})
            total = int(hits.sum()) if len(hits) else 0
            print(f"round {rnd} {name:>9s}: cpu {cpu:.3f} s (user {user:.3f}), hits {total:,}"
                  f" (entries {int(hits[0]) if len(hits) else 0:,})", flush=True)
    base = {r["round"]: r["cpu_s"] for r in rows if r["config"] == "none"}
    ubase = {r["round"]: r["user_s"] for r in rows if r["config"] == "none"}
    print("\nconfig      hits (median)   extra CPU (s)   per hit (us)   extra user (s)   user per hit (us)")
    summary = {}
    for name, _ in configs[1:]:
        rs = [r for r in rows if r["config"] == name]
        extra = [r["cpu_s"] - base[r["round"]] for r in rs]
        uextra = [r["user_s"] - ubase[r["round"]] for r in rs]
        h = [sum(r["hits"]) for r in rs]
        per = [e / x * 1e6 for e, x in zip(extra, h, strict=True) if x]
        uper = [e / x * 1e6 for e, x in zip(uextra, h, strict=True) if x]
        summary[name] = {"hits": median(h), "extra_s": median(extra), "per_hit_us": median(per),
                         "extra_user_s": median(uextra), "user_per_hit_us": median(uper)}
        print(f"{name:>9s}  {median(h):>14,.0f}   {median(extra):>12.3f}   {median(per):>11.3f}"
              f"   {median(uextra):>14.3f}   {median(uper):>16.3f}")
    x = np.array([sum(r["hits"]) for r in rows], float)
    y = np.array([r["cpu_s"] - base[r["round"]] for r in rows])
    slope, icpt = np.polyfit(x, y, 1)
    fit = slope * x + icpt
    print(f"\nextra CPU against hits over all runs: {slope * 1e6:.3f} us a hit, intercept {icpt:.3f} s, "
          f"largest residual {np.abs(y - fit).max():.3f} s")
    save(args.save_as, {"machine": machine(), "args": vars(args), "rows": rows, "summary": summary,
                        "fit": {"us_per_hit": slope * 1e6, "intercept_s": icpt}})


if __name__ == "__main__":
    main()
