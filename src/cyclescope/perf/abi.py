"""The kernel's perf_event ABI: attribute layout, record layouts and constants.

Pure definitions, no system calls. Values come from include/uapi/linux/perf_event.h
(kernel 6.x) and arch/x86/include/uapi/asm/perf_regs.h.
"""

from __future__ import annotations

import ctypes
import enum

# --- event types and configs -------------------------------------------------


class EventType(enum.IntEnum):
    HARDWARE = 0
    SOFTWARE = 1
    TRACEPOINT = 2
    HW_CACHE = 3
    RAW = 4
    BREAKPOINT = 5


class HwId(enum.IntEnum):
    CPU_CYCLES = 0
    INSTRUCTIONS = 1
    CACHE_REFERENCES = 2
    CACHE_MISSES = 3
    BRANCH_INSTRUCTIONS = 4
    BRANCH_MISSES = 5
    BUS_CYCLES = 6
    STALLED_CYCLES_FRONTEND = 7
    STALLED_CYCLES_BACKEND = 8
    REF_CPU_CYCLES = 9


class SwId(enum.IntEnum):
    CPU_CLOCK = 0
    TASK_CLOCK = 1
    PAGE_FAULTS = 2
    CONTEXT_SWITCHES = 3
    CPU_MIGRATIONS = 4
    PAGE_FAULTS_MIN = 5
    PAGE_FAULTS_MAJ = 6
    ALIGNMENT_FAULTS = 7
    EMULATION_FAULTS = 8
    DUMMY = 9
    BPF_OUTPUT = 10


# HW_CACHE config = id | (op << 8) | (result << 16)
HW_CACHE_L1D = 0
HW_CACHE_L1I = 1
HW_CACHE_LL = 2
HW_CACHE_DTLB = 3
HW_CACHE_ITLB = 4
HW_CACHE_OP_READ = 0
HW_CACHE_RESULT_MISS = 1


def hw_cache_config(cache: int, op: int, result: int) -> int:
    return cache | (op << 8) | (result << 16)


# --- sample_type and read_format bits ----------------------------------------


class Sample(enum.IntFlag):
    IP = 1 << 0
    TID = 1 << 1
    TIME = 1 << 2
    ADDR = 1 << 3
    READ = 1 << 4
    CALLCHAIN = 1 << 5
    ID = 1 << 6
    CPU = 1 << 7
    PERIOD = 1 << 8
    STREAM_ID = 1 << 9
    RAW = 1 << 10
    BRANCH_STACK = 1 << 11
    REGS_USER = 1 << 12
    STACK_USER = 1 << 13
    WEIGHT = 1 << 14
    DATA_SRC = 1 << 15
    IDENTIFIER = 1 << 16
    TRANSACTION = 1 << 17
    REGS_INTR = 1 << 18
    PHYS_ADDR = 1 << 19
    AUX = 1 << 20
    CGROUP = 1 << 21
    DATA_PAGE_SIZE = 1 << 22
    CODE_PAGE_SIZE = 1 << 23
    WEIGHT_STRUCT = 1 << 24


class ReadFormat(enum.IntFlag):
    TOTAL_TIME_ENABLED = 1 << 0
    TOTAL_TIME_RUNNING = 1 << 1
    ID = 1 << 2
    GROUP = 1 << 3
    LOST = 1 << 4


# --- attr flag bits (the u64 bitfield at offset 40) ---------------------------


class AttrFlag(enum.IntFlag):
    DISABLED = 1 << 0
    INHERIT = 1 << 1
    PINNED = 1 << 2
    EXCLUSIVE = 1 << 3
    EXCLUDE_USER = 1 << 4
    EXCLUDE_KERNEL = 1 << 5
    EXCLUDE_HV = 1 << 6
    EXCLUDE_IDLE = 1 << 7
    MMAP = 1 << 8
    COMM = 1 << 9
    FREQ = 1 << 10
    INHERIT_STAT = 1 << 11
    ENABLE_ON_EXEC = 1 << 12
    TASK = 1 << 13
    WATERMARK = 1 << 14
    PRECISE_IP_1 = 1 << 15
    PRECISE_IP_2 = 1 << 16
    MMAP_DATA = 1 << 17
    SAMPLE_ID_ALL = 1 << 18
    EXCLUDE_HOST = 1 << 19
    EXCLUDE_GUEST = 1 << 20
    EXCLUDE_CALLCHAIN_KERNEL = 1 << 21
    EXCLUDE_CALLCHAIN_USER = 1 << 22
    MMAP2 = 1 << 23
    COMM_EXEC = 1 << 24
    USE_CLOCKID = 1 << 25
    CONTEXT_SWITCH = 1 << 26
    WRITE_BACKWARD = 1 << 27
    NAMESPACES = 1 << 28
    KSYMBOL = 1 << 29
    BPF_EVENT = 1 << 30
    AUX_OUTPUT = 1 << 31
    CGROUP = 1 << 32
    TEXT_POKE = 1 << 33
    BUILD_ID = 1 << 34
    INHERIT_THREAD = 1 << 35
    REMOVE_ON_EXEC = 1 << 36
    SIGTRAP = 1 << 37


