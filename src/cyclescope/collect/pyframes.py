"""Python frames of CPython 3.10-3.13 processes, read from the interpreter's memory by the eBPF
program at each sample (collect/bpf/profile.bpf.c) and named here.

For each process whose image is a CPython 3.10, 3.11, 3.12 or 3.13 interpreter (libpython3.X or a
pythonX.Y executable with `_PyRuntime`), the program is told where the interpreter's thread
states start and the offsets of the fields it reads: at a sample it finds the sampled thread's
state (by native_thread_id; in 3.10, which has none, by the tid in glibc's struct pthread that
its thread_id points at), walks its frames (_PyInterpreterFrame, skipping 3.12+'s shim frames;
3.10's PyFrameObject) and keeps each frame's code object and instruction pointer (3.10: its
instruction index) with the stack. Here each code object is read once per process
(process_vm_readv: its qualified name, file, first line and line table) and each frame becomes a
frame of a per-process image of kind "python": one symbol per code object (`py::qualname:file`,
as CPython's perf maps name them; 3.10's code objects have no qualified name, only the
function's) and the frame's line as its offset in that symbol. No running Python code is needed:
processes started without `-X perf`, and 3.10 and 3.11 which have no such option, get their
Python frames.

Each kept code object carries a tag (bits 48-63: a hash of its first line and the field after
it), so that a code object freed and another made at its address (the start-up's compiled strings)
are two objects here, each read once; one whose tag no longer matches what is at its address is
not named.

A process that exits before the drain that would read its new code objects (a script of a fraction
of a second: its first drain with Python frames comes 50 ms after it is described) had its frames
go unnamed. The program's exit tracepoint copies, as the process exits, the ranges of memory that
reading a code object looks at (the object's head, its names, its line table) for the code
objects in its stacks not read yet; user space takes them at the next drain and reads the same
bytes from them (CapturedMemory) where the process can no longer be read. One that exits while a
drain names its frames (after the drain took the copies) is covered too: the drain's stacks stay
in the program's map until they are named, so its exit finds them, and the first code object of
it that cannot be read makes the drain take the copies again (_take_late).

In the stored stack the Python frames replace the interpreter's C frames from the innermost
evaluation loop (`_PyEval_EvalFrameDefault`) outwards: the C code a Python function called stays
below it. Where the native walk did not reach the evaluation loop (an interpreter built without
frame pointers), only the sampled function is kept below the Python frames.

The offsets are those of x86-64 release builds, from offsetof() against each version's internal
headers (`scripts/python-offsets PREFIX` prints them); py-spy and austin carry the same
knowledge. CPython 3.14 publishes them in _Py_DebugOffsets; it is not handled yet.
"""

from __future__ import annotations

import bisect
import os
import struct
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import chain, compress
from operator import itemgetter
from typing import TYPE_CHECKING, NamedTuple, cast

from cyclescope.collect.helpers import is_helper
from cyclescope.collect.procmem import ProcessMemory
from cyclescope.collect.pycommand import PY_IMAGE

if TYPE_CHECKING:
    import threading

    import numpy as np

    from cyclescope.collect.ebpf import BpfAggregator, ExecWaker
    from cyclescope.collect.kernel import RingBuffer
    from cyclescope.images.elf import SymbolTable
    from cyclescope.images.maps import Mapper
    from cyclescope.images.registry import ImageTable
    from cyclescope.perf.records import SideRecord

# offsetof() in CPython's structures (x86-64, release builds), per (major, minor).
# 3.10: frame_instr is f_lasti (an int, in code units), code_qualname is co_name, code_adaptive
# the size of the code object (the head read), frame_owner -1 (no shim frames). frame_entry: 3.11's
# is_entry (the outermost frame of a run of the evaluation loop); 3.12 and 3.13 mark a run's end
# with a shim frame, and in 3.10 every frame is a run of its own.
OFFSETS: dict[tuple[int, int], dict[str, int]] = {
    (3, 10): dict(runtime_interpreters_head=32, interp_threads_head=8, tstate_next=8, tstate_tid=176,
                  tstate_cframe=-1, current_frame=24, frame_code=32, frame_instr=96, frame_previous=24,
                  frame_owner=-1, frame_entry=-1, code_adaptive=176, code_qualname=112,
                  code_filename=104, code_firstlineno=40, code_linetable=120, bytes_size=16,
                  bytes_sval=32, unicode_state=32, unicode_length=16, ascii_size=48, compact_size=72),
    (3, 11): dict(runtime_interpreters_head=40, interp_threads_head=16, tstate_next=8, tstate_tid=160,
                  tstate_cframe=56, current_frame=8, frame_code=32, frame_instr=56, frame_previous=48,
                  frame_owner=69, frame_entry=68, code_adaptive=184, code_qualname=128,
                  code_filename=112, code_firstlineno=72, code_linetable=136, bytes_size=16,
                  bytes_sval=32, unicode_state=32, unicode_length=16, ascii_size=48, compact_size=72),
    (3, 12): dict(runtime_interpreters_head=40, interp_threads_head=72, tstate_next=8, tstate_tid=144,
                  tstate_cframe=56, current_frame=0, frame_code=0, frame_instr=56, frame_previous=8,
                  frame_owner=70, frame_entry=-1, code_adaptive=192, code_qualname=128,
                  code_filename=112, code_firstlineno=68, code_linetable=136, bytes_size=16,
                  bytes_sval=32, unicode_state=32, unicode_length=16, ascii_size=40, compact_size=56),
    (3, 13): dict(runtime_interpreters_head=632, interp_threads_head=7344, tstate_next=8, tstate_tid=160,
                  tstate_cframe=-1, current_frame=72, frame_code=0, frame_instr=56, frame_previous=8,
                  frame_owner=70, frame_entry=-1, code_adaptive=200, code_qualname=128,
                  code_filename=112, code_firstlineno=68, code_linetable=136, bytes_size=16,
                  bytes_sval=32, unicode_state=32, unicode_length=16, ascii_size=40, compact_size=56),
}
SLOT_BITS = 24  # a code object's range in its process's image: offset = slot << SLOT_BITS | line
EVAL = "_PyEval_EvalFrameDefault"
PY_PROC = struct.Struct("<Q22I")  # profile.bpf.c's struct py_proc
NO_OFFSET = 0xFFFFFFFF
PY_ENTRY = 1  # profile.bpf.c's: bit 0 of a frame's code object marks a run's outermost frame
PY_ADDR = (1 << 48) - 1  # and bits 48-63 are its tag (code_tag): the rest is its address
PTHREAD_TID = 0x2D0  # offsetof(struct pthread, tid) in glibc on x86-64, checked per process
MAX_CODE_BYTES = 1 << 16
FRAME_CACHE_MAX = 1 << 18  # (code object, instruction) frames kept per process (then forgotten at once)
WAIT_INIT_S = 5.0  # how long a process mapping an interpreter is watched for its runtime to start
MAX_START_PROBES = 16  # interpreter files whose programs' starts wake the collector (system-wide)
PERF_REG_IP = 8  # enum perf_event_x86_regs
START = "Py_InitializeFromConfig"  # where a process's interpreter starts (PEP 587, 3.8+)
EXEC_FILTER = 'filename ~ "*python*" || filename ~ "*.py"'  # execs that wake the collector (watch_execs)
EXEC_WATCH_S = 0.05  # a python exec'd is looked for in the side records for this long at most


