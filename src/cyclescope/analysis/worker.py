"""A worker process for analyses the collector must not run itself, and its client.

The collector's loop counting (analysis/loopcount.py) opens binaries and builds CFGs: pure Python
that would hold the GIL from the drains and leave its memory behind. It runs here instead, in a
child started as ``python -m cyclescope.analysis.worker``: requests and answers are pickled
frames over its stdin and stdout (both ends are this program's own code). The child dies with
its parent (PR_SET_PDEATHSIG: a daemon killed with -9 leaves no worker), keeps no other
descriptor of the parent's (a killed parent's pipes close), and is started again if it dies.
Idle for IDLE_S with nothing pending, it is let go (its stdin closed: it exits) and started again
at the next call: a daemon's analyses come in its first minutes and whenever new programs run,
and in between the child, with the binaries it opened, held 90-140 MiB (bench/soak.py). Past
MAX_OWN_MIB of its own memory after an answer, it says so and exits, and what it had been sent
and not answered goes to the next child.
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
import time
from collections.abc import Callable
from typing import Any

_LEN = struct.Struct("<Q")
MAX_FRAME = 1 << 30
IDLE_S = 60.0  # a child with nothing to do this long is let go (Worker._retire)
# A child that holds more memory of its own than this after an answer says so and exits; the
# parent sends what it had not answered to the next one. Reading the symbols of images the user's
# cache does not have leaves the heap fragmented (libarrow's: 47 MiB), and under a compile loop on
# a fresh machine the child grew to 191 MiB of its own (bench/soak.py).
MAX_OWN_MIB = 96.0
RETIRING = -1  # the request id of a child's last frame: it is exiting (MAX_OWN_MIB)


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


def own_mib(pid: int | str = "self") -> float:
    """A process's anonymous memory (smaps_rollup's Pss_Anon: its own, not the libraries' pages
    it shares; this process's by default), in MiB; 0 where the kernel does not say."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss_Anon:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def serve(specs: list[str], max_own_mib: float = MAX_OWN_MIB) -> None:
    """The child's loop: one request at a time, each answered (ok, result) or (False, message);
    past ``max_own_mib`` of its own memory after an answer, a RETIRING frame and exit."""
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
        if own_mib() > max_own_mib:
            _write_frame(out, (RETIRING, True, None))
            return


