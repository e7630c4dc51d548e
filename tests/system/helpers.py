"""Running the real `cyclescope` command in a subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

SRC = str(Path(__file__).resolve().parents[2] / "src")


def env() -> dict[str, str]:
    e = dict(os.environ)
    e["PYTHONPATH"] = SRC + os.pathsep + e.get("PYTHONPATH", "")
    e.pop("CYCLESCOPE_DB", None)
    return e


def cs(*args: str, check: bool = True, timeout: float = 120, **kw: Any) -> subprocess.CompletedProcess[str]:
    p = subprocess.run([sys.executable, "-m", "cyclescope", *args], capture_output=True, text=True, env=env(),
                       timeout=timeout, **kw)
    if check and p.returncode != 0:
        raise AssertionError(f"cyclescope {' '.join(args)} exited {p.returncode}:\n{p.stderr}\n{p.stdout}")
    return p


def cs_popen(*args: str, **kw: Any) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "cyclescope", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env(), **kw)


def prof_json(db: Path, *args: str) -> dict[str, Any]:
    out = cs("prof", "--db", str(db), "--json", *args).stdout
    result: dict[str, Any] = json.loads(out)
    return result


def samples_of(report: dict[str, Any], procedure: str, event: str = "cpu-clock") -> int:
    return sum(r["samples"].get(event, 0) for r in report["rows"] if r["procedure"] == procedure)


def folded(text: str) -> Counter[str]:
    """Collapsed stacks (`export collapsed`) as counts per stack."""
    out: Counter[str] = Counter()
    for line in text.splitlines():
        stack, n = line.rsplit(" ", 1)
        out[stack] += int(n)
    return out
