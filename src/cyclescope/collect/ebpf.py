"""In-kernel aggregation of samples with eBPF (the program: collect/bpf/profile.bpf.c).

The program is attached to each sampling perf event and counts samples in kernel hash maps,
keyed by (process, ip, kernel or user, event, stack), instead of writing a record per sample: the
rings carry only the side records (mmaps, comms, forks, exits) and user space reads one row per
distinct key per drain. This module loads the program through libbpf, attaches it, flips the
generation the program fills, and reads the other generation's maps into numpy arrays.

libbpf is called through ctypes: there is no maintained Python binding of libbpf (BCC compiles
its programs at run time against the kernel's headers, which many kernels, this one among them,
do not ship), and the part used here is a dozen plain C functions. With `collect/kernel.py`
this is the only module that makes perf or BPF system calls.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from cyclescope.collect.timeline import TIMELINE_DTYPE
from cyclescope.errors import CycleScopeError

OBJECT = Path(__file__).parent / "bpf" / "profile.bpf.o"
# The same source with the stack walk by unwind rows (-g dwarf), loaded only when asked for: the
# kernel's verifier takes about 50 ms of CPU over it, 15-30 ms over the plain program.
OBJECT_UNWIND = Path(__file__).parent / "bpf" / "profile-unwind.bpf.o"
MAX_KERNEL = 32  # as profile.bpf.c
MAX_USER = 96
MAX_FRAMES = MAX_KERNEL + MAX_USER

KEY_DTYPE = np.dtype([("pid", "<u4"), ("event", "<u2"), ("kernel", "<u2"), ("ip", "<u8"), ("stack", "<u8")])
VAL_DTYPE = np.dtype([("count", "<u8"), ("period", "<u8"), ("last_ns", "<u8")])
MAX_PY = 32
TRACE_DTYPE = np.dtype([("nkernel", "<u4"), ("nuser", "<u4"), ("ip", "<u8", (MAX_FRAMES,)), ("npy", "<u4"),
                        ("pid", "<u4"), ("py", "<u8", (2 * MAX_PY,)), ("zero", "<u8")])
# Code objects copied as their process exits (profile.bpf.c's struct py_ckey, py_code): per code
# object, four ranges of the process's memory (the object's head, its names, its line table).
PY_CKEY_DTYPE = np.dtype([("pid", "<u4"), ("pad", "<u4"), ("code", "<u8")])
PY_CODE_CAPS = (256, 256, 512, 1024)  # CODE_HEAD, NAME_CAP, FILE_CAP, TABLE_CAP
PY_CODE_DTYPE = np.dtype([("addr", "<u8", (4,)), ("len", "<u4", (4,)),
                          *((f"r{i}", "u1", (cap,)) for i, cap in enumerate(PY_CODE_CAPS))])
PY_CODES = 8192  # py_codes' size (allocated as it fills: 2 KiB an entry)
PY_CODES_PREALLOC = 1024  # its size where the kernel needs it preallocated (before 6.1): 2 MiB
EXIT_TRACEPOINT = (b"sched", b"sched_process_exit")  # where the program copies them
EXEC_OBJECT = Path(__file__).parent / "bpf" / "exec.bpf.o"  # ExecWaker's
EXEC_TRACEPOINT = ("sched", "sched_process_exec")
TKEY_DTYPE = np.dtype([("pid", "<u4"), ("tid", "<u4"), ("window", "<u4"), ("event", "<u4")])
TVAL_DTYPE = np.dtype([("count", "<u8"), ("period", "<u8")])
WINDOW_NS = 100_000_000  # profile.bpf.c's timeline window
# profile.bpf.c's enum, in order
STATS = ("samples", "lost", "lost_stacks", "stack_errors", "lost_timeline", "uw_walks", "uw_frames", "uw_complete",
         "uw_fp", "uw_loading", "uw_cached", "py_exits", "py_codes", "py_codes_lost", "lc_sent", "lc_lost")
# Samples sent for loop counts (profile.bpf.c's struct lc_watch, lc_rec; collect/loopwatch.py reads them).
LC_NONE = 0xFFFFFFFF  # control.lc_event: no event's samples are sent
LC_RANGES = 16
LC_WATCHED, LC_FOLLOWER, LC_KERNEL = 1, 2, 4
LC_WATCH_DTYPE = np.dtype([("n", "<u4"), ("pad", "<u4"), ("r", "<u8", (LC_RANGES, 2))])
LC_WATCH_ENTRIES = 4096  # processes watched at once
LC_REC_DTYPE = np.dtype([("pid", "<u4"), ("tid", "<u4"), ("time", "<u8"), ("ip", "<u8"), ("period", "<u8"),
                         ("cpu", "<u4"), ("event", "<u2"), ("flags", "<u2"), ("regs", "<u8", (16,))])
# Unwinding in the kernel (profile.bpf.c's struct uw_row, uw_map, uw_proc; collect/bpfunwind.py fills them).
UW_ROW_DTYPE = np.dtype([("pc", "<u4"), ("cfa_off", "<i4"), ("bp_off", "<i2"), ("cfa", "u1"), ("bp", "u1")])
UW_MAPS = 64
UW_LOADING = 0xFFFFFFFF  # uw_map.first of an image whose rows are not loaded yet (count 0)
UW_MAP_DTYPE = np.dtype([("start", "<u8"), ("end", "<u8"), ("bias", "<u8"), ("first", "<u4"), ("count", "<u4")])
UW_PROC_DTYPE = np.dtype([("n", "<u4"), ("gen", "<u4"), ("m", UW_MAP_DTYPE, (UW_MAPS,))])

_BPF_PERF_EVENT = 41  # enum bpf_attach_type
_BPF_ANY = 0
_BPF_F_NO_PREALLOC = 1


class BpfUnavailable(CycleScopeError):
    """The eBPF path cannot run here (why, in one line); the perf ring path is used instead."""


class _LinkOpts(ctypes.Structure):  # struct bpf_link_create_opts (libbpf 1.x)
    _fields_ = [("sz", ctypes.c_size_t), ("flags", ctypes.c_uint32), ("iter_info", ctypes.c_void_p),
                ("iter_info_len", ctypes.c_uint32), ("target_btf_id", ctypes.c_uint32),
                ("bpf_cookie", ctypes.c_uint64), ("_rest", ctypes.c_uint64 * 3)]


class _BatchOpts(ctypes.Structure):  # struct bpf_map_batch_opts
    _fields_ = [("sz", ctypes.c_size_t), ("elem_flags", ctypes.c_uint64), ("flags", ctypes.c_uint64)]


_PRINT_FN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p)


class _Lib:
    """libbpf's functions that are used, with their signatures; libbpf's messages (the verifier's
    log among them) go to ``messages`` instead of stderr."""

    def __init__(self) -> None:
        name = ctypes.util.find_library("bpf") or "libbpf.so.1"
        try:
            lib = ctypes.CDLL(name, use_errno=True)
        except OSError as e:
            raise BpfUnavailable(f"libbpf is not installed ({e})") from None
        libc = ctypes.CDLL(None)
        self.messages: list[str] = []
        buf = ctypes.create_string_buffer(4096)

        def on_print(level: int, fmt: bytes, args: int) -> int:
            # va_list is passed by reference on x86-64: libc's vsnprintf formats it.
            libc.vsnprintf(buf, ctypes.c_size_t(len(buf)), ctypes.c_char_p(fmt), ctypes.c_void_p(args))
            self.messages.append(buf.value.decode(errors="replace").rstrip())
            del self.messages[:-200]
            return 0

        self._print = _PRINT_FN(on_print)  # kept alive as long as libbpf may call it
        lib.libbpf_set_print(self._print)
        vp, i, u32 = ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32
        for fn, res, args in (
            ("bpf_object__open_mem", vp, [vp, ctypes.c_size_t, vp]),
            ("bpf_object__load", i, [vp]),
            ("bpf_object__close", None, [vp]),
            ("bpf_object__find_map_by_name", vp, [vp, ctypes.c_char_p]),
            ("bpf_object__find_program_by_name", vp, [vp, ctypes.c_char_p]),
            ("bpf_map__set_max_entries", i, [vp, u32]),
            ("bpf_map__set_map_flags", i, [vp, u32]),
            ("bpf_map__map_flags", u32, [vp]),
            ("bpf_map__fd", i, [vp]),
            ("bpf_program__fd", i, [vp]),
            ("bpf_program__set_autoload", i, [vp, ctypes.c_bool]),
            ("bpf_link_create", i, [i, i, i, ctypes.POINTER(_LinkOpts)]),
            ("bpf_map_update_elem", i, [i, vp, vp, ctypes.c_uint64]),
            ("bpf_map_lookup_elem", i, [i, vp, vp]),
            ("bpf_map_delete_elem", i, [i, vp]),
            ("bpf_map_lookup_and_delete_batch", i, [i, vp, vp, vp, vp, ctypes.POINTER(u32),
                                                    ctypes.POINTER(_BatchOpts)]),
            ("bpf_map_lookup_batch", i, [i, vp, vp, vp, vp, ctypes.POINTER(u32), ctypes.POINTER(_BatchOpts)]),
            ("bpf_map_delete_batch", i, [i, vp, ctypes.POINTER(u32), ctypes.POINTER(_BatchOpts)]),
            ("bpf_map_update_batch", i, [i, vp, vp, ctypes.POINTER(u32), ctypes.POINTER(_BatchOpts)]),
            ("libbpf_get_error", ctypes.c_long, [vp]),
        ):
            f = getattr(lib, fn)
            f.restype, f.argtypes = res, args
        self.lib = lib

    def last_message(self) -> str:
        """libbpf's last non-empty message (the verifier's last line when loading failed)."""
        return next((m for m in reversed(self.messages) if m.strip()), "")


_lib: _Lib | None = None


def _libbpf() -> _Lib:
    global _lib
    if _lib is None:
        _lib = _Lib()
    return _lib


@dataclass
class Drained:
    """One generation's aggregated samples: one row per distinct key, and the stacks they name."""

    keys: np.ndarray  # KEY_DTYPE
    values: np.ndarray  # VAL_DTYPE
    # hash -> (kernel frames, user frames, Python frames as (code object, instruction) pairs flat)
    stacks: dict[int, tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]]
    timeline: np.ndarray  # TIMELINE_DTYPE


