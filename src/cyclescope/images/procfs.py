"""Reading /proc: process maps, names, the vdso, JIT perf maps."""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass


@dataclass(frozen=True)
class ProcMapping:
    start: int
    end: int
    perms: str
    offset: int
    path: str

    @property
    def executable(self) -> bool:
        return "x" in self.perms


def parse_maps(text: str) -> list[ProcMapping]:
    out = []
    for line in text.splitlines():
        parts = line.split(None, 5)
        if len(parts) < 5:
            continue
        try:
            lo, hi = parts[0].split("-")
            start, end = int(lo, 16), int(hi, 16)
            offset = int(parts[2], 16)
        except ValueError:
            continue
        path = parts[5].strip() if len(parts) > 5 else ""
        out.append(ProcMapping(start, end, parts[1], offset, path))
    return out


def read_maps(pid: int, proc: str = "/proc") -> list[ProcMapping] | None:
    try:
        with open(f"{proc}/{pid}/maps") as f:
            return parse_maps(f.read())
    except (OSError, UnicodeDecodeError):
        return None


def read_comm(pid: int, proc: str = "/proc") -> str | None:
    try:
        with open(f"{proc}/{pid}/comm") as f:
            return f.read().rstrip("\n")
    except OSError:
        return None


def started_at(pid: int, proc: str = "/proc") -> float | None:
    """When process ``pid`` started, in the wall clock's seconds (to a clock tick): its start in
    ticks since boot (/proc/PID/stat's 22nd field) after the boot's time, taken from the wall clock
    and CLOCK_BOOTTIME now (/proc/stat's btime is whole seconds)."""
    import time

    try:
        with open(f"{proc}/{pid}/stat") as f:
            stat = f.read()
        ticks = int(stat[stat.rindex(")") + 2 :].split()[19])
    except (OSError, ValueError, IndexError):
        return None
    booted = time.time() - time.clock_gettime(time.CLOCK_BOOTTIME)
    return booted + ticks / os.sysconf("SC_CLK_TCK")


def list_pids(proc: str = "/proc") -> list[int]:
    try:
        return sorted(int(d) for d in os.listdir(proc) if d.isdigit())
    except OSError:
        return []


def own_vdso() -> bytes | None:
    """The bytes of this process's vdso, the same image every process maps."""
    maps = read_maps(os.getpid())
    for m in maps or []:
        if m.path == "[vdso]":
            return ctypes.string_at(m.start, m.end - m.start)
    return None


PERF_MAP_MAX_BYTES = 64 << 20


def read_perf_map(path: str, owner: int | None) -> str | None:
    """A JIT's /tmp/perf-PID.map, if it is a regular file of the process's owner (or root): the
    daemon reads these as root and stores their names where every reader of the database sees
    them, and anyone can create a file (or a link) under that name in /tmp."""
    import stat

    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as f:
        try:
            st = os.fstat(fd)
        except OSError:
            return None
        if not stat.S_ISREG(st.st_mode) or st.st_size > PERF_MAP_MAX_BYTES:
            return None
        if st.st_uid not in (0, owner):
            return None
        return f.read(PERF_MAP_MAX_BYTES).decode("utf-8", "replace")


def parse_perf_map(text: str) -> list[tuple[int, int, str]]:
    """Lines of /tmp/perf-PID.map: "START SIZE NAME" (hex, hex, rest of line)."""
    out = []
    for line in text.splitlines():
        parts = line.split(None, 2)
        if len(parts) < 3:
            continue
        try:
            out.append((int(parts[0], 16), int(parts[1], 16), parts[2].strip()))
        except ValueError:
            continue
    return out


def hostname() -> str:
    return os.uname().nodename or "localhost"