class PerfEventAttr(ctypes.Structure):
    """struct perf_event_attr up to PERF_ATTR_SIZE_VER7 (128 bytes)."""

    _fields_ = [
        ("type", ctypes.c_uint32),
        ("size", ctypes.c_uint32),
        ("config", ctypes.c_uint64),
        ("sample_period", ctypes.c_uint64),  # union with sample_freq
        ("sample_type", ctypes.c_uint64),
        ("read_format", ctypes.c_uint64),
        ("flags", ctypes.c_uint64),
        ("wakeup_events", ctypes.c_uint32),  # union with wakeup_watermark
        ("bp_type", ctypes.c_uint32),
        ("config1", ctypes.c_uint64),
        ("config2", ctypes.c_uint64),
        ("branch_sample_type", ctypes.c_uint64),
        ("sample_regs_user", ctypes.c_uint64),
        ("sample_stack_user", ctypes.c_uint32),
        ("clockid", ctypes.c_int32),
        ("sample_regs_intr", ctypes.c_uint64),
        ("aux_watermark", ctypes.c_uint32),
        ("sample_max_stack", ctypes.c_uint16),
        ("reserved_2", ctypes.c_uint16),
        ("aux_sample_size", ctypes.c_uint32),
        ("reserved_3", ctypes.c_uint32),
        ("sig_data", ctypes.c_uint64),
    ]


PERF_ATTR_SIZE = ctypes.sizeof(PerfEventAttr)
assert PERF_ATTR_SIZE == 128

# --- ioctls (_IO('$', n) and _IOW('$', n, u64)) -------------------------------

_IOC_WRITE = 1


def _io(nr: int) -> int:
    return (ord("$") << 8) | nr


def _iow(nr: int, size: int) -> int:
    return (_IOC_WRITE << 30) | (size << 16) | (ord("$") << 8) | nr


def _ior(nr: int, size: int) -> int:
    return (2 << 30) | (size << 16) | (ord("$") << 8) | nr


IOC_ENABLE = _io(0)
IOC_DISABLE = _io(1)
IOC_REFRESH = _io(2)
IOC_RESET = _io(3)
IOC_PERIOD = _iow(4, 8)
IOC_SET_OUTPUT = _io(5)
IOC_SET_FILTER = _iow(6, 8)  # a tracepoint event's ftrace filter (a char *)
IOC_ID = _ior(7, 8)
IOC_FLAG_GROUP = 1

PERF_FLAG_FD_CLOEXEC = 1 << 3

# --- the mmap'ed control page (struct perf_event_mmap_page) -------------------

MMAP_PAGE_DATA_HEAD = 1024
MMAP_PAGE_DATA_TAIL = 1032
MMAP_PAGE_DATA_OFFSET = 1040
MMAP_PAGE_DATA_SIZE = 1048

# --- record types and misc bits -----------------------------------------------


class RecordType(enum.IntEnum):
    MMAP = 1
    LOST = 2
    COMM = 3
    EXIT = 4
    THROTTLE = 5
    UNTHROTTLE = 6
    FORK = 7
    READ = 8
    SAMPLE = 9
    MMAP2 = 10
    AUX = 11
    ITRACE_START = 12
    LOST_SAMPLES = 13
    SWITCH = 14
    SWITCH_CPU_WIDE = 15
    NAMESPACES = 16
    KSYMBOL = 17
    BPF_EVENT = 18
    CGROUP = 19
    TEXT_POKE = 20
    AUX_OUTPUT_HW_ID = 21


MISC_CPUMODE_MASK = 0x7
MISC_CPUMODE_UNKNOWN = 0
MISC_KERNEL = 1
MISC_USER = 2
MISC_HYPERVISOR = 3
MISC_GUEST_KERNEL = 4
MISC_GUEST_USER = 5
MISC_MMAP_BUILD_ID = 1 << 14  # on MMAP2: build-id instead of maj/min/ino
MISC_COMM_EXEC = 1 << 13  # on COMM: the name changed because of an exec
MISC_MMAP_DATA = 1 << 13  # on MMAP/MMAP2: a non-executable mapping

# --- x86-64 user registers (asm/perf_regs.h) ----------------------------------


class X86Reg(enum.IntEnum):
    AX = 0
    BX = 1
    CX = 2
    DX = 3
    SI = 4
    DI = 5
    BP = 6
    SP = 7
    IP = 8
    FLAGS = 9
    CS = 10
    SS = 11
    DS = 12
    ES = 13
    FS = 14
    GS = 15
    R8 = 16
    R9 = 17
    R10 = 18
    R11 = 19
    R12 = 20
    R13 = 21
    R14 = 22
    R15 = 23


# DS, ES, FS and GS (bits 12-15) are refused by the kernel on x86-64.
X86_REGS_USER_MASK = 0xFF0FFF
# The general-purpose registers by their 64-bit names, in the order perf numbers them (X86Reg): the
# columns of the loop analyses' register arrays.
GPRS = ("rax", "rbx", "rcx", "rdx", "rsi", "rdi", "rbp", "rsp",
        "r8", "r9", "r10", "r11", "r12", "r13", "r14", "r15")
# The 8-byte words of the user stack from rsp up that each sample carries beside the registers by
# default (attr.sample_stack_user): where a procedure spilled a value the loop counter follows
# (analysis/progress.py reads them as it reads the registers).
STACK_WORDS = 32
STACK_BYTES = 8 * STACK_WORDS
SAMPLE_REGS_ABI_64 = 2


def regs_in_mask(mask: int) -> list[X86Reg]:
    """Registers in the order the kernel writes them: ascending bit number."""
    return [r for r in X86Reg if mask & (1 << r)]


# Callchain context markers (enum perf_callchain_context): each starts the frames of one context.
PERF_CONTEXT_HV = (1 << 64) - 32
PERF_CONTEXT_KERNEL = (1 << 64) - 128
PERF_CONTEXT_USER = (1 << 64) - 512
PERF_CONTEXT_GUEST = (1 << 64) - 2048
PERF_CONTEXT_MAX = (1 << 64) - 4095
MAX_DEPTH = 127  # the frames asked of a callchain (attr.sample_max_stack)
