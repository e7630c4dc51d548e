"""`cyclescope demo`: build the bundled workload, profile it, show where its cycles went."""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from importlib import resources
from pathlib import Path

from cyclescope.cli.base import Command, eprint, finite_float, register
from cyclescope.errors import CycleScopeError

DEMO_DB = "cyclescope-demo.db"


def build_demo(outdir: Path) -> Path:
    cc = shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        raise CycleScopeError("the demo needs a C compiler (apt-get install gcc)")
    src = resources.files("cyclescope") / "demo" / "workload.c"
    exe = outdir / "cyclescope-demo"
    tmp = outdir / f".cyclescope-demo.{os.getpid()}"
    with resources.as_file(src) as path:
        r = subprocess.run([cc, "-O2", "-g", "-o", str(tmp), str(path)], capture_output=True, text=True)
    if r.returncode == 0:
        os.replace(tmp, exe)  # never leave a half-written binary under the real name
    if r.returncode != 0:
        raise CycleScopeError(f"building the demo failed: {r.stderr.strip().splitlines()[-1] if r.stderr else r}")
    return exe


@register
class Demo(Command):
    name = "demo"

    def add_arguments(self, p: argparse.ArgumentParser) -> None:
        p.add_argument("--db", metavar="PATH", default=DEMO_DB, help=f"database to record into (default: ./{DEMO_DB})")
        p.add_argument("-F", "--freq", type=finite_float, default=5000.0, metavar="HZ",
                       help="samples per second (default: 5000)")
        p.add_argument("--scale", type=finite_float, default=1.0, help="work to do (1.0 runs about 2.5 s)")

    def run(self, args: argparse.Namespace) -> int:
        from cyclescope.cli.main import main as cli_main

        if os.geteuid() != 0 and _paranoid() > 1:
            eprint("cyclescope demo: note: not root and perf_event_paranoid > 1: only user-space samples")
        cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "cyclescope"
        cache.mkdir(parents=True, exist_ok=True)
        exe = build_demo(cache)
        eprint(f"cyclescope demo: built {exe} (gcc -O2 -g); recording it at {args.freq:g} Hz")
        rc = cli_main(["record", "--db", args.db, "-F", str(args.freq), "--", str(exe), str(args.scale)])
        if rc != 0:
            return rc
        sys.stdout.flush()
        return cli_main(["prof", "--db", args.db, "--limit", "12"])


def _paranoid() -> int:
    try:
        with open("/proc/sys/kernel/perf_event_paranoid") as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return 2
