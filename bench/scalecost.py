"""What scale windows cost the profiled program: its own CPU time under `record` (default
settings) with this tree, with another tree (``--base DIR``: a checkout's ``src``, run through
PYTHONPATH), and with `--no-trip-windows`, alternated round by round, on a program whose hot
procedure's entry is too short for its anchor (lzip on the suite's input repeated, bench/suite.py).

The program's CPU (user + system, traps included) is read by `/usr/bin/time` around it inside
the recording, so the recorder's own CPU is left out. Reported: median [quartiles] per contender,
and each contender's extra CPU over `--no-trip-windows` in the same round.

Usage: python bench/scalecost.py --base /tmp/basetree [--rounds 3] [--repeat 16] [--save-as scalecost]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from common import cyclescope_cmd, machine, save
from suite import programs, repeated_input


def quartiles(xs: list[float]) -> str:
    if len(xs) < 2:
        return f"{xs[0]:.3f}" if xs else "-"
    q = statistics.quantiles(xs, n=4)
    return f"{statistics.median(xs):.3f} [{q[0]:.3f}, {q[2]:.3f}]"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", metavar="DIR", help="another checkout to compare (its src/ on PYTHONPATH)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeat", type=int, default=16, help="the suite's input this many times over")
    ap.add_argument("--rate", type=int, default=5000)
    ap.add_argument("--save-as", default="scalecost")
    args = ap.parse_args()
    (prog,), _ = programs(["lzip"])
    inp = repeated_input(args.repeat)
    pargs = [a.replace("{input}", str(inp)) for a in prog.args]
    contenders: dict[str, tuple[list[str], dict[str, str] | None]] = {}
    with tempfile.TemporaryDirectory(prefix="cs-scalecost-db-") as dbs:
        def rec(name: str, extra: list[str]) -> list[str]:
            # The program's arguments go after the executable, which /usr/bin/time wraps (one()).
            return [*cyclescope_cmd("record", "--db", f"{dbs}/{name}", "-q", "-F", str(args.rate), *extra, "--"),
                    str(prog.exe)]

        contenders["head"] = (rec("head", []), None)
        if args.base:
            env = {**os.environ, "PYTHONPATH": str(Path(args.base) / "src")}
            contenders["base"] = (rec("base", []), env)
        contenders["notrips"] = (rec("notrips", ["--no-trip-windows"]), None)
        got: dict[str, list[float]] = {k: [] for k in contenders}
        for r in range(args.rounds):
            order = list(contenders)[r % len(contenders):] + list(contenders)[: r % len(contenders)]
            for name in order:
                cmd, env = contenders[name]
                cpu = _run(cmd, pargs, env)
                got[name].append(cpu)
                print(f"round {r + 1} {name}: {cpu:.3f} s", flush=True)
    result: dict[str, Any] = {"machine": machine(), "args": vars(args), "cpu_s": got}
    print(f"lzip x{args.repeat} under record at {args.rate} Hz, the program's CPU (s), median [quartiles] of "
          f"{args.rounds}:")
    for name, xs in got.items():
        extra = [x - n for x, n in zip(xs, got["notrips"], strict=True)]
        print(f"  {name:8s} {quartiles(xs)}  extra over --no-trip-windows {quartiles(extra)}")
    save(args.save_as, result)


def _run(cmd: list[str], pargs: list[str], env: dict[str, str] | None) -> float:
    """The program's CPU seconds (user + system) under ``cmd`` (a recording ending in the program)."""
    with tempfile.TemporaryDirectory(prefix="cs-scalecost-") as tmp:
        out = Path(tmp) / "time"
        full = [*cmd[:-1], "/usr/bin/time", "-f", "%U %S", "-o", str(out), cmd[-1], *pargs]
        r = subprocess.run(full, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        if r.returncode != 0:
            raise SystemExit(f"scalecost: {' '.join(full)} failed: {r.stderr[-600:]}")
        user, system = (float(x) for x in out.read_text().split()[-2:])
        return user + system


if __name__ == "__main__":
    main()
