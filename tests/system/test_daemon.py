"""`cyclescope daemon` with flush, epoch, status and signals, on the real perf_event interface."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.system.helpers import cs, cs_popen, prof_json, samples_of

pytestmark = [pytest.mark.system, pytest.mark.usefixtures("needs_perf")]


@pytest.fixture
def spinner(compile_c: Callable[..., Path]) -> Iterator[int]:
    proc = subprocess.Popen([str(compile_c("spinner"))], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    pid = int(proc.stdout.readline())
    yield pid
    proc.kill()
    proc.wait()


def wait_for_daemon(db: Path, timeout: float = 20) -> dict[str, object]:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        p = cs("status", "--db", str(db), "--json", check=False)
        if p.returncode == 0:
            result: dict[str, object] = json.loads(p.stdout)
            return result
        time.sleep(0.2)
    raise AssertionError("the daemon did not come up")


def test_daemon_flushes_switches_epochs_and_stops_cleanly(spinner: int, tmp_path: Path) -> None:
    db = tmp_path / "db"
    d = cs_popen("daemon", "--db", str(db), "-F", "500", "--flush-interval", "3600")
    try:
        st = wait_for_daemon(db)
        assert st["epoch"] == 1
        assert "already running" in cs("daemon", "--db", str(db), check=False).stderr
        time.sleep(1.0)
        out = cs("flush", "--db", str(db)).stdout
        assert out.startswith("flushed ") and "into epoch 1" in out
        first = prof_json(db)
        assert samples_of(first, "spin_here") > 200
        out = cs("epoch", "--db", str(db), "--name", "second").stdout
        assert "epoch 2 started" in out
        time.sleep(1.0)
        d.send_signal(signal.SIGTERM)
        _, err = d.communicate(timeout=30)
        assert d.returncode == 0, err
        assert "stopped after" in err and "peak RSS" in err
    finally:
        if d.poll() is None:
            d.kill()
            d.communicate()
    assert prof_json(db, "--epoch", "1")["summary"]["samples"]["cpu-clock"] > 0
    second = prof_json(db, "--epoch", "2")
    assert samples_of(second, "spin_here") > 200  # the SIGTERM flush landed in the new epoch
    listing = cs("epoch", "--list", "--db", str(db)).stdout
    assert "second" in listing


def test_commands_without_a_daemon_say_so(tmp_path: Path) -> None:
    db = tmp_path / "db"
    cs("epoch", "--db", str(db))  # works without a daemon: just makes the epoch
    for cmd in ("flush", "status"):
        p = cs(cmd, "--db", str(db), check=False)
        assert p.returncode == 1 and p.stderr.strip() == f"cyclescope {cmd}: no daemon is running on {db}"


def test_kill_9_leaves_a_readable_database(spinner: int, tmp_path: Path) -> None:
    db = tmp_path / "db"
    d = cs_popen("daemon", "--db", str(db), "-F", "500", "--flush-interval", "0.3")
    try:
        wait_for_daemon(db)
        time.sleep(2.0)
        d.kill()
        d.communicate(timeout=10)
    finally:
        if d.poll() is None:
            d.kill()
            d.communicate()
    rep = prof_json(db)
    assert samples_of(rep, "spin_here") > 100
    assert not rep["summary"]["warnings"]
