"""The drain loop's order of work: a thread's exit read in a drain is passed to the processors
after that drain's samples, which hold the thread's last ones (rings read from the kernel through
a stub session: the records are bytes built by the test)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from cyclescope.collect.daemon import Collector, CollectorConfig
from cyclescope.collect.processor import Context, Drain
from cyclescope.db.layout import Database
from cyclescope.perf.records import SampleLayout
from tests import perfbytes as pb


class _Target:
    def describe(self) -> str:
        return "test"


class _Session:
    """What Collector.step asks of a session, with the rings' bytes given."""

    def __init__(self, raw: bytes) -> None:
        self.layout = SampleLayout(pb.ST)
        self.target = _Target()
        self.raw = [raw]

    def drain(self) -> list[bytes]:
        out, self.raw = self.raw, []
        return out

    def event_index(self, ids: np.ndarray) -> np.ndarray:
        return np.zeros(len(ids), np.int64)

    def account(self, ev: np.ndarray, samples: np.ndarray) -> np.ndarray:
        return np.full(len(samples), 1e6)

    def note_fork(self, pid: int, ppid: int, t: int) -> None:
        pass

    def forget_pid(self, pid: int) -> None:
        pass


class _Log:
    """A processor that writes down what it was given, in order."""

    name = "log"
    needs_regs = False

    def __init__(self) -> None:
        self.events: list[tuple[Any, ...]] = []

    def bind(self, ctx: Context) -> None:
        pass

    def process(self, drain: Drain) -> None:
        self.events.append(("samples", tuple(sorted(set(drain.samples["tid"].tolist())))))

    def forget(self, pid: int, tid: int) -> None:
        self.events.append(("forget", pid, tid))

    def finish(self) -> None:
        pass

    def flush(self, db: Database, epoch: int, host: str) -> list[Path]:
        return []

    def close(self) -> None:
        pass

    def status(self) -> dict[str, Any]:
        return {}

    def summary(self) -> str | None:
        return None


def test_an_exit_reaches_the_processors_after_the_samples_it_follows(tmp_path: Path) -> None:
    raw = (pb.comm(5, 5, "prog", 1, exec_=True)
           + pb.mmap2(5, 5, 0x400000, 0x1000, 0, "/usr/bin/true", 2)
           + pb.fork(5, 5, 6, 5, 3)
           + pb.sample(1, 0x400010, 5, 6, 4, 0)
           + pb.sample(1, 0x400020, 5, 6, 5, 0)
           + pb.exit_(5, 5, 6, 5, 6)
           + pb.sample(1, 0x400030, 5, 5, 7, 1))
    log = _Log()
    c = Collector(_Session(raw), Database(tmp_path / "db"), CollectorConfig("h", processors=[log]))  # type: ignore[arg-type]
    assert c.step() == 3
    # the exec (before any sample of the new program), the samples, then the thread's exit
    assert log.events == [("forget", 5, 5), ("samples", (5, 6)), ("forget", 5, 6)]
    assert c.step() == 0 and log.events[-1] == ("forget", 5, 6)  # once


def test_a_processors_own_ring_wakes_the_drain_loop(tmp_path: Path) -> None:
    """Goal probes write every execution's hit to rings of their own: their wake-ups (a pipe here,
    readable like a half-full ring) call for a drain, and one whose task is gone is polled once."""
    import os
    import time

    session = _Session(b"")
    session.fds = []  # type: ignore[attr-defined]
    c = Collector(session, Database(tmp_path / "db"), CollectorConfig("h", processors=[_Log()]))  # type: ignore[arg-type]
    r, w = os.pipe()
    try:
        t0 = time.monotonic()
        assert not c._wait(0.05, (), (r,))  # nothing written: the timeout
        assert time.monotonic() - t0 >= 0.04
        os.write(w, b"x")
        t0 = time.monotonic()
        assert c._wait(5.0, (), (r,)) and time.monotonic() - t0 < 1.0
        os.read(r, 1)
        os.close(w)
        w = -1
        assert c._wait(5.0, (), (r,))  # hung up: drained once
        t0 = time.monotonic()
        assert not c._wait(0.05, (), (r,)) and time.monotonic() - t0 >= 0.04  # and not polled again
    finally:
        os.close(r)
        if w >= 0:
            os.close(w)


def test_python_processes_bring_drains_forward_while_their_names_can_still_be_read() -> None:
    """A process's code objects are read from its memory at a drain: 50 ms while its interpreter
    starts and once right after it is described (a run of a third of a second kept no name when
    that drain came a quarter second later), a quarter second while new code objects turn up,
    then the loop's own pace."""
    from types import SimpleNamespace

    from cyclescope.collect.daemon import FIRST_DRAIN_S, PYTHON_DRAIN_S

    c = object.__new__(Collector)
    c.python = SimpleNamespace(codes_read=0, procs_described=0, waiting={})  # type: ignore[assignment]
    c._python_seen = (0, 0)
    assert c._python_drain_s() is None  # nothing new: a steady state
    c.python.waiting = {4242: 0.0}  # type: ignore[union-attr]
    assert c._python_drain_s() == FIRST_DRAIN_S  # its runtime has not started
    c.python.waiting, c.python.procs_described = {}, 1  # type: ignore[union-attr]
    assert c._python_drain_s() == FIRST_DRAIN_S  # described: its first Python frames come now
    c.python.codes_read = 5  # type: ignore[union-attr]
    assert c._python_drain_s() == PYTHON_DRAIN_S  # code objects read: more may follow
    assert c._python_drain_s() is None
    c.python = None
    assert c._python_drain_s() is None
