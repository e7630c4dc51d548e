"""Helpers shared by the benchmark scripts: building, running with rusage, statistics."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "bench" / "out"
PY = sys.executable


def build(src: str, out: Path, *flags: str) -> Path:
    out.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run(["gcc", *(flags or ("-O2", "-g")), "-o", str(out), str(ROOT / "bench" / src)], check=True)
    return out


@dataclass
class Run:
    wall_s: float
    cpu_s: float  # user+sys of the process tree (the command and its waited-for descendants)
    user_s: float
    sys_s: float
    maxrss_kib: int
    stdout: str
    stderr: str
    returncode: int


def run(cmd: list[str], env: dict[str, str] | None = None, cwd: str | None = None) -> Run:
    """Run ``cmd`` and return its resource usage from wait4 (its whole waited-for tree)."""
    t0 = time.monotonic()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, errors="replace", env=env,
                         cwd=cwd)
    out, err = "", ""
    # communicate() would reap the child itself; read the pipes, then wait4 for the rusage.
    assert p.stdout is not None and p.stderr is not None
    out = p.stdout.read()
    err = p.stderr.read()
    _, status, ru = os.wait4(p.pid, 0)
    p.returncode = os.waitstatus_to_exitcode(status)
    wall = time.monotonic() - t0
    return Run(wall, ru.ru_utime + ru.ru_stime, ru.ru_utime, ru.ru_stime, ru.ru_maxrss, out, err, p.returncode)


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def spread(xs: list[float]) -> tuple[float, float, float]:
    """(median, lower quartile, upper quartile)."""
    if not xs:
        return (float("nan"),) * 3  # type: ignore[return-value]
    if len(xs) < 4:
        return statistics.median(xs), min(xs), max(xs)
    q = statistics.quantiles(xs, n=4)
    return statistics.median(xs), q[0], q[2]


def median_ci(xs: list[float], level: float = 0.95) -> tuple[float, float, float]:
    """(median, low, high): a distribution-free confidence interval of the median from order
    statistics (the ranks whose binomial(n, 1/2) probability covers ``level``)."""
    from math import comb

    v = sorted(xs)
    n = len(v)
    if n < 6:
        return median(v), (v[0] if v else float("nan")), (v[-1] if v else float("nan"))
    cdf, j = 0.0, 0
    while True:  # the largest j with P(Binomial(n, 1/2) < j) <= (1 - level) / 2
        p = comb(n, j) / 2**n
        if cdf + p > (1 - level) / 2:
            break
        cdf += p
        j += 1
    return median(v), v[max(j - 1, 0)], v[min(n - j, n - 1)]


def fmt_ci(xs: list[float], unit: str = "", digits: int = 3) -> str:
    m, lo, hi = median_ci(xs)
    return f"{m:.{digits}f}{unit} ({lo:.{digits}f}-{hi:.{digits}f})"


def fmt_spread(xs: list[float], unit: str = "", digits: int = 3) -> str:
    m, lo, hi = spread(xs)
    return f"{m:.{digits}f}{unit} [{lo:.{digits}f}, {hi:.{digits}f}]"


def perf_samples(stderr: str) -> int:
    m = re.search(r"\((\d+) samples\)", stderr)
    return int(m.group(1)) if m else 0


def cyclescope_samples(stderr: str) -> int:
    m = re.search(r"cyclescope record: ([\d,]+) samples", stderr)
    return int(m.group(1).replace(",", "")) if m else 0


def workload_cpu(stdout: str) -> tuple[float, float]:
    m = re.search(r"cpu_ns (\d+) user_ns (\d+)", stdout)
    if not m:
        raise RuntimeError(f"workload printed no rusage: {stdout!r}")
    return int(m.group(1)) / 1e9, int(m.group(2)) / 1e9


def cpython(version: str) -> str | None:
    """A CPython X.Y interpreter here: pyenv's (these machines have 3.10-3.13), else on PATH."""
    import glob

    found = sorted(glob.glob(f"/root/.pyenv/versions/{version}*/bin/python{version}"))
    exe = found[0] if found else shutil.which(f"python{version}")
    return exe if exe and "/shims/" not in exe else None


def tree_at(rev: str, tmp: Path) -> Path:
    """src/ as committed at ``rev``, unpacked under ``tmp``: run it with PYTHONPATH pointing there
    to compare a revision's cyclescope (its BPF objects too) with the working tree's."""
    import tarfile
    from io import BytesIO

    data = subprocess.run(["git", "-C", str(ROOT), "archive", rev, "src"], check=True, capture_output=True).stdout
    dest = tmp / f"tree-{rev}"
    with tarfile.open(fileobj=BytesIO(data)) as t:
        t.extractall(dest, filter="data")
    return dest / "src"


