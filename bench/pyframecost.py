"""What naming a drain's Python stacks costs the collector (collect/pyframes.py).

This process is the target, as in tests/unit/test_pyframes.py: --stacks stacks 31 frames deep, made
of real code objects of the standard library and of cyclescope (their addresses and tags, and
instruction pointers at real instructions), the innermost frame different in each, each with a
native stack of 12 frames, one of them in the evaluation loop. They go through the collector's
entry point as the daemon calls it: PythonFrames.stacks with the whole drain where the tree has it,
else PythonFrames.stack once per stack. Measured: the first pass (each code object read from memory
once, each frame looked up once) and the passes after it (the frames the process's cache holds),
in microseconds per stack. Every stack must come back with its 31 Python frames.

With --base REV the tree committed at REV runs the same measurement in its own process, the two
alternated in each round.

Usage: python bench/pyframecost.py [--stacks 400] [--repeats 5] [--rounds 5] [--base REV] [--save-as NAME]
"""

from __future__ import annotations

import argparse
import dis
import json
import os
import random
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from types import SimpleNamespace

from common import contender_trees, fmt_spread, machine, save


def worker(n_stacks: int, repeats: int) -> dict[str, float]:
    import numpy as np

    from cyclescope.collect import pyframes
    from cyclescope.collect.ebpf import PY_CKEY_DTYPE, PY_CODE_DTYPE
    from cyclescope.collect.procmem import ProcessMemory
    from cyclescope.collect.pyframes import OFFSETS, PY_ENTRY, PythonFrames
    from cyclescope.images.maps import Mapper
    from cyclescope.images.registry import ImageResolver, ImageTable

    version = (sys.version_info.major, sys.version_info.minor)
    if version not in OFFSETS:
        sys.exit(f"pyframecost: CPython {version} is not one cyclescope reads frames of")
    table = ImageTable()
    mapper = Mapper(ImageResolver(table), None, [])  # type: ignore[arg-type]
    mapper.scan_proc([os.getpid()])
    bpf = SimpleNamespace(set_python=lambda pid, cfg: None, forget_python=lambda pid: None,
                          take_codes=lambda: (np.zeros(0, PY_CKEY_DTYPE), np.zeros(0, PY_CODE_DTYPE)))
    pf = PythonFrames(table, mapper, bpf)  # type: ignore[arg-type]
    pf.own = -1  # this process is the target
    pf.watch([os.getpid()])
    pid = os.getpid()
    p = pf.procs[pid]
    o = OFFSETS[version]
    mem = ProcessMemory(pid)

    def tagged(c: object) -> int:
        head = mem.read(id(c), o["code_adaptive"])
        assert head is not None
        return id(c) | pyframes.code_tag(head, o["code_firstlineno"]) if hasattr(pyframes, "code_tag") else id(c)

    codes = [json.JSONEncoder.iterencode.__code__, json.dumps.__code__, textwrap.dedent.__code__,
             dis.get_instructions.__code__, dis._get_instructions_bytes.__code__, PythonFrames.watch.__code__,
             PythonFrames.frames.__code__, Mapper.map_batch.__code__]

    def instrs(c: object) -> list[int]:
        return [id(c) + o["code_adaptive"] + i.offset for i in dis.get_instructions(c)]  # type: ignore[arg-type]

    rng = random.Random(1)
    outer = [(tagged(c), rng.choice(instrs(c))) for c in (codes * 4)[:30]]
    outer[-1] = (outer[-1][0] | PY_ENTRY, outer[-1][1])  # the run's outermost frame
    leaf = codes[4]
    lo, _ = p.eval_range
    native = tuple([(0, 0x1000 + 16 * k) for k in range(5)] + [(p.eval_image, lo + 5)]
                   + [(0, 0x2000 + 16 * k) for k in range(6)])
    pys = []
    for ip in (instrs(leaf) * (1 + n_stacks // max(1, len(instrs(leaf)))))[:n_stacks]:
        frames = [(tagged(leaf), ip), *outer]
        pys.append(tuple(v for f in frames for v in f))
    pids, natives = [pid] * len(pys), [native] * len(pys)

    def name_all() -> list:
        if hasattr(pf, "stacks"):
            return pf.stacks(pids, natives, pys)
        return [pf.stack(pid, native, py) for py in pys]

    t0 = time.perf_counter()
    out = name_all()
    first = (time.perf_counter() - t0) / len(pys) * 1e6
    assert all(len(s) == len(native) + 31 for s in out), "a stack lost Python frames"
    t0 = time.perf_counter()
    for _ in range(repeats):
        name_all()
    after = (time.perf_counter() - t0) / (len(pys) * repeats) * 1e6
    return {"first_us": first, "cached_us": after}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stacks", type=int, default=400)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--base", help="also measure the tree committed at this revision, alternated")
    ap.add_argument("--save-as", default="pyframecost")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(args.stacks, args.repeats)))
        return
    with tempfile.TemporaryDirectory() as tmp:
        trees = contender_trees(args.base, Path(tmp))
        runs: dict[str, list[dict[str, float]]] = {k: [] for k in trees}
        for r in range(args.rounds):
            for name, src in trees.items():
                env = dict(os.environ, PYTHONPATH=str(src))
                out = subprocess.run([sys.executable, __file__, "--worker", "--stacks", str(args.stacks),
                                      "--repeats", str(args.repeats)], env=env, capture_output=True, text=True)
                if out.returncode:
                    sys.exit(f"pyframecost: {name}: {out.stderr.strip().splitlines()[-1]}")
                runs[name].append(json.loads(out.stdout))
                print(f"round {r + 1} {name}: {runs[name][-1]}", file=sys.stderr)
    print(f"{args.stacks} stacks of 31 Python frames and 12 native ones, us a stack, median [min, max] of "
          f"{args.rounds}:")
    for name, rs in runs.items():
        print(f"  {name:>10}: first pass {fmt_spread([x['first_us'] for x in rs], digits=1)}, "
              f"cached {fmt_spread([x['cached_us'] for x in rs], digits=1)}")
    if args.base:
        for key in ("first_us", "cached_us"):
            ratios = [h[key] / b[key] for h, b in zip(runs["head"], runs[args.base], strict=True)]
            print(f"  head / {args.base}, {key.removesuffix('_us')}: {fmt_spread(ratios, digits=2)}")
    print(f"saved {save(args.save_as, {'machine': machine(), 'args': vars(args), 'runs': runs})}")


if __name__ == "__main__":
    main()