def load(entries: int, stack_entries: int, unwind_rows: int = 0, unwind_procs: int = 0) -> BpfAggregator:
    """The program loaded with maps that allocate as they fill where the kernel allows it (6.1),
    else preallocated; with the exit tracepoint's program where the kernel takes it, else without
    (BpfAggregator.exit_error says why)."""
    try:
        return BpfAggregator(entries, stack_entries, unwind_rows=unwind_rows, unwind_procs=unwind_procs)
    except BpfUnavailable as e:
        if "not permitted" in str(e):
            raise
        first = e
    for prealloc, exits in ((True, True), (False, False), (True, False)):
        try:
            agg = BpfAggregator(entries, stack_entries, prealloc=prealloc, exits=exits, unwind_rows=unwind_rows,
                                unwind_procs=unwind_procs)
        except BpfUnavailable:
            continue
        if not exits:
            agg.exit_error = f"the kernel refused the exit tracepoint's program ({first})"
        return agg
    raise first


class _BpfObject:
    """A BPF object opened through libbpf, and the links and perf events its programs run from
    (closed together, the links first)."""

    _obj: int | None = None
    _links: list[int]
    _events: list[int]

    def _open(self, path: Path) -> int:
        """Open the object at ``path`` (not loaded yet)."""
        if not path.is_file():
            raise BpfUnavailable(f"{path} is missing (scripts/build-bpf builds it)")
        self._l = _libbpf()
        self._links = []
        self._events = []  # tracepoints' perf events that programs are linked to
        data = path.read_bytes()
        self._data = ctypes.create_string_buffer(data, len(data))  # kept alive with the object
        obj = self._l.lib.bpf_object__open_mem(self._data, len(data), None)
        if not obj or self._l.lib.libbpf_get_error(obj):
            raise BpfUnavailable(f"libbpf could not open {path.name}: {self._l.last_message()}")
        self._obj = obj
        return int(obj)

    def _attach_to_tracepoint(self, prog: int, group: str, name: str) -> str | None:
        """Link the program ``prog`` to a perf event of tracepoint ``group``:``name`` (its id read by
        kernel.tracepoint_id, which mounts tracefs privately where it is not mounted: libbpf's
        bpf_program__attach_tracepoint fails there); why not, or None."""
        from cyclescope.collect import kernel

        tp = kernel.tracepoint_id(group, name)
        if tp is None:
            return f"attaching to {group}:{name} failed: {kernel.no_tracepoint(group, name)}"
        try:
            pfd = kernel.open_tracepoint(tp, f"tracepoint {group}:{name}")
        except kernel.PerfOpenError as e:
            return f"attaching to {group}:{name} failed: {e}"
        try:
            self._link(self._l.lib.bpf_program__fd(prog), pfd)
        except OSError as e:
            kernel.close_fd(pfd)
            return f"attaching to {group}:{name} failed: {e.strerror}"
        kernel.ioctl_enable(pfd)
        self._events.append(pfd)
        return None

    def _link(self, prog_fd: int, perf_fd: int, cookie: int = 0) -> None:
        """Run the program ``prog_fd`` at each hit of ``perf_fd`` (the link kept in _links;
        ``cookie``: what bpf_get_attach_cookie gives the program). OSError where the kernel refuses."""
        opts = _LinkOpts(sz=ctypes.sizeof(_LinkOpts), bpf_cookie=cookie)
        fd = self._l.lib.bpf_link_create(prog_fd, perf_fd, _BPF_PERF_EVENT, ctypes.byref(opts))
        if fd < 0:
            err = -fd if fd < -1 else ctypes.get_errno()
            raise OSError(err, os.strerror(err))
        self._links.append(fd)

    def close(self) -> None:
        for fd in (*getattr(self, "_links", ()), *getattr(self, "_events", ())):
            os.close(fd)
        self._links, self._events = [], []
        if self._obj is not None:
            self._l.lib.bpf_object__close(self._obj)
            self._obj = None

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()


