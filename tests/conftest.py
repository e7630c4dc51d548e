"""Shared fixtures: compiling test programs, perf availability, and a clean world.

Every test is checked for perf_event file descriptors it left open and for
child processes it left running (pyinstrument's habit): such a test fails.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator
from functools import cache
from pathlib import Path

import pytest

PROGRAMS = Path(__file__).parent / "programs"

# Decoded DWARF and symbol tables go to a throw-away cache, not the user's, removed when the
# session ends (14 MiB a session: CI machines run the suite again and again).
if "CYCLESCOPE_CACHE" not in os.environ:
    import atexit
    import tempfile

    os.environ["CYCLESCOPE_CACHE"] = tempfile.mkdtemp(prefix="cyclescope-test-cache-")
    atexit.register(shutil.rmtree, os.environ["CYCLESCOPE_CACHE"], ignore_errors=True)


def _perf_fds() -> set[str]:
    out = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}") == "anon_inode:[perf_event]":
                out.add(fd)
        except OSError:
            pass
    return out


def _children() -> set[int]:
    kids: set[int] = set()
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/children") as f:
                kids.update(int(x) for x in f.read().split())
        except OSError:
            pass
    return kids


@pytest.fixture(autouse=True)
def clean_world() -> Iterator[None]:
    fds, kids = _perf_fds(), _children()
    yield
    leaked_fds = _perf_fds() - fds
    new_kids = _children() - kids
    # Zombies are reaped by the test's own subprocess handling; only live children count.
    live = []
    for k in new_kids:
        try:
            with open(f"/proc/{k}/stat") as f:
                if f.read().split(")")[-1].split()[0] != "Z":
                    live.append(k)
            with open(f"/proc/{k}/cmdline", "rb") as f:
                if b"multiprocessing.resource_tracker" in f.read():
                    live.remove(k)  # multiprocessing's helper: it lives as long as this process
        except (OSError, ValueError):
            pass
    for k in live:
        try:
            os.kill(k, 9)
            os.waitpid(k, 0)
        except (OSError, ChildProcessError):
            pass
    assert not leaked_fds, f"test left {len(leaked_fds)} perf_event fd(s) open"
    assert not live, f"test left child process(es) running: {live}"


@cache
def perf_problem() -> str | None:
    """Why real perf_event sampling cannot run here, or None when it can."""
    from cyclescope.collect import kernel
    from cyclescope.perf.abi import PERF_ATTR_SIZE, EventType, PerfEventAttr, SwId

    a = PerfEventAttr()
    a.type, a.size, a.config, a.sample_period = EventType.SOFTWARE, PERF_ATTR_SIZE, SwId.CPU_CLOCK, 1_000_000
    a.flags = 1  # disabled
    try:
        fd = kernel.perf_event_open(a, -1, 0)
    except kernel.PerfOpenError as e:
        return f"system-wide cpu-clock events cannot be opened here: {e}"
    kernel.close_fd(fd)
    if shutil.which("gcc") is None:
        return "gcc is not installed"
    return None


@pytest.fixture
def needs_perf() -> None:
    why = perf_problem()
    if why:
        pytest.skip(f"needs root and the perf_event interface: {why}")


@pytest.fixture(scope="session")
def build_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("programs")


@pytest.fixture(scope="session")
def compile_c(build_dir: Path) -> Callable[..., Path]:
    """Compile tests/programs/NAME.c (or a source string) with gcc; cached per flags."""
    if shutil.which("gcc") is None:
        pytest.skip("gcc is not installed")
    built: dict[tuple[str, tuple[str, ...]], Path] = {}

    def compile_(name: str, *flags: str, source: str | None = None, out: str | None = None,
                 libs: tuple[str, ...] = ()) -> Path:
        key = (name + (source or ""), flags + libs)
        if key in built and out is None:
            return built[key]
        src = PROGRAMS / f"{name}.c"
        if source is not None:
            src = build_dir / f"{name}.c"
            src.write_text(source)
        exe = build_dir / (out or f"{name}{abs(hash(flags + libs)) % 10**8}")
        cmd = ["gcc", *(flags or ("-O2", "-g")), "-o", str(exe), str(src), *libs]
        subprocess.run(cmd, check=True, capture_output=True)
        built[key] = exe
        return exe

    return compile_


@pytest.fixture
def utc() -> Iterator[None]:
    """Report times in UTC, whatever the machine's zone (golden files hold times)."""
    old = os.environ.get("TZ")
    os.environ["TZ"] = "UTC"
    time.tzset()
    yield None
    if old is None:
        del os.environ["TZ"]
    else:
        os.environ["TZ"] = old
    time.tzset()
