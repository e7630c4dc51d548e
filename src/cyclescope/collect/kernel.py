"""The only module that makes perf-related system calls.

perf_event_open, the mmap'ed ring buffer, ioctls, counter reads, poll. Bytes
come out; decoding them is records.py's business.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import fcntl
import mmap
import os
import struct
import time

from cyclescope.errors import CycleScopeError
from cyclescope.perf.abi import (
    IOC_DISABLE,
    IOC_ENABLE,
    IOC_ID,
    IOC_PERIOD,
    IOC_SET_OUTPUT,
    MMAP_PAGE_DATA_HEAD,
    MMAP_PAGE_DATA_OFFSET,
    MMAP_PAGE_DATA_SIZE,
    MMAP_PAGE_DATA_TAIL,
    PERF_FLAG_FD_CLOEXEC,
    PerfEventAttr,
)

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.syscall.restype = ctypes.c_long
SYS_perf_event_open = 298  # x86-64
PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")


class PerfOpenError(CycleScopeError):
    """perf_event_open failed; carries errno for callers that fall back."""

    def __init__(self, message: str, err: int) -> None:
        super().__init__(message)
        self.errno = err


def _explain(err: int, what: str, pid: int, cpu: int) -> str:
    if err == errno.ENOENT:
        return f"{what}: this machine has no such event (no hardware PMU?)"
    if err == errno.EACCES or err == errno.EPERM:
        para = _read_text("/proc/sys/kernel/perf_event_paranoid").strip()
        return (
            f"{what}: permission denied (perf_event_paranoid={para}); run as root, "
            "or lower /proc/sys/kernel/perf_event_paranoid"
        )
    if err == errno.ESRCH:
        return f"{what}: no process {pid}"
    if err == errno.EINVAL:
        return f"{what}: the kernel rejected the event settings (EINVAL)"
    if err == errno.EMFILE:
        return f"{what}: too many open files (raise ulimit -n)"
    if err == errno.EOPNOTSUPP:
        return f"{what}: not supported by this kernel or PMU"
    return f"{what}: {os.strerror(err)}"


def _read_text(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return "?"


def perf_event_open(attr: PerfEventAttr, pid: int, cpu: int, group_fd: int = -1, what: str = "perf_event_open") -> int:
    fd = _libc.syscall(
        SYS_perf_event_open, ctypes.byref(attr), ctypes.c_int(pid), ctypes.c_int(cpu),
        ctypes.c_int(group_fd), ctypes.c_ulong(PERF_FLAG_FD_CLOEXEC),
    )
    if fd < 0:
        err = ctypes.get_errno()
        raise PerfOpenError(_explain(err, what, pid, cpu), err)
    return int(fd)


UPROBE_TYPE_PATH = "/sys/bus/event_source/devices/uprobe/type"


def uprobe_pmu_type() -> int | None:
    """The uprobe PMU's perf type (dynamic: read from sysfs), or None where the kernel has none."""
    try:
        with open(UPROBE_TYPE_PATH) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


def _uprobe_attr(pmu: int, path: str, file_offset: int) -> tuple[PerfEventAttr, ctypes.Array[ctypes.c_char]]:
    """A uprobe event's attr for the instruction at ``file_offset`` of ``path``, and the path's
    buffer, which must outlive the perf_event_open call (the kernel copies the path during it)."""
    buf = ctypes.create_string_buffer(os.fsencode(path))
    a = PerfEventAttr()
    a.type = pmu
    a.size = ctypes.sizeof(PerfEventAttr)
    a.config1 = ctypes.addressof(buf)
    a.config2 = file_offset
    return a, buf


def _every_event(a: PerfEventAttr, sample_type: int, inherit: bool, on_exec: bool, ring_bytes: int) -> None:
    """A sample at every event (period 1) with ``sample_type``, opened disabled (``on_exec``: enabled
    at the task's exec), on CLOCK_MONOTONIC, waking the reader at half of a ``ring_bytes`` ring: what
    the uprobe samplers and their ring's owner share (SET_OUTPUT needs the same clock)."""
    from cyclescope.perf.abi import AttrFlag

    a.sample_period = 1
    a.sample_type = sample_type
    flags = AttrFlag.DISABLED | AttrFlag.USE_CLOCKID | AttrFlag.WATERMARK | AttrFlag.SAMPLE_ID_ALL
    if inherit:
        flags |= AttrFlag.INHERIT
    if on_exec:
        flags |= AttrFlag.ENABLE_ON_EXEC
    a.flags = int(flags)
    a.clockid = time.CLOCK_MONOTONIC
    a.wakeup_events = ring_bytes // 2  # wakeup_watermark (bytes)