def contender_trees(base: str | None, tmp: Path) -> dict[str, Path]:
    """The contenders' src/ trees: "head" (this working tree's), and the one committed at ``base``
    (tree_at) where one is given, under its own name. Both compiled to bytecode first: an unpacked
    tree has none, and with PYTHONDONTWRITEBYTECODE (these machines set it) every module its
    collector imports lazily was compiled again at each run (a first Python process described
    system-wide 0.1 later of its run: bench/pyshort.py's unmatched name, 0.67-0.75 against
    0.77-0.85 for the same code)."""
    out = {"head": ROOT / "src"}
    if base:
        out[base] = tree_at(base, tmp)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    for src in out.values():
        subprocess.run([PY, "-m", "compileall", "-q", str(src)], check=True, capture_output=True, env=env)
    return out


def cyclescope_cmd(*args: str) -> list[str]:
    return [PY, "-m", "cyclescope", *args]


def _jsonable(o: Any) -> Any:
    return asdict(o) if hasattr(o, "__dataclass_fields__") else str(o)


def save(name: str, data: Any) -> Path:
    OUT.mkdir(parents=True, exist_ok=True)
    p = OUT / f"{name.removesuffix('.json')}.json"  # --save-as NAME or NAME.json
    p.write_text(json.dumps(data, indent=1, default=_jsonable))
    return p


def need(tool: str) -> None:
    if shutil.which(tool) is None:
        sys.exit(f"bench: {tool} is not installed")


def machine() -> dict[str, Any]:
    cpu = ""
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    from cyclescope.analysis.schedule import host_mcpu, llvm_mca
    from cyclescope.errors import CycleScopeError

    try:
        mca = f"{os.path.basename(llvm_mca())} -mcpu={host_mcpu()}"
    except CycleScopeError:
        mca = "none"
    return {"kernel": os.uname().release, "cpus": os.cpu_count(), "cpu": cpu, "time": time.strftime("%Y-%m-%d %H:%M"),
            "mca": mca}


def record_runs(db: Path, runs: int, rate: float, exe: Path, args: list[str], name: str,
                extra: list[str] | None = None) -> None:
    """``runs`` recordings of ``exe args`` at ``rate`` into one epoch-per-run database, unless the
    database is there already (a kept one from an earlier run of the bench); ``extra``: more
    options of `record`."""
    for _ in range(0 if db.exists() else runs):
        r = run(cyclescope_cmd("record", "--db", str(db), "-q", "--append", "-F", str(rate), *(extra or []),
                               "--", str(exe), *args))
        if r.returncode != 0:
            raise SystemExit(f"record failed for {name}: {r.stderr[-800:]}")


def hot_procedures(db: Path, image: str, min_samples: int) -> tuple[Any, str, list[tuple[int, Any]]]:
    """The profile of ``image`` in every epoch of ``db``, its cycles event, and each procedure with at
    least ``min_samples`` samples of it as (samples, report.listing Target), hottest first."""
    from cyclescope.app.calc import cycles_event
    from cyclescope.app.procedures import procedure_target
    from cyclescope.app.prof import prof_report
    from cyclescope.app.profile import open_profile
    from cyclescope.db.layout import Database
    from cyclescope.db.query import Selection

    profile = open_profile(Database.open(db), Selection(epochs="all", images=(image,)))
    ev = cycles_event(profile, None)
    report = prof_report(profile)
    i = report.events.index(ev)
    out = []
    for row in report.rows:
        if row.counts[i] < min_samples or row.start is None:
            continue
        t = procedure_target(profile, row.image_key, row.procedure)
        if t is not None:
            out.append((row.counts[i], t))
    return profile, ev, out


@contextlib.contextmanager
def perf_probes(exe: Path, probes: dict[str, str]) -> Iterator[dict[str, str]]:
    """`perf probe` uprobes on ``exe`` (event name -> where: a function or an address), deleted
    afterwards; yields each event's full name for `perf stat -e` (probe_<exe>:<name>)."""
    group = "probe_" + re.sub(r"[^A-Za-z0-9_]", "_", exe.name)
    try:
        for ev, where in probes.items():
            subprocess.run(["perf", "probe", "-q", "-x", str(exe), "-a", f"{ev}={where}"], check=True,
                           stdout=subprocess.DEVNULL)
        yield {ev: f"{group}:{ev}" for ev in probes}
    finally:
        for ev in probes:
            subprocess.run(["perf", "probe", "-q", "-d", f"{group}:{ev}"], stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL)