# --- the parent ------------------------------------------------------------------------------------
class Worker:
    """Calls into the child: ``call(name, args, land)`` returns at once; ``land(ok, result)`` runs
    on the reader thread when the answer comes (``ok`` False when the call failed or the child
    died). One request is in the child at a time; the others queue in its pipe."""

    MAX_RESTARTS = 3

    def __init__(self, functions: dict[str, str], idle_s: float = IDLE_S, max_own_mib: float = MAX_OWN_MIB) -> None:
        """``functions``: the name a call uses -> "package.module:function" the child runs;
        ``idle_s``: how long the child may wait with nothing to do before it is let go;
        ``max_own_mib``: the child's own memory past which it retires after an answer."""
        import queue

        self.functions = functions
        self.idle_s = idle_s
        self.max_own_mib = max_own_mib
        self._lock = threading.Lock()
        # request id -> (land, name, args): the args are kept to be sent again to the next child
        # when one retires with requests unanswered
        self._pending: dict[int, tuple[Callable[[bool, Any], None], str, tuple[Any, ...]]] = {}
        self._next = 0
        self._proc: subprocess.Popen[bytes] | None = None
        self.restarts = 0  # starts after the child died (not after it was let go idle, or retired)
        self.starts = 0
        self.retired = 0  # children that exited past MAX_OWN_MIB
        self._sent: set[int] = set()  # requests written to the child now running
        self._closed = False
        self._active = time.monotonic()  # the last call or answer: idle_s after it, the child is let go
        # Requests go out on a thread of their own: a pipe full of them would block the caller
        # (the sampling loop) until the child got through a long analysis.
        self._out: queue.Queue[tuple[int, str, tuple[Any, ...]] | None] = queue.Queue()
        self._start()
        threading.Thread(target=self._write, name="analysis-requests", daemon=True).start()

    @property
    def running(self) -> bool:
        with self._lock:
            return self._proc is not None

    def _start(self) -> None:
        """A child, under the lock or before the threads run."""
        self.starts += 1
        self._sent = set()
        env = dict(os.environ)
        src = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env["PYTHONPATH"] = src + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        specs = [f"{k}={v}" for k, v in self.functions.items()]
        from cyclescope.collect import helpers

        self._proc = subprocess.Popen([sys.executable, "-m", "cyclescope.analysis.worker",
                                       f"--max-own-mib={self.max_own_mib}", *specs],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                      close_fds=True, env=env)
        helpers.started(self._proc.pid)  # system-wide, its samples are the collector's own
        threading.Thread(target=self._read, args=(self._proc,), name="analysis-worker", daemon=True).start()

    def _read(self, proc: subprocess.Popen[bytes]) -> None:
        assert proc.stdout is not None
        while True:
            try:
                rid, ok, result = _read_frame(proc.stdout)
            except (EOFError, OSError, pickle.UnpicklingError, ValueError):
                break
            if rid == RETIRING:  # past its memory: what it had not answered goes to the next child
                with self._lock:
                    if proc is self._proc:
                        self.retired += 1
                        self._proc = None  # _write starts the next one
                        for r in sorted(self._sent & self._pending.keys()):  # sent, not answered
                            _, name, args = self._pending[r]
                            self._out.put((r, name, args))
                        self._sent.clear()
                break
            with self._lock:
                got = self._pending.pop(rid, None)
                self._sent.discard(rid)
                self._active = time.monotonic()
            if got is not None:
                got[0](ok, result)
        _reap(proc)
        # The child died, was closed, retired or was let go idle: fail what it held; start it again
        # while worth it (a child let go or retired is started again by the next call).
        with self._lock:
            if proc is not self._proc:  # let go idle (nothing pending) or retired (sent on)
                return
            lost = [land for land, _, _ in self._pending.values()]
            self._pending.clear()
            restart = not self._closed and self.restarts < self.MAX_RESTARTS
            if restart:
                self.restarts += 1
                self._start()
            else:
                self._proc = None
        for land in lost:
            land(False, "the analysis worker died")

    def call(self, name: str, args: tuple[Any, ...], land: Callable[[bool, Any], None]) -> None:
        with self._lock:
            if self._closed:
                ok = False
            else:
                rid = self._next
                self._next += 1
                self._pending[rid] = (land, name, args)
                self._active = time.monotonic()
                self._out.put((rid, name, args))
                ok = True
        if not ok:
            land(False, "the analysis worker is not running")

    def _retire(self) -> None:
        """Let an idle child go: its stdin closed, it reads EOF and exits (its reader thread
        ends without starting another)."""
        with self._lock:
            proc = self._proc
            if proc is None or self._pending or self._closed:
                return
            self._proc = None
        if proc.stdin is not None:
            with contextlib.suppress(OSError):
                proc.stdin.close()
        _reap(proc)

    def _write(self) -> None:
        import queue

        while True:
            with self._lock:
                wait = self.idle_s - (time.monotonic() - self._active)
            try:
                item = self._out.get(timeout=max(wait, 0.01))
            except queue.Empty:
                with self._lock:
                    idle = not self._pending and time.monotonic() - self._active >= self.idle_s
                if idle:
                    self._retire()
                continue
            if item is None:
                return
            with self._lock:
                if item[0] not in self._pending:  # answered already (sent again after a retirement)
                    continue
                if self._proc is None and not self._closed and self.restarts < self.MAX_RESTARTS:
                    self._start()  # let go idle or retired before: started again for this call
                proc = self._proc
                if proc is not None:
                    self._sent.add(item[0])  # a retirement sends it to the next child
            failed = proc is None or proc.stdin is None
            if not failed:
                try:
                    assert proc is not None and proc.stdin is not None
                    _write_frame(proc.stdin, item)
                except (OSError, ValueError):
                    with self._lock:  # a child retired meanwhile sent it on (it was in _sent)
                        failed = proc is self._proc
            if failed:
                with self._lock:
                    got = self._pending.pop(item[0], None)
                if got is not None:
                    got[0](False, "the analysis worker is not running")

    def close(self) -> None:
        with self._lock:
            self._closed = True
            proc = self._proc
        self._out.put(None)
        if proc is not None:
            with contextlib.suppress(OSError):
                proc.kill()
            _reap(proc)


def _reap(proc: subprocess.Popen[bytes], timeout: float = 5.0) -> None:
    """Wait for a child that is exiting (killed past ``timeout``), close its pipes, and drop it
    from the collector's helpers."""
    from cyclescope.collect import helpers

    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    for f in (proc.stdin, proc.stdout):
        if f is not None:
            with contextlib.suppress(OSError):
                f.close()
    helpers.ended(proc.pid)


if __name__ == "__main__":
    from cyclescope import import_numpy_single_threaded

    import_numpy_single_threaded()
    argv = sys.argv[1:]
    limit = MAX_OWN_MIB
    if argv and argv[0].startswith("--max-own-mib="):
        limit = float(argv.pop(0).partition("=")[2])
    serve(argv, limit)