def open_uprobe_counter(pmu: int, path: str, file_offset: int, pid: int, cpu: int) -> int:
    """An exact counter of executions of the instruction at ``file_offset`` of ``path``, for task
    ``pid`` (any CPU) or for every task on ``cpu`` (pid -1): counting mode, no samples, opened
    disabled. The probe is in the text from here until the fd is closed, enabled or not: each hit
    traps (about 9.5 us here), so what must cost nothing must be closed, not disabled."""
    from cyclescope.perf.abi import AttrFlag, ReadFormat

    a, _buf = _uprobe_attr(pmu, path, file_offset)
    a.read_format = ReadFormat.TOTAL_TIME_ENABLED | ReadFormat.TOTAL_TIME_RUNNING
    a.flags = AttrFlag.DISABLED
    return perf_event_open(a, pid, cpu, what=f"uprobe counter at {path}+{file_offset:#x}")


def open_uprobe_sampler(pmu: int, path: str, file_offset: int, pid: int, cpu: int, regs_mask: int,
                        inherit: bool = False, on_exec: bool = False, ring_bytes: int = 1 << 16) -> int:
    """A uprobe perf event that samples *every* execution of the instruction at ``file_offset`` of
    ``path`` (period 1), each sample with the identifier, IP, pid/tid, time and the user registers
    in ``regs_mask``: the registers as they are just before the instruction runs. For task ``pid``
    (``inherit``: and the tasks it creates; then ``cpu`` must be a CPU, since an inherited event
    with cpu -1 cannot be mmapped) or for every task on ``cpu`` (pid -1). Opened disabled (or
    enabled at the task's exec with ``on_exec``). Each hit traps, as the counter's do."""
    from cyclescope.perf.abi import ReadFormat, Sample

    a, _buf = _uprobe_attr(pmu, path, file_offset)
    _every_event(a, int(Sample.IDENTIFIER | Sample.IP | Sample.TID | Sample.TIME | Sample.REGS_USER), inherit,
                 on_exec, ring_bytes)
    a.sample_regs_user = regs_mask
    a.read_format = int(ReadFormat.TOTAL_TIME_ENABLED | ReadFormat.TOTAL_TIME_RUNNING)
    return perf_event_open(a, pid, cpu, what=f"uprobe sampler at {path}+{file_offset:#x}")


def open_ring_owner(pid: int, cpu: int, inherit: bool = False, ring_bytes: int = 1 << 16) -> int:
    """A software dummy event (it never samples) to own one CPU's ring buffer, so that the events
    redirected into it (SET_OUTPUT) can be closed one by one; its attr matches the uprobe
    samplers' (clock, inheritance) as SET_OUTPUT requires."""
    from cyclescope.perf.abi import EventType, Sample, SwId

    a = PerfEventAttr()
    a.type = int(EventType.SOFTWARE)
    a.size = ctypes.sizeof(PerfEventAttr)
    a.config = int(SwId.DUMMY)
    _every_event(a, int(Sample.IDENTIFIER | Sample.IP | Sample.TID | Sample.TIME), inherit, False, ring_bytes)
    return perf_event_open(a, pid, cpu, what=f"ring buffer on CPU {cpu}")


TRACEFS = ("/sys/kernel/tracing", "/sys/kernel/debug/tracing")
_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_NOEXEC = 1, 2, 4, 8
_MNT_DETACH = 2
_tracepoint_ids: dict[tuple[str, str], int] = {}


def tracepoint_id(group: str, name: str) -> int | None:
    """A tracepoint's perf config (its id in tracefs), or None where the kernel has no such
    tracepoint or tracefs cannot be read. Where tracefs is mounted at neither of its usual places
    (a machine booted without systemd, which mounts it at /sys/kernel/tracing: this project's
    Firecracker VMs), it is mounted for the read on a private directory and unmounted at once
    (root only), so the system's mounts stay as they were."""
    key = (group, name)
    if key not in _tracepoint_ids:
        rel = f"events/{group}/{name}/id"
        found = next((i for root in TRACEFS if (i := _read_id(f"{root}/{rel}")) is not None), None)
        if found is None and not _tracefs_mounted():
            found = _read_id_privately(rel)
        if found is None:
            return None
        _tracepoint_ids[key] = found
    return _tracepoint_ids[key]


