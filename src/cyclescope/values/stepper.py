"""Building and loading the interpreter's inner loop (stepper.c) against the unicorn wheel's library.

The C file is compiled once per (source, libunicorn) into the user's cache directory
(``$XDG_CACHE_HOME/cyclescope``, else ``~/.cache/cyclescope``; a private directory: a root
daemon loads what it finds there) and loaded with ctypes. ``scripts/setup`` builds it ahead
(``python -m cyclescope.values.stepper``), so that a first ``record --values`` pays nothing
and a missing compiler is found at install time.
"""

from __future__ import annotations

import atexit
import ctypes
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from cyclescope.errors import CycleScopeError

SOURCE = Path(__file__).with_name("stepper.c")
NREGS = 18
NEED_PLAN, DEADLINE, DONE = 100, 101, 102
LOST_FLAG = 0x100
REG_NONE, REG_RIP, REG_UNKNOWN = -1, -2, -3
P_MEM, P_READ, P_WRITE, P_STACK, P_LEAVE = 1, 2, 4, 8, 16
VEC_NAMES = tuple(f"{p}mm{i}" for p in "xyz" for i in range(32))  # bit i of plan_t's vector masks
VEC_BIT = {n: i for i, n in enumerate(VEC_NAMES)}


class StepperError(CycleScopeError):
    """The interpreter's C loop could not be built or loaded."""


class Plan(ctypes.Structure):
    """plan_t: what the C loop needs of one instruction."""

    _fields_ = [("pc", ctypes.c_uint64), ("disp", ctypes.c_int64), ("vread", ctypes.c_uint64 * 2),
                ("vwrite", ctypes.c_uint64 * 2), ("id", ctypes.c_int32), ("stop", ctypes.c_uint8),
                ("flags", ctypes.c_uint8), ("size", ctypes.c_uint8), ("isize", ctypes.c_uint8),
                ("base", ctypes.c_int8), ("index", ctypes.c_int8), ("scale", ctypes.c_uint8),
                ("used", ctypes.c_uint8)]


class Out(ctypes.Structure):
    """out_t: where runs append their steps (numpy arrays of STEP_DTYPE and VRES_DTYPE)."""

    _fields_ = [("steps", ctypes.c_void_p), ("vres", ctypes.c_void_p), ("cap", ctypes.c_uint32),
                ("n", ctypes.c_uint32), ("vcap", ctypes.c_uint32), ("vn", ctypes.c_uint32)]


STEP_DTYPE = np.dtype([("run", "<i4"), ("insn", "<i4"), ("pc", "<u8"), ("in", "<u8", (NREGS,)),
                       ("out", "<u8", (NREGS,)), ("ea", "<u8"), ("loaded", "<u8"), ("stored", "<u8"),
                       ("next_pc", "<u8"), ("has_ea", "u1"), ("has_loaded", "u1"), ("has_stored", "u1"),
                       ("sampled", "u1"), ("nvres", "<i4")], align=True)
VRES_DTYPE = np.dtype([("step", "<i4"), ("name", "<i4"), ("value", "<u8")], align=True)
PAGE_CALLBACK = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int32, ctypes.c_uint64, ctypes.c_int)  # (key, page, stack)


def _unicorn_dir() -> Path:
    import unicorn

    return Path(unicorn.__file__).resolve().parent


def cache_dir() -> Path:
    """The user's cyclescope cache (``$CYCLESCOPE_CACHE``, else ``$XDG_CACHE_HOME/cyclescope`` or
    ``~/.cache/cyclescope``, as for decoded binaries), if it is the user's own and private."""
    from cyclescope.images.cache import default_root

    d = default_root()
    try:
        d.mkdir(parents=True, exist_ok=True, mode=0o700)
        st = d.stat()
        if st.st_uid == os.getuid() and not st.st_mode & 0o022:
            return d
    except OSError:
        pass
    # Not ours or not private: a private directory of this process's instead (built afresh there),
    # one per process and removed at exit (a library loaded from it stays mapped until then).
    return _private_fallback()


_FALLBACK: Path | None = None


