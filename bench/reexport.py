"""Paired comparison of a change to the sample profile's export: re-export the `paths` profiles of
kept bench/optimize.py work directories with the code as it is now, rebuild with profile inference
and run the model (cachegrind) once for each profile that changed.

bench/optimize.py leaves its work directory behind (/tmp/cs-bench-opt-XXXX/PROGRAM, with rep1/,
rep2/ for --repeat): the training recordings (db/, paths/), the base build and the profile it
exported (paths.prof). The recordings stay the same, so the comparison is paired: only the export
differs. A profile byte for byte the same as the reference (paths-REF.prof if it exists, else
the bench's own paths.prof) is reported as such and not rebuilt: its CEst is the reference's.

Usage: python bench/reexport.py --tag NAME [--ref NAME] /tmp/cs-bench-opt-XXXX:lua,sqlite ...
Writes paths-NAME.prof and the build paths-NAME-profi next to each recording; prints, per
recording, CEst and the share of instrumented PGO's gain given the base and instrumented CEst of the
bench's raw data (--data bench/out/NAME.json, whose work directory it was).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from common import ROOT, save
from optimize import make_builder, programs, sh, simulate


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tag", required=True, help="name of the new profiles (paths-TAG.prof)")
    ap.add_argument("--ref", default="", help="reference profiles paths-REF.prof (default: the bench's paths.prof)")
    ap.add_argument("--data", action="append", default=[], metavar="JSON",
                    help="bench/optimize.py raw data with the base and instr CEst (repeatable, one per work dir, "
                         "in the order of the work dirs)")
    ap.add_argument("dirs", nargs="+", metavar="WORKDIR:PROG,PROG")
    args = ap.parse_args()
    results: dict[str, dict[str, Any]] = {}
    for k, spec in enumerate(args.dirs):
        work, _, progs = spec.partition(":")
        anchors = json.loads(Path(args.data[k]).read_text())["results"] if k < len(args.data) else {}
        for name in progs.split(","):
            d = Path(work) / name
            if not (d / "base").exists():
                sys.exit(f"reexport: {d}: no base build (not a bench/optimize.py work directory)")
            _, run_argv, _ = programs()[name]
            build = make_builder(name, d, fresh=False)
            sim = anchors.get(name, {}).get("sim", {})
            for where in [d, *sorted(d.glob("rep*"))]:
                if not (where / "paths").exists():
                    continue
                prof = where / f"paths-{args.tag}.prof"
                sh([sys.executable, "-m", "cyclescope", "export", "llvm-sample", "--db", str(where / "db"), "--image",
                    str(d / "base"), "--counts", "calc", "--edges-from", str(where / "paths"), "-o", str(prof)])
                ref = where / f"paths-{args.ref}.prof"
                ref = ref if args.ref and ref.exists() else where / "paths.prof"
                row: dict[str, Any] = {"same_as": None, "CEst": None}
                if ref.exists() and prof.read_bytes() == ref.read_bytes():
                    row["same_as"] = ref.name
                else:
                    exe = build(where / f"paths-{args.tag}-profi",
                                f"-fprofile-sample-use={prof} -mllvm -sample-profile-use-profi")
                    row["CEst"] = simulate([a.replace("{exe}", str(exe)) for a in run_argv])["CEst"]
                share = ""
                if row["CEst"] and "base" in sim and "instr" in sim:
                    b, i = sim["base"]["CEst"], sim["instr"]["CEst"]
                    share = f" ({100 * (b / row['CEst'] - 1) / (b / i - 1):.0f}% of instrumented PGO's gain)"
                results[f"{work}/{name}/{where.name}"] = row
                print(f"{work} {name} {where.name}: " + (f"same as {row['same_as']}" if row["same_as"]
                                                          else f"CEst {row['CEst']:,}{share}"), flush=True)
    print(f"raw data: {save(f'reexport_{args.tag}', {'dirs': args.dirs, 'results': results})}")


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT / "src"))
    main()