def no_tracepoint(group: str, name: str) -> str:
    """Why tracepoint_id found no id: tracefs unreadable, or no such tracepoint."""
    if _tracefs_mounted() or _read_id_privately("") is not None:
        return f"the kernel has no {group}:{name} tracepoint"
    return ("tracefs is not mounted and this process cannot mount it "
            "(as root: mount -t tracefs nodev /sys/kernel/tracing)")


def _tracefs_mounted() -> bool:
    return any(os.path.isdir(f"{root}/events") for root in TRACEFS)


def _read_id(path: str) -> int | None:
    try:
        with open(path) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


def _read_id_privately(rel: str) -> int | None:
    """The id at ``rel`` in a tracefs mounted read-only on a fresh directory for this read only
    (0 for ``rel`` empty: whether the mount works). None where it cannot be mounted."""
    import tempfile

    try:
        where = tempfile.mkdtemp(prefix="cyclescope-tracefs-")
    except OSError:
        return None
    try:
        flags = ctypes.c_ulong(_MS_RDONLY | _MS_NOSUID | _MS_NODEV | _MS_NOEXEC)
        if _libc.mount(b"nodev", where.encode(), b"tracefs", flags, None) != 0:
            return None
        try:
            return _read_id(f"{where}/{rel}") if rel else 0
        finally:
            _libc.umount2(where.encode(), _MNT_DETACH)
    finally:
        with contextlib.suppress(OSError):
            os.rmdir(where)


def open_bpf_output_waker(cpu: int) -> int:
    """A BPF output event on ``cpu``, for a one-page ring that a BPF program writes to
    (bpf_perf_event_output into a perf event array): each record carries the writing task's pid
    and tid and wakes the reader. Opened disabled."""
    from cyclescope.perf.abi import EventType, SwId

    return perf_event_open(_waker_attr(EventType.SOFTWARE, SwId.BPF_OUTPUT), -1, cpu,
                           what=f"BPF output event on CPU {cpu}")


def open_bpf_output(cpu: int, watermark_bytes: int) -> int:
    """A BPF output event on ``cpu`` whose ring carries what a BPF program writes into it
    (bpf_perf_event_output), each record the program's bytes alone (PERF_SAMPLE_RAW); the reader
    is woken once ``watermark_bytes`` are waiting. Opened disabled."""
    from cyclescope.perf.abi import AttrFlag, EventType, Sample, SwId

    a = PerfEventAttr()
    a.type = int(EventType.SOFTWARE)
    a.size = ctypes.sizeof(PerfEventAttr)
    a.config = int(SwId.BPF_OUTPUT)
    a.sample_period = 1
    a.sample_type = int(Sample.RAW)
    a.flags = int(AttrFlag.DISABLED | AttrFlag.WATERMARK)
    a.wakeup_events = max(1, watermark_bytes)  # wakeup_watermark (the same field)
    return perf_event_open(a, -1, cpu, what=f"BPF output event on CPU {cpu}")


def _waker_attr(type_: int, config: int) -> PerfEventAttr:
    """A waker's event: a record (pid and tid only) at every hit, each waking the reader of its
    one-page ring (the records only say "now"). Disabled."""
    from cyclescope.perf.abi import AttrFlag, Sample

    a = PerfEventAttr()
    a.type = int(type_)
    a.size = ctypes.sizeof(PerfEventAttr)
    a.config = int(config)
    a.sample_period = 1
    a.sample_type = int(Sample.TID)
    a.flags = int(AttrFlag.DISABLED | AttrFlag.WATERMARK)
    a.wakeup_events = 1  # wakeup_watermark: one byte, so each record wakes
    return a


def open_tracepoint(tp_id: int, what: str = "tracepoint") -> int:
    """A tracepoint event for a BPF program to be attached to (bpf_link_create with
    BPF_PERF_EVENT): the kernel then runs the program at every hit on every CPU, whatever the
    event's own CPU (libbpf's bpf_program__attach_tracepoint opens the same, on CPU 0). Opened
    disabled: enable it once the program is attached."""
    from cyclescope.perf.abi import AttrFlag, EventType

    a = PerfEventAttr()
    a.type = int(EventType.TRACEPOINT)
    a.size = ctypes.sizeof(PerfEventAttr)
    a.config = tp_id
    a.sample_period = 1
    a.flags = int(AttrFlag.DISABLED)
    return perf_event_open(a, -1, 0, what=what)


