"""A worker process for analyses the collector must not run itself, and its client.

The collector's loop counting (analysis/loopcount.py) opens binaries and builds CFGs: pure Python
that would hold the GIL from the drains and leave its memory behind. It runs here instead, in a
child started as ``python -m cyclescope.analysis.worker``: requests and answers are pickled
frames over its stdin and stdout (both ends are this program's own code). The child dies with
its parent (PR_SET_PDEATHSIG: a daemon killed with -9 leaves no worker), keeps no other
descriptor of the parent's (a killed parent's pipes close), and is started again if it dies.
multiprocessing's pools were tried first: their spawned helper processes held the parent's
standard output open after a kill -9, and lived on.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import struct
import subprocess
import sys
import threading
from collections.abc import Callable
from typing import Any

_LEN = struct.Struct("<Q")
MAX_FRAME = 1 << 30


def _read_frame(f: Any) -> Any:
    head = f.read(_LEN.size)
    if len(head) < _LEN.size:
        raise EOFError
    (n,) = _LEN.unpack(head)
    if n > MAX_FRAME:
        raise EOFError
    body = f.read(n)
    if len(body) < n:
        raise EOFError
    return pickle.loads(body)


def _write_frame(f: Any, obj: Any) -> None:
    body = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    f.write(_LEN.pack(len(body)) + body)
    f.flush()


# --- the child -----------------------------------------------------------------------------------
def _functions(specs: list[str]) -> dict[str, Callable[..., Any]]:
    """NAME=package.module:function for each function the child serves (its parent says which: the
    worker knows none of the analyses it runs)."""
    import importlib

    out = {}
    for spec in specs:
        name, _, target = spec.partition("=")
        module, _, fn = target.partition(":")
        out[name] = getattr(importlib.import_module(module), fn)
    return out


def serve(specs: list[str]) -> None:
    """The child's loop: one request at a time, each answered (ok, result) or (False, message)."""
    from cyclescope.collect.session import die_with

    die_with(os.getppid())
    fns = _functions(specs)
    inp, out = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # nothing else may write into the answer stream
    while True:
        try:
            rid, name, args = _read_frame(inp)
        except EOFError:
            return
        try:
            result = (True, fns[name](*args))
        except Exception as e:  # the client treats a failure as "nothing to analyze"
            result = (False, f"{type(e).__name__}: {e}")
        _write_frame(out, (rid, *result))


# --- the parent ------------------------------------------------------------------------------------
class Worker:
    """Calls into the child: ``call(name, args, land)`` returns at once; ``land(ok, result)`` runs
    on the reader thread when the answer comes (``ok`` False when the call failed or the child
    died). One request is in the child at a time; the others queue in its pipe."""

    MAX_RESTARTS = 3

    def __init__(self, functions: dict[str, str]) -> None:
        """``functions``: the name a call uses -> "package.module:function" the child runs."""
        import queue

        self.functions = functions
        self._lock = threading.Lock()
        self._pending: dict[int, Callable[[bool, Any], None]] = {}
        self._next = 0
        self._proc: subprocess.Popen[bytes] | None = None
        self.restarts = -1
        self._closed = False
        # Requests go out on a thread of their own: a pipe full of them would block the caller
        # (the sampling loop) until the child got through a long analysis.
        self._out: queue.Queue[tuple[int, str, tuple[Any, ...]] | None] = queue.Queue()
        self._start()
        threading.Thread(target=self._write, name="analysis-requests", daemon=True).start()

    def _start(self) -> None:
        self.restarts += 1
        env = dict(os.environ)
        src = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env["PYTHONPATH"] = src + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        specs = [f"{k}={v}" for k, v in self.functions.items()]
        self._proc = subprocess.Popen([sys.executable, "-m", "cyclescope.analysis.worker", *specs],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                      close_fds=True, env=env)
        threading.Thread(target=self._read, args=(self._proc,), name="analysis-worker", daemon=True).start()

    def _read(self, proc: subprocess.Popen[bytes]) -> None:
        assert proc.stdout is not None
        while True:
            try:
                rid, ok, result = _read_frame(proc.stdout)
            except (EOFError, OSError, pickle.UnpicklingError, ValueError):
                break
            with self._lock:
                land = self._pending.pop(rid, None)
            if land is not None:
                land(ok, result)
        # The child died (or was closed): fail what it held; start it again while worth it.
        with self._lock:
            lost = list(self._pending.values())
            self._pending.clear()
            restart = not self._closed and self.restarts < self.MAX_RESTARTS
        for land in lost:
            land(False, "the analysis worker died")
        if restart:
            with self._lock:
                self._start()

    def call(self, name: str, args: tuple[Any, ...], land: Callable[[bool, Any], None]) -> None:
        with self._lock:
            if self._closed:
                ok = False
            else:
                rid = self._next
                self._next += 1
                self._pending[rid] = land
                self._out.put((rid, name, args))
                ok = True
        if not ok:
            land(False, "the analysis worker is not running")

    def _write(self) -> None:
        while True:
            item = self._out.get()
            if item is None:
                return
            with self._lock:
                proc = self._proc
            failed = proc is None or proc.stdin is None
            if not failed:
                try:
                    assert proc is not None and proc.stdin is not None
                    _write_frame(proc.stdin, item)
                except (OSError, ValueError):
                    failed = True
            if failed:
                with self._lock:
                    land = self._pending.pop(item[0], None)
                if land is not None:
                    land(False, "the analysis worker is not running")

    def close(self) -> None:
        with self._lock:
            self._closed = True
            proc = self._proc
        self._out.put(None)
        if proc is not None:
            with contextlib.suppress(OSError):
                proc.kill()
            proc.wait()
            for f in (proc.stdin, proc.stdout):
                if f is not None:
                    with contextlib.suppress(OSError):
                        f.close()


if __name__ == "__main__":
    from cyclescope import import_numpy_single_threaded

    import_numpy_single_threaded()
    serve(sys.argv[1:])