def _private_fallback() -> Path:
    global _FALLBACK
    if _FALLBACK is None or not _FALLBACK.is_dir():
        _FALLBACK = Path(tempfile.mkdtemp(prefix="cyclescope-"))
        atexit.register(shutil.rmtree, _FALLBACK, ignore_errors=True)
    return _FALLBACK


def library_path() -> Path:
    uc = _unicorn_dir()
    lib = uc / "lib" / "libunicorn.so.2"
    h = hashlib.sha256(SOURCE.read_bytes())
    try:
        st = lib.stat()
        h.update(f"{lib}:{st.st_size}:{st.st_mtime_ns}".encode())
    except OSError as e:
        raise StepperError(f"the unicorn library is missing ({lib}): reinstall cyclescope") from e
    return cache_dir() / f"stepper-{h.hexdigest()[:16]}.so"


def build(path: Path | None = None) -> Path:
    """Compile stepper.c unless already built; the library's path."""
    path = path or library_path()
    if path.exists():
        return path
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        raise StepperError("interpreting values needs a C compiler (cc or gcc) to build its inner loop once; "
                           "install gcc, or record with --interpret 0")
    uc = _unicorn_dir()
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    cmd = [cc, "-O2", "-shared", "-fPIC", "-o", str(tmp), str(SOURCE), f"-I{uc / 'include'}", f"-L{uc / 'lib'}",
           "-l:libunicorn.so.2", f"-Wl,-rpath,{uc / 'lib'}"]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        tmp.unlink(missing_ok=True)
        first = next((ln for ln in r.stderr.splitlines() if "error" in ln), r.stderr.strip()[:200])
        raise StepperError(f"building the interpreter's inner loop failed: {first}")
    os.replace(tmp, path)  # atomic: a concurrent build or reader never sees half a library
    return path


_LIB: ctypes.CDLL | None = None


def load() -> ctypes.CDLL:
    """The C loop, built if need be."""
    global _LIB
    if _LIB is not None:
        return _LIB
    path = build()
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as e:
        raise StepperError(f"loading the interpreter's inner loop failed: {e}") from e
    vp, u32, i32, u64 = ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int32, ctypes.c_uint64
    lib.stp_new.restype = vp
    lib.stp_new.argtypes = [vp, PAGE_CALLBACK, i32]
    lib.stp_free.argtypes = [vp, ctypes.c_int]
    lib.stp_free.restype = None
    lib.stp_add_plan.argtypes = [vp, ctypes.POINTER(Plan)]
    lib.stp_add_plan.restype = ctypes.c_int
    lib.stp_clear_plans.argtypes = [vp]
    lib.stp_clear_plans.restype = None
    lib.stp_plan_count.argtypes = [vp]
    lib.stp_plan_count.restype = u32
    lib.stp_need_pc.argtypes = [vp]
    lib.stp_need_pc.restype = u64
    lib.stp_go.argtypes = [vp]
    lib.stp_go.restype = ctypes.c_int
    lib.stp_run.argtypes = [vp, ctypes.POINTER(Out), ctypes.c_char_p, ctypes.c_char_p, u32, ctypes.c_int, i32, u32,
                            u64, u64]
    lib.stp_run.restype = ctypes.c_int
    lib.stp_run_many.argtypes = [vp, ctypes.POINTER(Out), vp, vp, u32, vp, i32, ctypes.c_int, u32, ctypes.c_int64, i32,
                                 vp, ctypes.POINTER(ctypes.c_int32)]
    lib.stp_run_many.restype = ctypes.c_int
    lib.stp_sizes.argtypes = [ctypes.POINTER(ctypes.c_uint32)]
    lib.stp_sizes.restype = None
    sizes = (ctypes.c_uint32 * 4)()
    lib.stp_sizes(sizes)
    want = [ctypes.sizeof(Plan), STEP_DTYPE.itemsize, VRES_DTYPE.itemsize, ctypes.sizeof(Out)]
    if list(sizes) != want:
        raise StepperError(f"the interpreter's inner loop does not match its Python side (sizes {list(sizes)} "
                           f"against {want}): remove {path}")
    _LIB = lib
    return lib


if __name__ == "__main__":
    try:
        print(build())
    except CycleScopeError as e:
        print(f"cyclescope: {e}", file=sys.stderr)
        sys.exit(1)
