"""What naming a Python stack costs the collector (collect/pyframes.py, PythonFrames.frames).

This process is the target, as in tests/unit/test_pyframes.py: 400 stacks 31 frames deep, made of
real code objects of the standard library and of cyclescope (their addresses, and instruction
pointers at real instructions), the innermost frame different in each. Measured: the first pass
(each code object read from memory once, each frame looked up once) and the passes after it (the
frames the process's cache holds), in microseconds per stack.

Usage: python bench/pyframecost.py [--stacks 400] [--repeats 5]
"""

from __future__ import annotations

import argparse
import dis
import json
import os
import random
import sys
import textwrap
import time
from types import SimpleNamespace


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stacks", type=int, default=400)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    from cyclescope.collect.pyframes import OFFSETS, PythonFrames
    from cyclescope.images.maps import Mapper
    from cyclescope.images.registry import ImageResolver, ImageTable

    version = (sys.version_info.major, sys.version_info.minor)
    if version not in OFFSETS:
        sys.exit(f"pyframecost: CPython {version} is not one cyclescope reads frames of")
    table = ImageTable()
    mapper = Mapper(ImageResolver(table), None, [])  # type: ignore[arg-type]
    mapper.scan_proc([os.getpid()])
    bpf = SimpleNamespace(set_python=lambda pid, cfg: None, forget_python=lambda pid: None)
    pf = PythonFrames(table, mapper, bpf)  # type: ignore[arg-type]
    pf.own = -1  # this process is the target
    pf.watch([os.getpid()])
    o = OFFSETS[version]
    codes = [json.JSONEncoder.iterencode.__code__, json.dumps.__code__, textwrap.dedent.__code__,
             dis.get_instructions.__code__, dis._get_instructions_bytes.__code__, PythonFrames.watch.__code__,
             PythonFrames.frames.__code__, Mapper.map_batch.__code__]

    def instrs(c: object) -> list[int]:
        return [id(c) + o["code_adaptive"] + i.offset for i in dis.get_instructions(c)]  # type: ignore[arg-type]

    rng = random.Random(1)
    outer = [(c, rng.choice(instrs(c))) for c in (codes * 4)[:30]]
    leaf = codes[4]
    stacks = []
    for ip in (instrs(leaf) * (1 + args.stacks // max(1, len(instrs(leaf)))))[: args.stacks]:
        frames = [(id(leaf), ip)] + [(id(c), x) for c, x in outer]
        stacks.append(tuple(v for f in frames for v in f))
    pid = os.getpid()
    t0 = time.perf_counter()
    for s in stacks:
        pf.frames(pid, s)
    first = (time.perf_counter() - t0) / len(stacks) * 1e6
    t0 = time.perf_counter()
    for _ in range(args.repeats):
        for s in stacks:
            pf.frames(pid, s)
    after = (time.perf_counter() - t0) / (len(stacks) * args.repeats) * 1e6
    print(f"{len(stacks)} stacks of 31 Python frames: first pass {first:.1f} us a stack, then {after:.1f} us")


if __name__ == "__main__":
    main()
