"""The collector's own helper processes: the flusher's symbol archivers and compactions, and the
loop counter's analysis worker (analysis/worker.py, registered as it starts and ends).

They are Python processes that load the collector's libraries (numpy, pyarrow), busy for seconds
after a flush, and system-wide the collector samples them like any other. Naming their Python
frames and loading their libraries' unwind rows was most of a daemon's CPU with stacks
(bench/collectorcpu.py: 3.4 s of 6 s at 16 kHz with -g fp), so collect/pyframes.py and
collect/bpfunwind.py leave them alone; so does the loop counter (its worker, opening the images
the helpers ran, grew past 220 MiB in a soak). They are known by pid, registered as they start;
not by parentage, since `record -- CMD` runs the profiled command as a child too.
"""

from __future__ import annotations

import os
import subprocess
import threading
import time

KEEP_S = 60.0  # a helper's pid stays known this long after it exits (its last samples drain late)

_lock = threading.Lock()
_pids: dict[int, float | None] = {}  # pid -> when it exited (None: running)


def is_helper(pid: int) -> bool:
    return pid in _pids


def started(pid: int) -> None:
    """A helper started by other means than run_helper (the analysis worker)."""
    with _lock:
        _pids[pid] = None


def ended(pid: int) -> None:
    with _lock:
        if pid in _pids:
            _pids[pid] = time.monotonic()


def run_helper(cmd: list[str], timeout: float = 3600.0) -> int:
    """Run ``cmd`` as a helper, its output dropped and numpy's BLAS single-threaded in it (see
    cyclescope.import_numpy_single_threaded); its exit status, or -1 where it could not run."""
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
    try:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, env=env)
    except OSError:
        return -1
    now = time.monotonic()
    with _lock:
        for p, ended in list(_pids.items()):
            if ended is not None and now - ended > KEEP_S:
                del _pids[p]
        _pids[proc.pid] = None
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        return -1
    finally:
        with _lock:
            _pids[proc.pid] = time.monotonic()