class BpfAggregator(_BpfObject):
    """The loaded program and its maps. ``entries``: the most distinct keys one generation holds
    (samples beyond it are counted as lost); ``stack_entries``: the most distinct stacks (0: no
    stacks); ``unwind_rows``, ``unwind_procs``: room for the unwind rows of the images and for the
    processes whose user stacks the program walks with them (0: frame pointers only). Rows are an
    array, allocated whole at load (12 bytes each, rounded to 16). ``exits``: load the program of
    the exit tracepoint (Python code objects copied as their process exits; with stacks only)."""

    def __init__(self, entries: int = 1 << 16, stack_entries: int = 0, prealloc: bool = False,
                 unwind_rows: int = 0, unwind_procs: int = 0, exits: bool = True) -> None:
        if os.uname().machine != "x86_64":
            raise BpfUnavailable(f"the BPF program reads x86-64 registers; this machine is {os.uname().machine}")
        unwind = unwind_rows > 0 and unwind_procs > 0 and stack_entries > 0
        obj_path = OBJECT_UNWIND if unwind else OBJECT
        obj = self._open(obj_path)
        lib = self._l.lib
        try:
            for name in ("counts0", "counts1"):
                lib.bpf_map__set_max_entries(self._map(name), entries)
            lib.bpf_map__set_max_entries(self._map("lc_watch"), LC_WATCH_ENTRIES)
            lib.bpf_map__set_max_entries(self._map("lc_out"), _possible_cpus())
            for name in ("timeline0", "timeline1"):
                lib.bpf_map__set_max_entries(self._map(name), max(1 << 12, entries // 4))
            for name in ("stacks0", "stacks1"):
                lib.bpf_map__set_max_entries(self._map(name), max(1, stack_entries))
            lib.bpf_map__set_max_entries(self._map("uw_rows"), unwind_rows if unwind else 1)
            lib.bpf_map__set_max_entries(self._map("uw_procs"), unwind_procs if unwind else 1)
            lib.bpf_map__set_max_entries(self._map("uw_slots"), unwind_procs if unwind else 1)
            exit_prog = lib.bpf_object__find_program_by_name(obj, b"cyclescope_exit")
            exits = exits and stack_entries > 0 and bool(exit_prog)
            # Code objects copied at exits, and module bodies' copied at samples (with stacks).
            codes = self._map("py_codes")
            lib.bpf_map__set_max_entries(codes, (PY_CODES_PREALLOC if prealloc else PY_CODES) if stack_entries else 1)
            if prealloc:  # the sampling program writes it: before 6.1 only a preallocated map will do
                lib.bpf_map__set_map_flags(codes, lib.bpf_map__map_flags(codes) & ~_BPF_F_NO_PREALLOC)
            if exit_prog and not exits:
                lib.bpf_program__set_autoload(exit_prog, False)
            if not prealloc:
                # Since Linux 6.1 a perf_event program may use hash maps that allocate as they
                # fill (bpf_mem_alloc, safe in NMI): kernel memory then follows the distinct keys,
                # not the sizes above (64 MiB of stacks, preallocated). Older kernels refuse it.
                for name in ("counts0", "counts1", "stacks0", "stacks1", "timeline0", "timeline1", "uw_slots",
                             "lc_watch"):
                    m = self._map(name)
                    lib.bpf_map__set_map_flags(m, lib.bpf_map__map_flags(m) | _BPF_F_NO_PREALLOC)
            if lib.bpf_object__load(obj):
                err = ctypes.get_errno()
                why = self._l.last_message() or os.strerror(err)
                if err == errno.EPERM:
                    why = "not permitted (loading BPF programs needs root or CAP_BPF and CAP_PERFMON)"
                raise BpfUnavailable(f"the kernel refused the BPF program: {why}")
            prog = lib.bpf_object__find_program_by_name(obj, b"cyclescope_sample")
            self.prog_fd = lib.bpf_program__fd(prog)
            self.fds = {n: lib.bpf_map__fd(self._map(n)) for n in
                        ("control", "stats", "counts0", "counts1", "stacks0", "stacks1", "timeline0", "timeline1",
                         "py_procs", "py_codes", "uw_slots", "uw_procs", "uw_rows", "lc_watch", "lc_out")}
            # Python code objects copied as their process exits: where the kernel runs the exit
            # tracepoint before the process's memory goes and says whether the thread group died
            # (6.18 here). Where the tracepoint has no group_dead the attach is refused, and a
            # process that exits before a drain names its frames keeps none.
            self.exit_error: str | None = "no stacks: no Python frames" if not exits else None
            if exits:
                self.exit_error = self._attach_to_tracepoint(exit_prog, *(p.decode() for p in EXIT_TRACEPOINT))
        except BaseException:
            self.close()
            raise
        self.entries = entries
        self.timeline_entries = max(1 << 12, entries // 4)
        self.stack_entries = stack_entries
        self.unwind_rows = unwind_rows if unwind else 0
        self.unwind_procs = unwind_procs if unwind else 0
        self.prealloc = prealloc
        self.gen = 0
        self._ncpus = _possible_cpus()
        self._bufs: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # per map: _take's batch buffers
        self._held: tuple[int, np.ndarray] | None = None  # the stacks map and keys the last drain read
        self._describes = 0  # describe_unwind calls: each description's generation
        self.loop_event = LC_NONE  # the event whose watched samples go to the loop outputs
        self.loop_every = 1  # watched in one timeline window in this many
        self._set_control()

    def _map(self, name: str) -> int:
        m = self._l.lib.bpf_object__find_map_by_name(self._obj, name.encode())
        if not m:
            raise BpfUnavailable(f"{OBJECT.name} has no map {name} (rebuild it with scripts/build-bpf)")
        return int(m)

    def _set_control(self) -> None:
        key = ctypes.c_uint32(0)
        val = (ctypes.c_uint32 * 4)(self.gen, 1 if self.stack_entries else 0, self.loop_event, self.loop_every)
        if self._l.lib.bpf_map_update_elem(self.fds["control"], ctypes.byref(key), val, _BPF_ANY):
            raise OSError(ctypes.get_errno(), "updating the BPF program's control map")

    def attach(self, perf_fd: int, event: int) -> None:
        """Run the program at each overflow of ``perf_fd``, counting its samples as event ``event``."""
        try:
            self._link(self.prog_fd, perf_fd, event)
        except OSError as e:
            raise BpfUnavailable(f"attaching the BPF program to a perf event failed: {e.strerror}") from None

    def send_loop_samples(self, event: int, outputs: dict[int, int], every: int = 1) -> None:
        """Have the program send the samples of event ``event`` that the loop counter needs (those
        in the ranges watch_loops gives, and the next sample on their CPU) to the BPF output event
        of their CPU (``outputs``: CPU -> fd of kernel.open_bpf_output), in one window of the
        timeline's (100 ms) in ``every``."""
        for cpu, fd in outputs.items():
            key, val = ctypes.c_uint32(cpu), ctypes.c_uint32(fd)
            if self._l.lib.bpf_map_update_elem(self.fds["lc_out"], ctypes.byref(key), ctypes.byref(val), _BPF_ANY):
                raise OSError(ctypes.get_errno(), f"giving the BPF program CPU {cpu}'s output event")
        self.loop_event = event
        self.loop_every = max(1, int(every))
        self._set_control()

    def watch_loops(self, pid: int, ranges: list[tuple[int, int]]) -> None:
        """The address ranges of ``pid`` whose samples go to the loop outputs (at most LC_RANGES;
        an empty list: none)."""
        if not ranges:
            self.unwatch_loops(pid)
            return
        val = np.zeros(1, LC_WATCH_DTYPE)
        val["n"] = min(len(ranges), LC_RANGES)
        val["r"][0, : val["n"][0]] = ranges[:LC_RANGES]
        key = ctypes.c_uint32(pid)
        if self._l.lib.bpf_map_update_elem(self.fds["lc_watch"], ctypes.byref(key), val.ctypes.data, _BPF_ANY):
            raise OSError(ctypes.get_errno(), "giving the BPF program a process's loop ranges")

    def unwatch_loops(self, pid: int) -> None:
        key = ctypes.c_uint32(pid)
        self._l.lib.bpf_map_delete_elem(self.fds["lc_watch"], ctypes.byref(key))

    def set_python(self, pid: int, cfg: bytes) -> None:
        """Describe a CPython process to the program (collect/pyframes.py: struct py_proc)."""
        key = ctypes.c_uint32(pid)
        val = ctypes.create_string_buffer(cfg, len(cfg))
        if self._l.lib.bpf_map_update_elem(self.fds["py_procs"], ctypes.byref(key), val, _BPF_ANY):
            raise OSError(ctypes.get_errno(), "describing a Python process to the BPF program")

    def forget_python(self, pid: int) -> None:
        key = ctypes.c_uint32(pid)
        self._l.lib.bpf_map_delete_elem(self.fds["py_procs"], ctypes.byref(key))

    def write_rows(self, first: int, rows: np.ndarray) -> None:
        """Unwind rows (UW_ROW_DTYPE) into uw_rows from index ``first``."""
        if first < 0 or first + len(rows) > self.unwind_rows:
            raise ValueError(f"rows {first}..{first + len(rows)} outside the program's {self.unwind_rows}")
        if not len(rows):
            return
        keys = np.arange(first, first + len(rows), dtype=np.uint32)
        vals = np.ascontiguousarray(rows, UW_ROW_DTYPE)
        opts = _BatchOpts(sz=ctypes.sizeof(_BatchOpts))
        n = ctypes.c_uint32(len(rows))
        if self._l.lib.bpf_map_update_batch(self.fds["uw_rows"], keys.ctypes.data, vals.ctypes.data,
                                            ctypes.byref(n), ctypes.byref(opts)):
            raise OSError(ctypes.get_errno(), "writing unwind rows to the BPF program")

    def describe_unwind(self, pid: int, slot: int, proc: np.ndarray) -> None:
        """Have the program walk ``pid``'s user stacks with the mappings ``proc`` (UW_PROC_DTYPE),
        kept in uw_procs[slot]."""
        if not 0 <= slot < self.unwind_procs:
            raise ValueError(f"slot {slot} outside the program's {self.unwind_procs}")
        key = ctypes.c_uint32(slot)
        val = np.array(proc, UW_PROC_DTYPE).reshape(1)
        # A number no description had before: the program's cache of rows found is keyed by it.
        self._describes += 1
        val["gen"] = self._describes & 0xFFFFFFFF
        if self._l.lib.bpf_map_update_elem(self.fds["uw_procs"], ctypes.byref(key), val.ctypes.data, _BPF_ANY):
            raise OSError(ctypes.get_errno(), "describing a process's mappings to the BPF program")
        pkey, sval = ctypes.c_uint32(pid), ctypes.c_uint32(slot)
        if self._l.lib.bpf_map_update_elem(self.fds["uw_slots"], ctypes.byref(pkey), ctypes.byref(sval), _BPF_ANY):
            raise OSError(ctypes.get_errno(), "describing a process to the BPF program")

    def forget_unwind(self, pid: int) -> None:
        key = ctypes.c_uint32(pid)
        self._l.lib.bpf_map_delete_elem(self.fds["uw_slots"], ctypes.byref(key))

    def flip(self) -> int:
        """Make the program fill the other generation; returns the one it filled until now."""
        old = self.gen
        self.gen ^= 1
        self._set_control()
        return old

    def drain(self) -> Drained:
        """Flip generations and empty the one just left. A sample the program was counting on
        another CPU while the generation flipped may land in the emptied maps after this read: it
        is read two drains later, never lost; its stack, if that was read (and deleted) now, is
        looked up in the stacks kept from this drain (``Drained.stacks`` of the caller's previous
        call: the caller keeps one drain of them).

        The stacks read stay in the program's map until release_stacks (at the latest, the next
        drain, before it flips back to them): a Python process that exits while the caller names
        their frames finds them there, and its exit program copies their code objects
        (pyframes.py's _take_late)."""
        self.release_stacks()
        old = self.flip()
        keys, vals = self._take(self.fds[f"counts{old}"], KEY_DTYPE, VAL_DTYPE, self.entries)
        stacks: dict[int, tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]] = {}
        if self.stack_entries:
            fd = self.fds[f"stacks{old}"]
            hk, tr = self._take(fd, np.dtype("<u8"), TRACE_DTYPE, self.stack_entries, delete=False)
            self._held = (fd, hk)
            for h, nk, nu, npy, ips, py in zip(hk.tolist(), tr["nkernel"].tolist(), tr["nuser"].tolist(),
                                               tr["npy"].tolist(), tr["ip"], tr["py"], strict=True):
                stacks[h] = (tuple(ips[: nk // 8].tolist()), tuple(ips[MAX_KERNEL : MAX_KERNEL + nu // 8].tolist()),
                             tuple(py[: 2 * min(npy, MAX_PY)].tolist()))
        tk, tv = self._take(self.fds[f"timeline{old}"], TKEY_DTYPE, TVAL_DTYPE, self.timeline_entries)
        tl = np.zeros(len(tk), TIMELINE_DTYPE)
        tl["pid"], tl["tid"], tl["event"] = tk["pid"], tk["tid"], tk["event"]
        tl["window_ns"] = tk["window"].astype(np.uint64) * np.uint64(WINDOW_NS)
        tl["count"], tl["period"] = tv["count"], tv["period"]
        return Drained(keys, vals, stacks, tl)

    def release_stacks(self) -> None:
        """Delete from the program's map the stacks the last drain read (drain says why they
        stayed)."""
        held, self._held = self._held, None
        if held is None or not len(held[1]):
            return
        fd, keys = held
        keys = np.ascontiguousarray(keys)
        opts = _BatchOpts(sz=ctypes.sizeof(_BatchOpts))
        done = 0
        while done < len(keys):
            n = ctypes.c_uint32(len(keys) - done)
            rc = self._l.lib.bpf_map_delete_batch(fd, keys[done:].ctypes.data, ctypes.byref(n), ctypes.byref(opts))
            err = ctypes.get_errno() if rc else 0
            done += n.value
            if rc and err == errno.ENOENT:
                done += 1  # not there (nothing else deletes them): the rest still go
            elif rc:
                raise OSError(err, f"emptying the BPF program's stacks: {os.strerror(err)}")

    def _take(self, fd: int, kdt: np.dtype, vdt: np.dtype, capacity: int,
              delete: bool = True) -> tuple[np.ndarray, np.ndarray]:
        """Every entry of a hash map, deleted as read (bpf_map_lookup_and_delete_batch) unless
        ``delete`` is false, through buffers kept per map: fresh ones (np.zeros of up to 8,192
        stacks, 12 MiB) cost a page fault per 4 KiB at every drain, the largest part of reading
        the stacks."""
        bufs = self._bufs.get(fd)
        if bufs is None:
            step = max(1, min(capacity, 8192, (2 << 20) // max(1, vdt.itemsize)))
            bufs = self._bufs[fd] = (np.zeros(step, kdt), np.zeros(step, vdt))
        ks, vs = bufs
        step = len(ks)
        kparts, vparts = [], []
        in_b = ctypes.create_string_buffer(max(8, kdt.itemsize))
        out_b = ctypes.create_string_buffer(max(8, kdt.itemsize))
        opts = _BatchOpts(sz=ctypes.sizeof(_BatchOpts))
        first = True
        while True:
            n = ctypes.c_uint32(step)
            batch = self._l.lib.bpf_map_lookup_and_delete_batch if delete else self._l.lib.bpf_map_lookup_batch
            rc = batch(fd, None if first else in_b, out_b, ks.ctypes.data, vs.ctypes.data, ctypes.byref(n),
                       ctypes.byref(opts))
            err = ctypes.get_errno() if rc else 0
            if n.value:
                kparts.append(ks[: n.value].copy())
                vparts.append(vs[: n.value].copy())
            if rc and err == errno.ENOENT:
                break  # the end of the map
            if rc:
                raise OSError(err, f"reading the BPF program's counts: {os.strerror(err)}")
            ctypes.memmove(in_b, out_b, len(in_b))
            first = False
        if not kparts:
            return np.zeros(0, kdt), np.zeros(0, vdt)
        if len(kparts) == 1:  # copied already: concatenate would copy again
            return kparts[0], vparts[0]
        return np.concatenate(kparts), np.concatenate(vparts)

    def take_codes(self) -> tuple[np.ndarray, np.ndarray]:
        """The code objects copied since the last call, at exits and (module bodies) at samples
        (PY_CKEY_DTYPE, PY_CODE_DTYPE), deleted from the program's map."""
        if not self.stack_entries:
            return np.zeros(0, PY_CKEY_DTYPE), np.zeros(0, PY_CODE_DTYPE)
        return self._take(self.fds["py_codes"], PY_CKEY_DTYPE, PY_CODE_DTYPE,
                          PY_CODES_PREALLOC if self.prealloc else PY_CODES)

    def stats(self) -> dict[str, int]:
        """The program's counters since it was loaded, summed over CPUs."""
        out = {}
        for i, name in enumerate(STATS):
            key = ctypes.c_uint32(i)
            vals = (ctypes.c_uint64 * self._ncpus)()
            if self._l.lib.bpf_map_lookup_elem(self.fds["stats"], ctypes.byref(key), vals):
                raise OSError(ctypes.get_errno(), "reading the BPF program's statistics")
            out[name] = int(sum(vals))
        return out

class ExecWaker(_BpfObject):
    """exec.bpf.c loaded and attached to sched_process_exec: at each exec of a program whose
    executable file's name holds "python" (a script's interpreter, a link's target), the process's
    pid goes to the ring of its CPU's BPF output event (``outputs``: CPU -> the fd of
    kernel.open_bpf_output_waker). Raises BpfUnavailable where it cannot run (no libbpf, a kernel
    without BTF, which the object is relocated against, or no tracepoint)."""

    def __init__(self, outputs: dict[int, int]) -> None:
        obj = self._open(EXEC_OBJECT)
        lib = self._l.lib
        try:
            if lib.bpf_object__load(obj):
                why = self._l.last_message() or os.strerror(ctypes.get_errno())
                raise BpfUnavailable(f"the kernel refused the exec waker: {why}")
            wake = lib.bpf_object__find_map_by_name(obj, b"wake")
            prog = lib.bpf_object__find_program_by_name(obj, b"cyclescope_exec")
            if not wake or not prog:
                raise BpfUnavailable(f"{EXEC_OBJECT.name} has no wake map or program (rebuild it)")
            wake_fd = lib.bpf_map__fd(wake)
            for cpu, fd in outputs.items():
                key, val = ctypes.c_uint32(cpu), ctypes.c_uint32(fd)
                if lib.bpf_map_update_elem(wake_fd, ctypes.byref(key), ctypes.byref(val), _BPF_ANY):
                    raise BpfUnavailable(f"the exec waker's ring on CPU {cpu}: {os.strerror(ctypes.get_errno())}")
            failed = self._attach_to_tracepoint(prog, *EXEC_TRACEPOINT)
            if failed is not None:
                raise BpfUnavailable(failed)
        except BaseException:
            self.close()
            raise


def _possible_cpus() -> int:
    """Per-CPU map values come one per possible CPU (not online: /sys/devices/system/cpu/possible)."""
    from cyclescope.collect.session import parse_cpu_list

    return max(parse_cpu_list(Path("/sys/devices/system/cpu/possible").read_text())) + 1


@dataclass
class Rows:
    """A drain's aggregated samples in the shape the collection loop maps and counts: one row of
    records.SAMPLE_DTYPE per key (its time is the key's last sample, so that mmaps and execs
    apply in order), with the samples and summed period each row stands for."""

    samples: np.ndarray
    event: np.ndarray  # int64
    count: np.ndarray  # uint64
    period: np.ndarray  # float64
    chains: list[tuple[int, ...] | None] | None  # perf-style callchains (None: no stacks asked)
    timeline: np.ndarray  # TIMELINE_DTYPE: samples per thread and window
    python: list[tuple[int, ...]] | None = None  # per row: its Python frames' (code, instruction) pairs


def to_rows(d: Drained, stacks: bool,
            older: dict[int, tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]] | None = None) -> Rows:
    """``d`` as rows; stack hashes resolve in ``d.stacks``, then in ``older`` (the previous
    drain's, for a sample counted while the generations flipped). A stack found in neither (the
    stack map was full) leaves the sampled ip alone, as a callchain that could not be walked."""
    from cyclescope.perf.abi import MISC_KERNEL, MISC_USER, PERF_CONTEXT_KERNEL, PERF_CONTEXT_USER
    from cyclescope.perf.records import SAMPLE_DTYPE

    k, v = d.keys, d.values
    n = len(k)
    s = np.zeros(n, SAMPLE_DTYPE)
    s["ip"] = k["ip"]
    s["pid"] = k["pid"].astype(np.int32)
    s["tid"] = s["pid"]
    s["time"] = v["last_ns"]
    s["cpumode"] = np.where(k["kernel"] != 0, MISC_KERNEL, MISC_USER)
    s["extra"] = -1
    s["regs"] = -1
    chains: list[tuple[int, ...] | None] | None = None
    python: list[tuple[int, ...]] | None = None
    if stacks:
        chains = []
        python = []
        old = older or {}
        for h in k["stack"].tolist():
            st = d.stacks.get(h) or old.get(h)
            if st is None:
                chains.append(None)
                python.append(())
                continue
            kf, uf, pf = st
            python.append(pf)
            chain: tuple[int, ...] = ()
            if kf:
                chain = (PERF_CONTEXT_KERNEL, *kf)
            if uf:
                chain = (*chain, PERF_CONTEXT_USER, *uf)
            chains.append(chain)
    return Rows(s, k["event"].astype(np.int64), v["count"].copy(), v["period"].astype(np.float64), chains,
                d.timeline, python if python is not None and any(python) else None)
