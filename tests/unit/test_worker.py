"""The analysis worker's child: answers, is let go when idle, and comes back at the next call."""

from __future__ import annotations

import os
import threading
import time
from typing import Any

from cyclescope.analysis.worker import Worker


def _call(w: Worker, name: str, args: tuple[Any, ...]) -> tuple[bool, Any]:
    done = threading.Event()
    got: list[tuple[bool, Any]] = []

    def land(ok: bool, result: Any) -> None:
        got.append((ok, result))
        done.set()

    w.call(name, args, land)
    assert done.wait(30), "no answer from the worker"
    return got[0]


def _wait(cond: Any, timeout: float = 10.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.02)
    return cond()


def test_an_idle_child_is_let_go_and_started_again_by_the_next_call() -> None:
    w = Worker({"pid": "os:getpid", "kill": "os:kill"}, idle_s=1.0)
    try:
        ok, first = _call(w, "pid", ())
        assert ok and first != os.getpid()
        # Busy: calls closer together than idle_s (with a margin for a busy machine) keep the same child.
        for _ in range(3):
            time.sleep(0.1)
            assert _call(w, "pid", ()) == (True, first)
        assert _wait(lambda: not w.running), "the idle child was not let go"
        assert _wait(lambda: not os.path.exists(f"/proc/{first}")), "the idle child did not exit"
        ok, second = _call(w, "pid", ())
        assert ok and second not in (first, os.getpid())
        assert (w.starts, w.restarts) == (2, 0)  # let go and started again: not a restart
    finally:
        w.close()
    assert not w.running


def test_a_child_that_dies_is_restarted_and_its_call_fails() -> None:
    w = Worker({"pid": "os:getpid", "kill": "os:kill"}, idle_s=60)
    try:
        ok, pid = _call(w, "pid", ())
        assert ok
        assert _call(w, "kill", (pid, 9)) == (False, "the analysis worker died")
        assert _wait(lambda: w.restarts == 1)
        ok, again = _call(w, "pid", ())
        assert ok and again != pid
    finally:
        w.close()


def _grow(mib: int) -> int:
    """In the child: hold ``mib`` MiB more for good (a fragmented heap's stand-in); its pid."""
    _HELD.append(bytearray(mib << 20))
    return os.getpid()


_HELD: list[bytearray] = []


def test_a_child_past_its_memory_retires_and_its_queued_calls_go_to_the_next() -> None:
    """After an answer that leaves it over max_own_mib, the child says so and exits; the calls it
    had not answered are sent to the next child, and none is answered twice or lost."""
    w = Worker({"grow": "tests.unit.test_worker:_grow", "pid": "os:getpid"}, idle_s=60, max_own_mib=150)
    try:
        ok, first = _call(w, "pid", ())
        assert ok
        done = threading.Event()
        got: list[tuple[int, bool, Any]] = []
        lock = threading.Lock()

        def land(k: int) -> Any:
            def f(ok: bool, result: Any) -> None:
                with lock:
                    got.append((k, ok, result))
                    if len(got) == 6:
                        done.set()
            return f

        w.call("grow", (200,), land(0))  # over the limit after this answer: retires
        for k in range(1, 6):
            w.call("pid", (), land(k))  # queued behind it
        assert done.wait(60), got
        assert sorted(k for k, _, _ in got) == list(range(6)) and all(ok for _, ok, _ in got)
        assert dict((k, r) for k, _, r in got)[0] == first
        later = {r for k, _, r in got if k > 0}
        assert later and first not in later  # answered by the next child
        assert w.retired == 1 and w.restarts == 0
    finally:
        w.close()