def code_tag(head: bytes, at: int) -> int:
    """profile.bpf.c's code_tag of a code object from its head: 16 bits of a hash of the 8 bytes
    at its first line, in bits 48-63. A code object at an address that held another one before
    (freed) has another tag, and is read anew."""
    v = int.from_bytes(head[at : at + 8], "little")
    return ((v * 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF) >> 48 << 48


def frame_span(o: dict[str, int]) -> int:
    """The bytes from a frame's start that hold every field the program reads of it (it copies
    them at once): 70-71 from 3.11 on, 104 in 3.10."""
    return max(o["frame_code"] + 8, o["frame_instr"] + 8, o["frame_previous"] + 8, o["frame_owner"] + 1,
               o["frame_entry"] + 1)


def interpreter_version(path: str) -> tuple[int, int] | None:
    """The CPython version of an interpreter image's path (libpython3.X or python3.X), when its
    frames are read (OFFSETS)."""
    m = PY_IMAGE.search(path)
    version = (3, int(m.group(1))) if m is not None else None
    return version if version in OFFSETS else None


def read_varint(b: bytes, i: int) -> tuple[int, int]:
    """CPython's location-table varint (6 bits a byte, 0x40: more follow); value and next index."""
    v = b[i] & 63
    shift = 6
    while b[i] & 64:
        i += 1
        v |= (b[i] & 63) << shift
        shift += 6
    return v, i + 1


def read_svarint(b: bytes, i: int) -> tuple[int, int]:
    v, i = read_varint(b, i)
    return (-(v >> 1) if v & 1 else v >> 1), i


def line_ranges(table: bytes, firstlineno: int) -> list[tuple[int, int, int | None]]:
    """(first code unit, end, line or None) per entry of a 3.11+ location table
    (Objects/locations.md), as code.co_lines() gives them in bytes."""
    out: list[tuple[int, int, int | None]] = []
    line = firstlineno
    addr = 0
    i = 0
    n = len(table)
    while i < n:
        b = table[i]
        i += 1
        code = (b >> 3) & 15
        length = (b & 7) + 1
        now: int | None
        if code == 15:
            now = None
        elif code == 14:
            d, i = read_svarint(table, i)
            line += d
            _, i = read_varint(table, i)  # end line delta
            _, i = read_varint(table, i)  # column + 1
            _, i = read_varint(table, i)  # end column + 1
            now = line
        elif code == 13:
            d, i = read_svarint(table, i)
            line += d
            now = line
        elif code >= 10:
            line += code - 10
            i += 2  # column, end column
            now = line
        else:
            i += 1  # the short form's column byte
            now = line
        out.append((addr, addr + length, now))
        addr += length
    return out


def line_ranges_310(table: bytes, firstlineno: int) -> list[tuple[int, int, int | None]]:
    """The same from a 3.10 line table (PEP 626's co_linetable: pairs of an unsigned byte-offset
    delta and a signed line delta, -128 for no line), in code units; what 3.10's co_lines() gives
    (checked on the standard library's code objects: tests/unit/test_pyframes.py)."""
    out: list[tuple[int, int, int | None]] = []
    line = firstlineno
    end = 0
    for i in range(0, len(table) - 1, 2):
        start = end
        end += table[i]
        delta = table[i + 1] - 256 if table[i + 1] >= 128 else table[i + 1]
        now: int | None = None
        if delta != -128:
            line += delta
            now = line
        if end != start:
            out.append((start // 2, end // 2, now))
    return out


def line_at(ranges: list[tuple[int, int, int | None]], unit: int, default: int,
            starts: list[int] | None = None) -> int:
    """The line of a code unit; ``starts``: the ranges' starts, for a binary search (the ranges
    come in order and do not overlap, as co_lines() gives them)."""
    if starts is not None:
        i = bisect.bisect_right(starts, unit) - 1
        if i >= 0 and unit < ranges[i][1]:
            ln = ranges[i][2]
            return ln if ln is not None else default
        return default
    for a, b, ln in ranges:
        if a <= unit < b:
            return ln if ln is not None else default
    return default


class CapturedMemory:
    """Ranges of an exited process's memory the eBPF program copied as it exited (code objects,
    their names and line tables): reads as ProcessMemory does, None outside what was copied."""

    def __init__(self) -> None:
        self._starts: list[int] = []
        self._ranges: list[tuple[int, bytes]] = []
        self._longest = 0

    def add(self, addr: int, data: bytes) -> None:
        if not addr or not data:
            return
        self._longest = max(self._longest, len(data))
        i = bisect.bisect_left(self._starts, addr)
        if i < len(self._starts) and self._starts[i] == addr:
            if len(data) <= len(self._ranges[i][1]):
                return
            self._ranges[i] = (addr, data)
            return
        self._starts.insert(i, addr)
        self._ranges.insert(i, (addr, data))

    def read(self, addr: int, size: int) -> bytes | None:
        """The bytes at [addr, addr + size) from any one copied range that holds them. Ranges can
        overlap (a code object's head is copied at a fixed size, and a str at least at its
        compact size, past a short one's end), so the range that starts nearest below ``addr``
        may be a short one that ends before it while an earlier, longer one holds it."""
        i = bisect.bisect_right(self._starts, addr) - 1
        while i >= 0 and self._starts[i] + self._longest >= addr + size:
            start, data = self._ranges[i]
            if addr + size <= start + len(data):
                return data[addr - start : addr - start + size]
            i -= 1
        return None

    def __len__(self) -> int:
        return len(self._ranges)


class _Symbols(NamedTuple):
    """What an interpreter image's dynamic symbols give (addresses in the image)."""

    key: tuple[int, int, int, int]  # the file (device, inode, size, mtime), whichever path led to it
    runtime: int  # _PyRuntime
    eval_range: tuple[int, int]  # _PyEval_EvalFrameDefault
    code_type: int  # PyCode_Type (0: none)
    start: int  # START, where a process's interpreter starts (0: none)


@dataclass
class _Code:
    slot: int
    firstlineno: int
    ranges: list[tuple[int, int, int | None]]
    starts: list[int] | None = None  # the ranges' starts where they are in order (binary search)


# The kept code objects' stand-in for an object that is not a code object (its frame is no frame).
_NOT_CODE = _Code(-1, 0, [])
# The name of a frame whose code object could not be read: the frame is kept, so that its callers and
# callees do not seem to call each other.
UNNAMED = "py::[unnamed]"


@dataclass
class _Proc:
    version: tuple[int, int]
    image: int  # the process's python image (ImageTable index)
    eval_image: int  # the interpreter's ELF image, and the evaluation loop's range in it
    eval_range: tuple[int, int]
    code_type: int = 0  # PyCode_Type's address in the process (0: not checked)
    codes: dict[int, _Code] = field(default_factory=dict)
    names: list[str] = field(default_factory=list)  # per slot
    # (code object, instruction) -> its frame: the outer frames of a program's stacks repeat from
    # one sample to the next while the innermost differ, so most keys of a drain are new stacks
    # of frames seen before (a line lookup each was most of a busy Python process's cost).
    frame_cache: dict[tuple[int, int], tuple[int, int]] = field(default_factory=dict)
    unnamed: int = -1  # the slot named UNNAMED, once a frame needed it
    # The str objects read for code objects' names and files, by address: a fallback where one
    # cannot be read again (_name).
    strings: dict[int, str] = field(default_factory=dict)


class PythonFrames:
    """Python processes described to the eBPF program, and their frames named."""

    def __init__(self, table: ImageTable, mapper: Mapper, bpf: BpfAggregator,
                 start_cpus: tuple[int, ...] = ()) -> None:
        # Imported now, before the target runs: at its first use (the first interpreter's symbols)
        # the import took 33-35 ms, and a program's first 50 ms of Python went by undescribed.
        import elftools.elf.elffile  # noqa: F401

        self.table = table
        self.mapper = mapper
        self.bpf = bpf
        self.procs: dict[int, _Proc] = {}
        self._names: dict[str, list[str]] = {}  # python image key -> its symbol names, kept past exit
        self._gone: list[str] = []  # image keys of processes forgotten since the last flush
        self._checked: set[int] = set()
        self._images: dict[tuple[int, int, int, int], _Symbols | None] = {}
        self.frames_named = 0
        self.procs_described = 0
        self.codes_read = 0  # code objects read (their names and line tables), over the run
        self.codes_at_exit = 0  # of which from the memory the program copied (module bodies, and at exits)
        # Per process that exited: what the program copied of its code objects (take_codes).
        self._captured: dict[int, CapturedMemory] = {}
        self._late: set[int] = set()  # processes the copies were looked for again in this drain
        self.own = os.getpid()
        self.unreadable = 0
        # Interpreters seen before their runtime was initialized: looked at again every few
        # milliseconds (the collector's poll_waiting), for WAIT_INIT_S at most.
        self.waiting: dict[int, float] = {}
        # System-wide: per interpreter file seen, a uprobe on START on each of these CPUs, whose
        # ring wakes the collector as a process of it starts its interpreter (start_fds).
        self.start_cpus = start_cpus
        self._starts: dict[tuple[int, int, int, int], list[tuple[int, RingBuffer]]] = {}
        # And per CPU, the ring the kernel writes to when a python is executed (watch_execs).
        self._execs: list[tuple[int, RingBuffer]] = []
        self._exec_waker: ExecWaker | None = None  # exec.bpf.c, where it loads
        self.exec_bpf_error: str | None = None  # why not (then the ftrace filter on the exec's name)
        self.exec_error: str | None = None  # why there are no exec wakes at all, where they were wanted
        self._exec_pids: dict[int, float] = {}  # processes exec'd lately: watched until then (monotonic s)
        self._closing: list[threading.Thread] = []  # stop_starts' closing of the probes

    # --- finding interpreters -------------------------------------------------------------
    def watch(self, pids: list[int]) -> None:
        """Describe to the program the CPython processes among ``pids`` (and those waiting for
        their interpreter to start) not looked at yet, but this one: system-wide it samples
        itself, and naming its own Python frames (its stacks, deep and many, from every drain)
        made more work the more it worked: twice the CPU of flat counting with -g fp, half of it
        on itself. Nor its helpers, the flusher's symbol archivers and compactions
        (collect/helpers.py)."""
        now = time.monotonic()
        for pid, since in list(self.waiting.items()):
            if now - since > WAIT_INIT_S or pid not in self.mapper.procs:
                del self.waiting[pid]  # never initialized (an embedding that does not run Python), or gone
        for pid in [*pids, *self.waiting]:
            if pid <= 0 or pid in self._checked or self._ours(pid):
                continue
            self._checked.add(pid)
            st = self.mapper.procs.get(pid)
            if st is None:
                continue
            for img, bias in zip(st.images, st.biases, strict=True):
                if img <= 0:
                    continue
                info = self.table[img]
                version = interpreter_version(info.path)
                if info.kind != "elf" or version is None:
                    continue
                found = self._interpreter(pid, info.path)
                if found is None:
                    continue
                syms, path = found
                self._probe_starts(syms, path)
                if self._describe(pid, version, syms.runtime + bias, img, syms.eval_range,
                                  syms.code_type + bias if syms.code_type else 0):
                    break

    def _probe_starts(self, syms: _Symbols, path: str) -> None:
        """Have the kernel wake the collector when a process of this interpreter file starts its
        interpreter (a uprobe sampling every entry of Py_InitializeFromConfig, which python's main
        and embedding programs call once, before the runtime exists: the process then waits, its
        runtime looked at every 5 ms, and is described before the start-up's imports run).
        System-wide, a process is otherwise seen when the rings' side records are read, every 0.2
        s: a program of 0.6 s had 15-40% of its samples before its description, without Python
        frames. One probe per file and CPU (MAX_START_PROBES files at most); a file without
        Py_InitializeFromConfig (3.7 and older) or a kernel without the uprobe PMU gets none."""
        if (not self.start_cpus or self._closing or syms.key in self._starts
                or len(self._starts) >= MAX_START_PROBES):
            return  # none wanted, or closing (the recording ends), or probed already, or enough
        from cyclescope.collect import kernel
        from cyclescope.images.elf import read_load_info

        self._starts[syms.key] = opened = []
        pmu = kernel.uprobe_pmu_type()
        try:
            offset = read_load_info(path).file_offset(syms.start) if syms.start else None
        except Exception:  # an image we cannot read: no probe
            offset = None
        if pmu is None or offset is None:
            return
        for cpu in self.start_cpus:
            fd = -1
            try:
                # A record (56 bytes: the sampler's fields and one register, rip, as the kernel
                # refuses a register sample with none) is past the watermark of 32 bytes: each
                # start wakes the reader.
                fd = kernel.open_uprobe_sampler(pmu, path, offset, -1, cpu, 1 << PERF_REG_IP, ring_bytes=64)
                ring = kernel.RingBuffer(fd, 1)
                kernel.ioctl_enable(fd)
            except (OSError, kernel.PerfOpenError):
                if fd >= 0:
                    kernel.close_fd(fd)
                continue
            opened.append((fd, ring))

    def probe_known(self) -> None:
        """Start probes on the interpreter files that the processes known now map (after the
        first scan of /proc: the recorder's own among them, which is never described), so that the
        first process of such a file is described at its start too. Not on every interpreter
        installed: closing a uprobe takes about 85 ms (the kernel serializes them), and the 12 of
        the six interpreter files installed here made `record -a -d 1` end a second later."""
        if not self.start_cpus:
            return
        for pid, st in list(self.mapper.procs.items()):
            for img in st.images:
                if img <= 0:
                    continue
                info = self.table[img]
                if info.kind != "elf" or interpreter_version(info.path) is None:
                    continue
                if (found := self._interpreter(pid, info.path)) is not None:
                    self._probe_starts(*found)

    def watch_execs(self) -> None:
        """Have the kernel wake the collector when a CPython interpreter is executed: the
        sched_process_exec tracepoint, with exec.bpf.c (collect/ebpf.ExecWaker) writing the pid
        where the executable file's name holds "python" (the file run: a script's interpreter, a
        symbolic link's target, so that pip's and the other console scripts, `python3` and a
        virtualenv's `bin/python` all match), or where that program cannot load (a kernel without
        BTF), filtered by ftrace on the name as executed (EXEC_FILTER: `python3`, `./tool.py`;
        not a link of another name or a console script). The start probes (probe_known,
        _probe_starts) wake it only for interpreter files seen before; without this, the first
        program of another one was seen when the rings' side records were read, up to 0.2 s
        after its start, and that share of it had no Python frames. At the exec the kernel has
        mapped the program (its side records are in the rings; a libpython comes a moment later):
        the collector reads the side records every few ms while the process is watched
        (take_execs, watching_exec) and drains when they show its interpreter, which then waits
        for its runtime (poll_waiting). An embedding program is not matched either way."""
        if not self.start_cpus or self._execs or self._closing:
            return
        from cyclescope.collect import kernel

        self._watch_execs_bpf()
        if self._execs:
            return
        tp = kernel.tracepoint_id("sched", "sched_process_exec")
        if tp is None:
            self.exec_error = kernel.no_tracepoint("sched", "sched_process_exec")
            return
        for cpu in self.start_cpus:
            fd = -1
            try:
                fd = kernel.open_tracepoint_waker(tp, cpu, EXEC_FILTER)
                ring = kernel.RingBuffer(fd, 1)
                kernel.ioctl_enable(fd)
            except (OSError, kernel.PerfOpenError) as e:
                if fd >= 0:
                    kernel.close_fd(fd)
                self.exec_error = str(e)
                continue
            self._execs.append((fd, ring))

    def _watch_execs_bpf(self) -> None:
        """watch_execs through exec.bpf.c: a BPF output event and its ring per CPU, the program
        writing to them. Leaves _execs empty where it cannot (exec_bpf_error says why)."""
        from cyclescope.collect import kernel
        from cyclescope.collect.ebpf import BpfUnavailable, ExecWaker

        outputs: dict[int, int] = {}
        try:
            for cpu in self.start_cpus:
                fd = kernel.open_bpf_output_waker(cpu)
                outputs[cpu] = fd
                self._execs.append((fd, kernel.RingBuffer(fd, 1)))
                kernel.ioctl_enable(fd)
            self._exec_waker = ExecWaker(outputs)
        except (OSError, kernel.PerfOpenError, BpfUnavailable) as e:
            self.exec_bpf_error = str(e)
            for _, ring in self._execs:
                ring.close()
            for fd in outputs.values():
                kernel.close_fd(fd)
            self._execs = []

    def start_fds(self) -> tuple[int, ...]:
        """The start probes' rings (the collector polls them: readable when an interpreter
        started)."""
        return tuple(fd for probes in self._starts.values() for fd, _ in probes)

    def take_starts(self) -> int:
        """Empty the start probes' rings (their records are not needed: the drain they woke reads
        the new process's mappings from the side records); how many bytes were read."""
        n = 0
        for probes in self._starts.values():
            for _, ring in probes:
                if ring.pending():
                    n += len(ring.read())
        return n

    def exec_fds(self) -> tuple[int, ...]:
        """The exec wakers' rings (the collector polls them, and take_execs empties them)."""
        return tuple(fd for fd, _ in self._execs)

    def take_execs(self) -> int:
        """Empty the exec wakers' rings; the processes they name (each record's pid) are watched
        for EXEC_WATCH_S (watching_exec). How many execs were read."""
        from cyclescope.perf.abi import Sample
        from cyclescope.perf.records import RecordDecoder, SampleLayout

        now = time.monotonic()
        n = 0
        decoder = None
        for _, ring in self._execs:
            if not ring.pending() or not (data := ring.read()):
                continue
            decoder = decoder or RecordDecoder(SampleLayout(int(Sample.TID)))
            pids = decoder.decode(data).samples["pid"].tolist()
            self._exec_pids.update(dict.fromkeys(pids, now + EXEC_WATCH_S))
            n += len(pids)
        return n

    def watching_exec(self) -> bool:
        """A python executed lately is not described yet: the collector reads the side records
        every PY_WAIT_POLL_S until it is (or EXEC_WATCH_S has passed). A python that links libpython
        maps it a moment after its exec, so the exec's own records show no interpreter yet; seen
        at the next read of the side records otherwise, 0.1-0.2 s later."""
        now = time.monotonic()
        for pid, until in list(self._exec_pids.items()):
            if until < now or pid in self.procs or pid in self.waiting or self._ours(pid):
                del self._exec_pids[pid]
        return bool(self._exec_pids)

    def stop_starts(self) -> None:
        """Begin closing the start probes, in a thread (about 85 ms each, one after another in the
        kernel): the collector's last drain and flush run meanwhile, and close() waits for it."""
        import threading

        from cyclescope.collect import kernel

        if self._exec_waker is not None:  # its program first, then the rings it writes to
            self._exec_waker.close()
            self._exec_waker = None
        for fd, ring in self._execs:  # tracepoints, BPF output events: closed at once
            ring.close()
            kernel.close_fd(fd)
        self._execs = []
        probes, self._starts = self._starts, {}
        if probes or not self._closing:  # a thread even with none: no probe is opened after this
            t = threading.Thread(target=self._close_probes, args=(probes,), daemon=True)
            t.start()
            self._closing.append(t)

    @staticmethod
    def _close_probes(probes: dict[tuple[int, int, int, int], list[tuple[int, RingBuffer]]]) -> None:
        from cyclescope.collect import kernel

        for opened in probes.values():
            for fd, ring in opened:
                ring.close()
                kernel.close_fd(fd)

    def close(self) -> None:
        self.stop_starts()
        for t in self._closing:
            t.join()

    def poll_waiting(self) -> bool:
        """Look again at the interpreters waiting for their runtime (a read of one pointer each);
        whether one was described."""
        if not self.waiting:
            return False
        before = self.procs_described
        self.watch([])
        return self.procs_described != before

    def _ours(self, pid: int) -> bool:
        return pid == self.own or is_helper(pid)

    def mapped_interpreters(self, side: list[SideRecord]) -> list[int]:
        """Processes (not described yet) that mapped a CPython interpreter among these records,
        looked at again by the next watch even if they were before: a python that links libpython
        maps it a moment after its exec, and one looked at in between (a drain brought by the exec,
        or its samples from before it) had no interpreter then."""
        from cyclescope.perf.records import MmapRecord

        out = []
        for r in side:
            if (isinstance(r, MmapRecord) and r.executable and r.pid not in self.procs
                    and interpreter_version(r.filename) is not None and not self._ours(r.pid)):
                out.append(r.pid)
                self._checked.discard(r.pid)
        return out

    def _interpreter(self, pid: int, path: str) -> tuple[_Symbols, str] | None:
        """An interpreter image's symbols, and the path they were read at: the file as the process
        sees it (a container's root), else at its path here."""
        for p in (f"/proc/{pid}/root{path}", path):
            if (syms := self._symbols(p)) is not None:
                return syms, p
        return None

    def _symbols(self, path: str) -> _Symbols | None:
        """An interpreter image's symbols from its dynamic symbols (cached per file); None when it
        has no _PyRuntime (a python3 that links libpython) or cannot be read."""
        try:
            st = os.stat(path)
        except OSError:
            return None
        key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)  # one file, whichever path led to it
        if key not in self._images:
            try:
                found = dynamic_symbols(path, ("_PyRuntime", EVAL, "PyCode_Type", START))
            except Exception:  # a file we cannot parse (ELFError, OSError, ...) is not an interpreter here
                found = {}
            lo, size = found.get(EVAL, (0, 0))
            self._images[key] = (_Symbols(key, found["_PyRuntime"][0], (lo, lo + size),
                                          found.get("PyCode_Type", (0, 0))[0], found.get(START, (0, 0))[0])
                                 if "_PyRuntime" in found else None)
        return self._images[key]

    def _describe(self, pid: int, version: tuple[int, int], runtime: int, elf_image: int,
                  eval_range: tuple[int, int], code_type: int = 0) -> bool:
        from cyclescope.images.registry import ImageInfo

        o = OFFSETS[version]
        raw = ProcessMemory(pid).read(runtime + o["runtime_interpreters_head"], 8)
        if raw is None:
            self.unreadable += 1
            return False
        interp = int.from_bytes(raw, "little")
        if not interp:
            self._checked.discard(pid)  # the interpreter is not initialized yet: look again next drain
            self.waiting.setdefault(pid, time.monotonic())
            return False
        self.waiting.pop(pid, None)
        deref = NO_OFFSET
        if version < (3, 11):
            found = pthread_tid_offset(pid, interp + o["interp_threads_head"], o)
            if found is None:
                self.unreadable += 1
                return False
            deref = found
        cfg = PY_PROC.pack(interp + o["interp_threads_head"], o["tstate_next"], o["tstate_tid"],
                           o["tstate_cframe"] & NO_OFFSET, o["current_frame"], o["frame_code"], o["frame_instr"],
                           o["frame_previous"], o["frame_owner"] & NO_OFFSET, deref, o["frame_entry"] & NO_OFFSET,
                           *(o[k] for k in ("code_adaptive", "code_qualname", "code_filename", "code_linetable",
                                            "unicode_state", "unicode_length", "ascii_size", "compact_size",
                                            "bytes_size", "bytes_sval", "code_firstlineno")),
                           frame_span(o))
        try:
            self.bpf.set_python(pid, cfg)
        except OSError:  # the program's table of processes is full (4,096): this one goes unnamed
            self.unreadable += 1
            return False
        st = self.mapper.procs.get(pid)
        start = st.last_seen_ns if st is not None else 0
        img = self.table.intern(ImageInfo(f"python:{pid}:{start}", f"[python {pid}]", "python", None, None, None,
                                          "absolute"))
        self.procs[pid] = p = _Proc(version, img, elf_image, eval_range, code_type)
        self._captured.pop(pid, None)  # an earlier process of this pid's
        self.procs_described += 1
        self._names[self.table[img].key] = p.names
        return True

    def forget(self, pid: int) -> None:
        """The process exited or exec'd: its description and code objects no longer hold."""
        self._checked.discard(pid)
        self.waiting.pop(pid, None)
        p = self.procs.pop(pid, None)
        self._captured.pop(pid, None)
        if p is not None:
            self.bpf.forget_python(pid)
            self._gone.append(self.table[p.image].key)  # its symbols are still to be stored

    def take_codes(self) -> None:
        """At each drain, after the stacks: the code objects the program copied as their
        processes exited, so that every stack of this drain whose process has exited has them."""
        self._late.clear()
        self._take()

    def _take_late(self, pid: int) -> CapturedMemory | None:
        """A code object of ``pid`` unreadable while this drain names its frames: if the process
        exited since the drain began, the program copied it as it exited (the drain's stacks
        stay in its map until they are named: ebpf.py's drain), and the copies are taken now.
        Looked for once per process and drain."""
        if pid in self._late:
            return None
        self._late.add(pid)
        self._take()
        return self._captured.get(pid)

    def _take(self) -> None:
        keys, values = self.bpf.take_codes()
        if len(keys):
            self.captured(keys, values)

    def captured(self, keys: np.ndarray, values: np.ndarray) -> None:
        """The code objects the program copied as their processes exited (collect/ebpf.py's
        take_codes), kept until the process is forgotten, after this drain's samples."""
        from cyclescope.collect.ebpf import PY_CODE_CAPS

        for pid, v in zip(keys["pid"].tolist(), values, strict=True):
            if pid not in self.procs:
                continue
            mem = self._captured.setdefault(pid, CapturedMemory())
            for i, cap in enumerate(PY_CODE_CAPS):
                n = min(int(v["len"][i]), cap)
                if n:
                    mem.add(int(v["addr"][i]), v[f"r{i}"][:n].tobytes())

    # --- naming frames ----------------------------------------------------------------------
    def stack(self, pid: int, native: tuple[tuple[int, int], ...], py: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
        """The stored stack of a sample with the program's Python frames ``py`` (stacks, for one)."""
        return self.stacks([pid], [native], [py])[0]

    def stacks(self, pids: Sequence[int], natives: Sequence[tuple[tuple[int, int], ...]],
               pys: Sequence[tuple[int, ...]]) -> list[tuple[tuple[int, int], ...]]:
        """The stored stacks of a drain's rows, from their native frames and the program's Python
        frames (flat (code object, instruction pointer) pairs, innermost first; a code object's bit
        0: PY_ENTRY, the outermost frame of a run of the evaluation loop): each run of Python frames
        at its own native frame of the loop where the native walk found as many of those as the
        Python frames say there were runs (interleave); else as splice does.

        Per process, each distinct (code object, instruction) of the drain is named once (frames'
        cache, _frame) and the rest is done in numpy and in C-level slices: named one frame at a
        time in Python, a stack of 31 frames cost 12-15 us with every frame cached
        (bench/pyframecost.py), and a CPython program's stacks are nearly all distinct (each
        frame's instruction pointer is in them)."""
        out = list(natives)
        rows_of: dict[int, list[int]] = {}
        for i, (pid, py) in enumerate(zip(pids, pys, strict=True)):
            if py and pid in self.procs:
                rows_of.setdefault(pid, []).append(i)
        for pid, rows in rows_of.items():
            self._stacks_of(pid, rows, natives, pys, out)
        return out

    def _stacks_of(self, pid: int, rows: list[int], natives: Sequence[tuple[tuple[int, int], ...]],
                   pys: Sequence[tuple[int, ...]], out: list[tuple[tuple[int, int], ...]]) -> None:
        import numpy as np

        p = self.procs[pid]
        counts = np.fromiter((len(pys[i]) >> 1 for i in rows), np.int64, len(rows))
        bounds = np.zeros(len(rows) + 1, np.int64)
        np.cumsum(counts, out=bounds[1:])
        flat = np.fromiter(chain.from_iterable(pys[i] for i in rows), np.uint64, 2 * int(bounds[-1]))
        code, instr = flat[0::2] & np.uint64(~PY_ENTRY & 0xFFFFFFFFFFFFFFFF), flat[1::2]
        code_u, instr_u, inv = _distinct_pairs(code, instr)
        mem: list[ProcessMemory] = []
        named = [self._frame(p, pid, c, i, mem) for c, i in zip(code_u.tolist(), instr_u.tolist(), strict=True)]
        ok = np.array([f is not None for f in named], bool)[inv]
        self.frames_named += int(ok.sum())
        # Each frame's (image, offset), the distinct ones' tuples shared; None where the frame's
        # object is not a code object (never where ok_l is true, nor with ``whole``: compress
        # leaves them out).
        picked = itemgetter(*inv.tolist())(named) if len(inv) > 1 else (named[int(inv[0])],)
        frames = cast("Sequence[tuple[int, int]]", picked)
        ok_l = ok.tolist()
        whole = bool(ok.all())  # every frame a frame (else the others are left out)
        # Each stack's runs end at its frames with PY_ENTRY (positions in the drain's frames).
        ends = np.flatnonzero(flat[0::2] & np.uint64(PY_ENTRY))
        first_end = np.searchsorted(ends, bounds[:-1]).tolist()
        last_end = np.searchsorted(ends, bounds[1:]).tolist()
        ends_l = ends.tolist()
        starts_l, stops_l = bounds[:-1].tolist(), bounds[1:].tolist()
        loops_in: dict[tuple[tuple[int, int], ...], list[int]] = {}  # native stack -> its loop frames
        for j, i in enumerate(rows):
            native = natives[i]
            at = loops_in.get(native)
            if at is None:
                at = loops_in[native] = loop_frames(native, p.eval_image, p.eval_range)
            s, e = starts_l[j], stops_l[j]
            mine = ends_l[first_end[j] : last_end[j]]
            if mine and mine[-1] == e - 1 and len(mine) == len(at):  # every run whole, one loop frame each
                runs = [tuple(frames[a : k + 1] if whole else compress(frames[a : k + 1], ok_l[a : k + 1]))
                        for a, k in zip([s, *(k + 1 for k in mine[:-1])], mine, strict=True)]
                out[i] = _interleave_at(native, runs, at)
            else:
                out[i] = _splice_at(native, tuple(frames[s:e] if whole else compress(frames[s:e], ok_l[s:e])), at)

    def frames(self, pid: int, py: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
        """(image, offset) per Python frame, innermost first, from the program's (code object,
        instruction pointer) pairs (a code object's bit 0: PY_ENTRY); UNNAMED's slot for a frame whose
        code object cannot be read, and nothing for one whose object is not a code object."""
        p = self.procs.get(pid)
        if p is None or not py:
            return ()
        mem: list[ProcessMemory] = []
        named = [self._frame(p, pid, py[k] & ~PY_ENTRY, py[k + 1], mem) for k in range(0, len(py), 2)]
        out = tuple(f for f in named if f is not None)
        self.frames_named += len(out)
        return out

    def _frame(self, p: _Proc, pid: int, tagged: int, instr: int,
               mem: list[ProcessMemory]) -> tuple[int, int] | None:
        """The (image, offset) of one Python frame: its code object's slot and its line; UNNAMED's
        slot where the code object cannot be read (not cached: read again at its next sample); None
        where the frame's object is not a code object (a frame the interpreter was setting up: no
        frame). ``mem``: the process's memory once opened (empty until then)."""
        cache = p.frame_cache
        f = cache.get((tagged, instr))
        if f is not None:
            return f
        o = OFFSETS[p.version]
        code = tagged & PY_ADDR
        c = p.codes.get(tagged)
        if c is None:
            c = self._read_code(p, pid, tagged, o, mem)
            if c is _NOT_CODE:
                return None
            if c is None:
                if p.unnamed < 0:
                    p.unnamed = len(p.names)
                    p.names.append(UNNAMED)
                return (p.image, p.unnamed << SLOT_BITS)
        if p.version < (3, 11):  # f_lasti, an int (f_lineno beside it in the word read)
            unit = instr & 0xFFFFFFFF
            unit = unit - (1 << 32) if unit >= 1 << 31 else unit
        else:
            unit = (instr - code - o["code_adaptive"]) // 2 if instr >= code else -1
        line = line_at(c.ranges, unit, c.firstlineno, c.starts) if unit >= 0 else c.firstlineno
        f = (p.image, (c.slot << SLOT_BITS) | (line & ((1 << SLOT_BITS) - 1)))
        if len(cache) >= FRAME_CACHE_MAX:
            cache.clear()
        cache[(tagged, instr)] = f
        return f

    def _read_code(self, p: _Proc, pid: int, tagged: int, o: dict[str, int],
                   mem: list[ProcessMemory]) -> _Code | None:
        """The code object at ``tagged``, from the copies the program made of it where it has one
        (a module body's, copied at a sample while it ran: the process's memory holds another
        object there by the drain; or any, copied as the process exited), else from the process's
        memory, else from copies taken again now (it exited as this drain named its frames).
        Counted unreadable once where none of them gives it."""
        before = self.unreadable
        copies = self._captured.get(pid)
        if copies is not None and copies.read(tagged & PY_ADDR, 8) is not None:
            c = self._code(p, copies, tagged, o)
            if c is not None and c is not _NOT_CODE:
                self.codes_at_exit += 1
                self.unreadable = before
                return c
        if not mem:
            mem.append(ProcessMemory(pid))
        c = self._code(p, mem[0], tagged, o)
        if (c is None or c is _NOT_CODE) and (late := self._take_late(pid)) is not None:
            again = self._code(p, late, tagged, o)
            if again is not None and again is not _NOT_CODE:
                self.codes_at_exit += 1
                c = again
        self.unreadable = before + (c is None or c is _NOT_CODE)
        return c

    def _code(self, p: _Proc, mem: ProcessMemory | CapturedMemory, tagged: int, o: dict[str, int]) -> _Code | None:
        """The code object at ``tagged``'s address, read and kept under ``tagged`` (its address and
        tag); None where it cannot be read or is not the object the sample saw there; _NOT_CODE
        where the object there is not a code object."""
        head = mem.read(tagged & PY_ADDR, o["code_adaptive"])
        if head is None:
            self.unreadable += 1
            return None
        if p.code_type and int.from_bytes(head[8:16], "little") != p.code_type:
            # ob_type: not a code object (a frame read while the interpreter set it up, its
            # f_code not written yet). Its "name" was bytes of garbage in stacks of 3.11's start-up.
            self.unreadable += 1
            return _NOT_CODE
        if code_tag(head, o["code_firstlineno"]) != tagged & ~PY_ADDR:
            self.unreadable += 1  # another code object than the sample's now lives there
            return None

        def ptr(off: int) -> int:
            return int.from_bytes(head[off : off + 8], "little")

        qual = self._name(p, mem, ptr(o["code_qualname"]), o)
        fname = self._name(p, mem, ptr(o["code_filename"]), o)
        first = int.from_bytes(head[o["code_firstlineno"] : o["code_firstlineno"] + 4], "little", signed=True)
        table = self._bytes(mem, ptr(o["code_linetable"]), o) or b""
        if qual is None or fname is None:
            self.unreadable += 1
            return None
        try:
            ranges = line_ranges(table, first) if p.version >= (3, 11) else line_ranges_310(table, first)
        except IndexError:  # a table read while it changed, or not a table
            ranges = []
        ordered = all(ranges[i][0] >= ranges[i - 1][1] for i in range(1, len(ranges)))
        c = _Code(len(p.names), first, ranges, [r[0] for r in ranges] if ordered else None)
        p.names.append(f"py::{qual}:{fname}")
        p.codes[tagged] = c
        self.codes_read += 1
        return c

    @staticmethod
    def _bytes(mem: ProcessMemory | CapturedMemory, addr: int, o: dict[str, int]) -> bytes | None:
        if not addr:
            return None
        head = mem.read(addr, o["bytes_sval"])
        if head is None:
            return None
        n = int.from_bytes(head[o["bytes_size"] : o["bytes_size"] + 8], "little", signed=True)
        if n < 0 or n > MAX_CODE_BYTES:
            return None
        return mem.read(addr + o["bytes_sval"], n) if n else b""

    def _name(self, p: _Proc, mem: ProcessMemory | CapturedMemory, addr: int, o: dict[str, int]) -> str | None:
        """A code object's name or file, read at ``addr``; where it cannot be read, what was read
        at that address of this process before. The code objects of a module share one file
        object: the copies made as a process exits lack a str whose memory its finalization
        released (pylast.py's file, in about one run in ten: last() went unnamed, though its code
        object and name were copied), and the file read for the module's other functions names
        it."""
        got = self._str(mem, addr, o)
        if got is not None:
            p.strings[addr] = got
            return got
        return p.strings.get(addr)

    @staticmethod
    def _str(mem: ProcessMemory | CapturedMemory, addr: int, o: dict[str, int]) -> str | None:
        """A compact str object's text (ASCII, Latin-1, UCS-2 or UCS-4)."""
        if not addr:
            return None
        head = mem.read(addr, o["compact_size"])
        if head is None:
            return None
        state = int.from_bytes(head[o["unicode_state"] : o["unicode_state"] + 4], "little")
        length = int.from_bytes(head[o["unicode_length"] : o["unicode_length"] + 8], "little", signed=True)
        kind, compact, ascii_ = (state >> 2) & 7, (state >> 5) & 1, (state >> 6) & 1
        if not compact or kind not in (1, 2, 4) or not 0 <= length <= 4096:
            return None
        data = mem.read(addr + (o["ascii_size"] if ascii_ else o["compact_size"]), length * kind)
        if data is None:
            return None
        return data.decode({1: "latin-1", 2: "utf-16-le", 4: "utf-32-le"}[kind], errors="replace")

    # --- symbols ----------------------------------------------------------------------------
    def symbols(self, image_key: str) -> SymbolTable | None:
        """The symbol table of a process's python image: one symbol per code object."""
        from cyclescope.images.elf import SymbolTable

        names = self._names.get(image_key)
        if names is None:
            return None
        return SymbolTable.build([(i << SLOT_BITS, 1 << SLOT_BITS, n) for i, n in enumerate(names)])

    def flushed(self) -> None:
        """After a flush: the names of processes gone before it have been stored."""
        for key in self._gone:
            self._names.pop(key, None)
        self._gone = []


def pthread_tid_offset(pid: int, threads_head: int, o: dict[str, int]) -> int | None:
    """Where glibc's struct pthread holds the thread's id, checked on this process's thread states
    (3.10's thread_id is the pthread_t, the structure's address): an offset at which some thread
    state's pthread reads as one of the process's tids and none as anything but a tid or 0 (a
    thread exiting), glibc's 0x2d0 first; None when none does (memory unreadable, another C
    library)."""
    try:
        tids = {int(t) for t in os.listdir(f"/proc/{pid}/task")}
    except OSError:
        return None
    mem = ProcessMemory(pid)

    def ptr(addr: int) -> int:
        raw = mem.read(addr, 8)
        return int.from_bytes(raw, "little") if raw else 0

    threads: list[int] = []
    ts = ptr(threads_head)
    while ts and len(threads) < 64:
        if t := ptr(ts + o["tstate_tid"]):
            threads.append(t)
        ts = ptr(ts + o["tstate_next"])

    def fits(blobs: list[bytes | None], off: int) -> bool:
        ids = [int.from_bytes(b[off : off + 4], "little") for b in blobs if b is not None and len(b) >= off + 4]
        return len(ids) == len(blobs) and any(i in tids for i in ids) and all(i in tids or i == 0 for i in ids)

    if threads and fits([mem.read(t + PTHREAD_TID, 4) for t in threads], 0):
        return PTHREAD_TID
    blobs = [mem.read(t, 0x800) for t in threads]
    return next((off for off in range(0, 0x800, 4) if blobs and fits(blobs, off)), None)


def dynamic_symbols(path: str, names: tuple[str, ...]) -> dict[str, tuple[int, int]]:
    """(value, size) of these symbols in ``path``'s .dynsym, by a scan of the raw table with numpy:
    pyelftools builds an object per symbol, a fifth of a second for libpython's thousands, while
    the process whose frames are wanted runs on."""
    import numpy as np
    from elftools.elf.elffile import ELFFile

    with open(path, "rb") as f:
        elf = ELFFile(f)
        sym = elf.get_section_by_name(".dynsym")
        strs = elf.get_section_by_name(".dynstr")
        if sym is None or strs is None or elf.elfclass != 64:
            return {}
        table = np.frombuffer(sym.data(), dtype=np.dtype([("name", "<u4"), ("info", "u1"), ("other", "u1"),
                                                          ("shndx", "<u2"), ("value", "<u8"), ("size", "<u8")]))
        text = strs.data()
    out = {}
    for n in names:
        at = text.find(b"\0" + n.encode() + b"\0")
        if at < 0:
            continue
        hit = np.flatnonzero((table["name"] == at + 1) & (table["shndx"] != 0))
        if len(hit):
            out[n] = (int(table["value"][hit[0]]), int(table["size"][hit[0]]))
    return out


def _distinct_pairs(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The distinct (a, b) pairs of two uint64 arrays, and each pair's index among them: by a
    64-bit hash of the pair (np.unique of one integer column), checked exact, else by sorting the
    pairs (np.unique of a structured array sorts field by field: 10 ms for 12,000 pairs, the
    whole cost of naming a drain's stacks)."""
    import numpy as np

    with np.errstate(over="ignore"):
        h = a * np.uint64(0x9E3779B97F4A7C15) ^ (b + np.uint64(0x632BE59BD9B4E019)) * np.uint64(0xBF58476D1CE4E5B9)
    _, first, inv = np.unique(h, return_index=True, return_inverse=True)
    inv = inv.reshape(-1)
    a_u, b_u = a[first], b[first]
    if (a_u[inv] == a).all() and (b_u[inv] == b).all():
        return a_u, b_u, inv
    pairs = np.empty(len(a), [("a", "<u8"), ("b", "<u8")])  # two pairs of one hash
    pairs["a"], pairs["b"] = a, b
    u, inv = np.unique(pairs, return_inverse=True)
    return u["a"].copy(), u["b"].copy(), inv.reshape(-1)


def loop_frames(native: tuple[tuple[int, int], ...], eval_image: int, eval_range: tuple[int, int]) -> list[int]:
    """The positions in leaf-first ``native`` of the evaluation loop's frames."""
    lo, hi = eval_range
    return [i for i, (img, off) in enumerate(native) if img == eval_image and lo <= off < hi]


def interleave(native: tuple[tuple[int, int], ...], runs: list[tuple[tuple[int, int], ...]], eval_image: int,
               eval_range: tuple[int, int]) -> tuple[tuple[int, int], ...] | None:
    """Leaf-first ``native`` frames with each run of the evaluation loop's Python frames (``runs``,
    innermost first) after its own native frame of the loop, the native frames between runs (a C
    function that called back into Python, the interpreter's calls) and beyond them (main, _start)
    kept; None where the native walk has not one frame of the loop per run (a walk cut short, or
    frame-pointer guesses through an interpreter built without them)."""
    at = loop_frames(native, eval_image, eval_range)
    if len(at) != len(runs) or not runs:
        return None
    return _interleave_at(native, runs, at)


def _interleave_at(native: tuple[tuple[int, int], ...], runs: list[tuple[tuple[int, int], ...]],
                   at: list[int]) -> tuple[tuple[int, int], ...]:
    """interleave's, with the loop's frames at ``at`` (one per run)."""
    parts = []
    prev = 0
    for i, run in zip(at, runs, strict=True):
        parts.append(native[prev : i + 1])
        parts.append(run)
        prev = i + 1
    parts.append(native[prev:])
    return tuple(chain.from_iterable(parts))


def splice(native: tuple[tuple[int, int], ...], py: tuple[tuple[int, int], ...], eval_image: int,
           eval_range: tuple[int, int]) -> tuple[tuple[int, int], ...]:
    """Leaf-first ``native`` frames cut after the first one in the evaluation loop (or after the
    first frame, where none is), then the Python frames."""
    return _splice_at(native, py, loop_frames(native, eval_image, eval_range))


def _splice_at(native: tuple[tuple[int, int], ...], py: tuple[tuple[int, int], ...],
               at: list[int]) -> tuple[tuple[int, int], ...]:
    return (*native[: (at[0] if at else 0) + 1], *py)