def open_tracepoint_waker(tp_id: int, cpu: int, filter_expr: str) -> int:
    """A tracepoint event on ``cpu`` (every task) that writes a record (pid and tid only) at each
    hit passing ``filter_expr`` (ftrace's filter syntax, applied in the kernel before anything is
    written) and wakes the reader at each: for a one-page ring whose records only say "now".
    Opened disabled."""
    from cyclescope.perf.abi import IOC_SET_FILTER, EventType

    fd = perf_event_open(_waker_attr(EventType.TRACEPOINT, tp_id), -1, cpu, what=f"tracepoint {tp_id} on CPU {cpu}")
    expr = ctypes.create_string_buffer(filter_expr.encode())
    # fcntl.ioctl takes an int argument as a C int: the filter's address is passed through libc.
    if _libc.ioctl(fd, ctypes.c_ulong(IOC_SET_FILTER), expr) != 0:
        err = ctypes.get_errno()
        close_fd(fd)
        raise PerfOpenError(f"tracepoint {tp_id}: filter {filter_expr!r} refused: {os.strerror(err)}", err)
    return fd


def ioctl_enable(fd: int) -> None:
    fcntl.ioctl(fd, IOC_ENABLE, 0)


def ioctl_disable(fd: int) -> None:
    fcntl.ioctl(fd, IOC_DISABLE, 0)


def ioctl_period(fd: int, period: int) -> None:
    fcntl.ioctl(fd, IOC_PERIOD, struct.pack("<Q", period))


def ioctl_set_output(fd: int, target_fd: int) -> None:
    fcntl.ioctl(fd, IOC_SET_OUTPUT, target_fd)


def ioctl_id(fd: int) -> int:
    buf = bytearray(8)
    fcntl.ioctl(fd, IOC_ID, buf)
    return int(struct.unpack("<Q", buf)[0])


def read_counter(fd: int) -> tuple[int, int, int]:
    """(value, time_enabled, time_running) of an event opened with those read_format bits."""
    raw = os.read(fd, 24)
    if len(raw) < 24:
        raise OSError(errno.EIO, "short read from perf event")
    v, e, r = struct.unpack("<QQQ", raw)
    return int(v), int(e), int(r)


class RingBuffer:
    """The mmap'ed ring buffer of one event: a control page plus 2^n data pages."""

    def __init__(self, fd: int, data_pages: int) -> None:
        if data_pages & (data_pages - 1):
            raise ValueError("data_pages must be a power of two")
        self.fd = fd
        self._map = mmap.mmap(fd, (data_pages + 1) * PAGE_SIZE, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        off, size = struct.unpack_from("<QQ", self._map, MMAP_PAGE_DATA_OFFSET)
        self._data_off = int(off) or PAGE_SIZE
        self._size = int(size) or data_pages * PAGE_SIZE
        assert MMAP_PAGE_DATA_SIZE == MMAP_PAGE_DATA_OFFSET + 8

    @property
    def size(self) -> int:
        return self._size

    def pending(self) -> int:
        head, tail = struct.unpack_from("<QQ", self._map, MMAP_PAGE_DATA_HEAD)
        return int(head - tail)

    def read(self) -> bytes:
        """Everything written since the last read, in order; frees the space.

        x86-64 keeps loads in order and does not move stores before earlier
        loads, so reading data_head, copying, then writing data_tail needs no
        explicit barrier here (the kernel side has its own).
        """
        m = self._map
        (head,) = struct.unpack_from("<Q", m, MMAP_PAGE_DATA_HEAD)
        (tail,) = struct.unpack_from("<Q", m, MMAP_PAGE_DATA_TAIL)
        n = head - tail
        if n <= 0:
            return b""
        size = self._size
        base = self._data_off
        start = tail % size
        if start + n <= size:
            out = m[base + start : base + start + n]
        else:
            first = size - start
            out = m[base + start : base + size] + m[base : base + n - first]
        struct.pack_into("<Q", m, MMAP_PAGE_DATA_TAIL, head)
        return out

    def close(self) -> None:
        with contextlib.suppress(BufferError, ValueError):
            self._map.close()


def close_fd(fd: int) -> None:
    with contextlib.suppress(OSError):
        os.close(fd)
