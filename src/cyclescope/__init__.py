"""cyclescope: a continuous, system-wide sampling profiler for Linux."""

from __future__ import annotations

import os
import sys

__version__ = "0.1.0"

# OpenBLAS and OpenMP start a thread per CPU when numpy is imported, and those threads spin: about
# 0.1 s of CPU at every start of a cyclescope process on these machines (a third of `record`'s
# fixed cost), for linear algebra cyclescope does not do on large matrices.
_BLAS_THREADS = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")


def import_numpy_single_threaded() -> None:
    """Import numpy with one BLAS thread, unless the user chose a number. The variables are set for
    the import only: the commands cyclescope runs (`record -- CMD`) do not inherit them."""
    if "numpy" in sys.modules:
        return
    saved = {k: os.environ.get(k) for k in _BLAS_THREADS}
    for k in _BLAS_THREADS:
        os.environ.setdefault(k, "1")
    try:
        import numpy  # noqa: F401
    except ImportError:
        pass  # said where it is needed
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def trim_heap() -> None:
    """Give the C heap's freed memory back to the system (glibc's malloc_trim): glibc keeps it
    otherwise, and a long-lived process (the daemon after a flush, the analysis worker after
    dropping binaries) holds its largest moment's memory for good."""
    import contextlib
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def sha1_hex(data: bytes) -> str:
    """SHA-1 of ``data`` in hex, for names (cache keys, symbol files), never for security.

    CPython's own ``_sha1`` where it is built, rather than ``hashlib``: importing hashlib (or
    ``secrets``, through hmac) loads OpenSSL's libcrypto, 3.8 MiB of the daemon's resident memory
    (measured here), for digests of a few dozen bytes. The digest is the same either way, so names
    written by either read alike."""
    try:
        from _sha1 import sha1
    except ImportError:  # a build without CPython's own hashes
        from hashlib import sha1
    return str(sha1(data).hexdigest())


def random_hex(nbytes: int) -> str:
    """``nbytes`` random bytes from the kernel, in hex: what secrets.token_hex returns, for
    temporary names and ids, without loading OpenSSL (``secrets`` imports hmac, which does)."""
    return os.urandom(nbytes).hex()
