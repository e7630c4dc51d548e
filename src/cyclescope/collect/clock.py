"""Measuring the core clock, so that time-based samples convert to cycles.

Without a PMU, cyclescope samples cpu-clock, whose period is nanoseconds;
instruction frequency estimates need the period in cycles. /proc/cpuinfo's
"cpu MHz" is the nominal clock (2.45 GHz here) while cores run at turbo
clocks (measured 3.0 GHz here): a 20% error in every estimated execution
count. So cyclescope measures the clock itself: a chain of dependent adds
(one cycle each on every x86-64 core since the Pentium Pro) runs from an
executable page for about 10 ms, and cycles per nanosecond is adds / the
thread's CPU time.

The adds are register to register (``add rax, rdx``, rdx = 1). A chain of
``add rax, 1`` is not timed by the adder on every core: Intel's Golden Cove
and its successors fold adds of small immediates at rename, several a cycle
(measured on a Xeon with AMX here: 19.5 such adds a nanosecond against 3.7 of
``add rax, rdx``, whose count a 3-cycle ``imul`` chain confirms: 1.22 a ns).
An operand read from a register is a value the renamer cannot know.

Hand-written machine code rather than a library because nothing else runs
a known number of cycles from Python: the interpreter's own loops cost an
unknown and variable number of cycles per iteration.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import mmap
import os
import struct
import time
from collections.abc import Callable
from pathlib import Path

ADDS_PER_ITERATION = 16


def _code(iterations: int) -> bytes:
    # mov rcx, imm64; xor eax, eax; mov edx, 1; loop: (add rax, rdx) x16; dec rcx; jnz loop; ret
    body = b"\x48\x01\xd0" * ADDS_PER_ITERATION  # add rax, rdx
    loop = body + b"\x48\xff\xc9"  # dec rcx
    jnz = b"\x0f\x85" + struct.pack("<i", -(len(loop) + 6))
    setup = b"\x48\xb9" + struct.pack("<Q", iterations) + b"\x31\xc0" + b"\xba\x01\x00\x00\x00"
    return setup + loop + jnz + b"\xc3"


def measure_ghz(duration_s: float = 0.01, repeats: int = 3) -> float | None:
    """Core cycles per nanosecond on the CPU this thread runs on, or None if it cannot be measured."""
    best = 0.0
    iterations = 20_000
    try:
        for _ in range(repeats + 1):
            # This thread's CPU time, not the wall clock, which also counts the time the task or
            # the VM is preempted (steal, which the kernel leaves out of the thread's time): the
            # best of four runs once came out at 2.1 GHz against 3.5, in a run of the tests beside
            # two busy loops, and its per-boot cache kept it (calc's CPI at half the model's best).
            dt = _run_chain(iterations, time.thread_time_ns)
            best = max(best, iterations * ADDS_PER_ITERATION / max(dt, 1))  # the run least disturbed
            # Scale so one run lasts about duration_s.
            iterations = max(1000, int(iterations * duration_s * 1e9 / max(dt, 1)))
    except (OSError, ValueError):
        return None  # W^X policy: no executable anonymous memory
    return best if 0.2 < best < 8.0 else None


def _run_chain(iterations: int, clock: Callable[[], int]) -> int:
    """Run the dependent-add chain once; nanoseconds it took by ``clock``."""
    page = mmap.mmap(-1, 4096, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
    try:
        page.write(_code(iterations))
        buf = ctypes.c_char.from_buffer(page)
        fn = ctypes.CFUNCTYPE(ctypes.c_uint64)(ctypes.addressof(buf))
        t0 = clock()
        fn()
        dt = clock() - t0
        del fn, buf
        return dt
    finally:
        with contextlib.suppress(BufferError):
            page.close()


def measure_sample_overhead(period_ns: int, budget_s: float = 0.35) -> float | None:
    """Nanoseconds each cpu-clock sample costs the sampled code, at this period.

    On these VMs a sample costs about 19 us (the timer interrupt and its VM
    exit), time the sampled clock counts but the code does not run: without
    correcting for it, every execution count estimated from samples comes out
    high by overhead/period (10% at 5 kHz). The chain runs with and without a
    sampling cpu-clock event on this thread, alternately; the difference per
    sample taken is the overhead, and the median over the pairs is returned.

    Many short pairs rather than a few long ones, in ``budget_s`` of sampled
    time: a run is disturbed in bursts (the host's preemptions count on the
    thread's clock too), so a short run is either clean or an outlier the
    median drops. Resampled from 600 measured pairs on a Zen 3 VM at 200 us,
    the median of 7 pairs of 50 ms ranged 4.1-11.7 us (2nd-98th percentile)
    around 8.4, and one such measurement in CI came out at 4.8 against 11.3;
    35 pairs of 10 ms ranged 7.6-9.9. Each run takes at least 50 samples.
    """
    from cyclescope.collect import kernel
    from cyclescope.perf.abi import PERF_ATTR_SIZE, AttrFlag, EventType, PerfEventAttr, ReadFormat, Sample, SwId

    ghz = measure_ghz(0.005, 1)
    if ghz is None:
        return None
    seconds = max(0.01, 50 * period_ns / 1e9)
    rounds = max(7, int(budget_s / seconds))
    iterations = max(1000, int(seconds * ghz * 1e9 / ADDS_PER_ITERATION))
    attr = PerfEventAttr()
    attr.type, attr.size, attr.config = EventType.SOFTWARE, PERF_ATTR_SIZE, SwId.CPU_CLOCK
    attr.sample_period = period_ns
    attr.sample_type = int(Sample.IP | Sample.TID | Sample.TIME)
    attr.flags = int(AttrFlag.DISABLED | AttrFlag.EXCLUDE_KERNEL)
    # The runs are timed by the sampled clock itself: a counting cpu-clock event of this thread,
    # which counts its time on a CPU, interrupts and the VM's exits for them included, and not
    # the time it waits for the CPU. Timed by the wall clock, a run beside other work counted the
    # others' turns too: beside a busy loop per CPU, 0 to 59 us a sample against 16 quiet, and
    # once, cached for the boot, 41 us (calc's CPI at 0.58 of the model's best, the stall-free
    # loop's test failing).
    tick = PerfEventAttr()
    tick.type, tick.size, tick.config = EventType.SOFTWARE, PERF_ATTR_SIZE, SwId.CPU_CLOCK
    tick.read_format = int(ReadFormat.TOTAL_TIME_ENABLED | ReadFormat.TOTAL_TIME_RUNNING)
    try:
        fd = kernel.perf_event_open(attr, 0, -1)
    except kernel.PerfOpenError:
        return None
    try:
        tfd = kernel.perf_event_open(tick, 0, -1)
    except kernel.PerfOpenError:
        kernel.close_fd(fd)
        return None

    def clock() -> int:
        return kernel.read_counter(tfd)[0]

    ring = None
    try:
        ring = kernel.RingBuffer(fd, 16)
        diffs = []
        for _ in range(rounds):
            off = _run_chain(iterations, clock)
            kernel.ioctl_enable(fd)
            on = _run_chain(iterations, clock)
            kernel.ioctl_disable(fd)
            ring.read()
            taken = on / period_ns
            if taken >= 5:
                diffs.append((on - off) / taken)
        if not diffs:
            return None
        diffs.sort()
        est = diffs[len(diffs) // 2]
        return max(0.0, min(est, 0.5 * period_ns))
    finally:
        if ring is not None:
            ring.close()
        kernel.close_fd(fd)
        kernel.close_fd(tfd)


def _per_boot(cache_dir: Path | None, name: str, measure: Callable[[], float | None]) -> float | None:
    """``measure()``, remembered in ``cache_dir`` until the machine reboots (None is not kept)."""
    boot = ""
    with contextlib.suppress(OSError):
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    f = cache_dir / f"{name}-{boot}.json" if cache_dir is not None and boot else None
    if f is not None:
        with contextlib.suppress(OSError, ValueError, TypeError, KeyError):
            return float(json.loads(f.read_text())["value"])
    value = measure()
    if value is not None and f is not None:
        with contextlib.suppress(OSError):
            f.parent.mkdir(parents=True, exist_ok=True)
            tmp = f.with_name(f".tmp-{os.getpid()}-{f.name}")
            tmp.write_text(json.dumps({"value": value}))
            os.replace(tmp, f)
    return value


def sample_overhead(period_ns: int, cache_dir: Path | None) -> float | None:
    """measure_sample_overhead, remembered per boot and period in ``cache_dir`` (it costs about 1 s)."""
    return _per_boot(cache_dir, f"overhead-{period_ns}", lambda: measure_sample_overhead(period_ns))


def boot_clock(cache_dir: Path | None) -> float | None:
    """measure_ghz at full length (four runs, ~30 ms), once per boot: each run starts from it, and
    each flush adds a short measurement (``measure_ghz(FLUSH_CLOCK_S, 2)``)."""
    return _per_boot(cache_dir, "clock", measure_ghz)


# A flush's clock measurement: two runs of 4 ms (the best of them; a run is disturbed by at most a
# timer interrupt or two of ~20 us, under 1%).
FLUSH_CLOCK_S = 0.004


def _libc_function(name: str) -> tuple[str, int] | None:
    """The file and file offset of ``name`` in the C library this process maps."""
    from cyclescope.errors import CycleScopeError
    from cyclescope.images.elf import read_load_info, read_symbols

    path = None
    with contextlib.suppress(OSError), open("/proc/self/maps") as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 6 and ("/libc.so" in parts[5] or "/libc-" in parts[5]):
                path = parts[5]
                break
    if path is None:
        return None
    try:
        symbols = read_symbols(path, demangle=False)
        offset = read_load_info(path).file_offset(int(symbols.starts[symbols.names.index(name)]))
    except (OSError, CycleScopeError, ValueError):
        return None
    return (path, offset) if offset is not None else None


def _probed_call(emulated: bool) -> tuple[tuple[str, int], Callable[[], object]] | None:
    """The C library function the hit costs are measured on, where its entry is (file, offset) and
    a call of it: getppid, whose entry (``mov``) the kernel single-steps, or with ``emulated``
    getenv, whose entry (``push``) it emulates (images/disasm.uprobe_emulated). None where there is
    no such function (a libc whose getenv starts otherwise)."""
    from cyclescope.images.disasm import uprobe_emulated_at

    where = _libc_function("getenv" if emulated else "getppid")
    if where is None:
        return None
    if not emulated:
        return where, os.getppid
    if not uprobe_emulated_at(*where):
        return None
    getenv = ctypes.CDLL(None).getenv
    getenv.restype = ctypes.c_char_p
    return where, lambda: getenv(b"CYCLESCOPE_UNSET_VARIABLE")


def _thread_ns(call: Callable[[], object], calls: int) -> int:
    """This thread's CPU time for ``calls`` calls of ``call``."""
    t0 = time.thread_time_ns()
    for _ in range(calls):
        call()
    return time.thread_time_ns() - t0


def _median_within(per_hit: list[float], lowest: float) -> float | None:
    per_hit.sort()
    cost = per_hit[len(per_hit) // 2]
    return cost if lowest < cost < 500e-6 else None


def measure_uprobe_hit_s(calls: int = 3000, rounds: int = 3, emulated: bool = False) -> float | None:
    """Seconds of this thread's CPU a uprobe hit costs (the trap, counting mode), or None if it
    cannot be measured: a C library function called ``calls`` times without and with an exact
    uprobe counter at its entry, alternately, the median of ``rounds``. getppid's entry (``mov``) is
    single-stepped (bench/probecost.py measures the same on a compiled loop: 5.81 us on Zen 3,
    15.97 us on a Xeon with AMX); with ``emulated``, getenv's (a ``push`` the kernel emulates:
    images/disasm.uprobe_emulated; 0.48 us against 14.3 us on that Xeon)."""
    from cyclescope.collect import kernel

    pmu = kernel.uprobe_pmu_type()
    probed = _probed_call(emulated)
    if pmu is None or probed is None:
        return None
    where, call = probed
    per_hit: list[float] = []
    for _ in range(rounds):
        off = _thread_ns(call, calls)
        try:
            fd = kernel.open_uprobe_counter(pmu, where[0], where[1], 0, -1)
        except (OSError, kernel.PerfOpenError):
            return None
        try:
            kernel.ioctl_enable(fd)
            on = _thread_ns(call, calls)
            hits = kernel.read_counter(fd)[0]
        finally:
            kernel.close_fd(fd)
        if hits < calls // 2:
            return None  # not this function's calls (a libc without a function of its own)
        per_hit.append((on - off) / hits / 1e9)
    return _median_within(per_hit, 0.02e-6 if emulated else 0.2e-6)


def measure_sampled_hit_s(calls: int = 3000, rounds: int = 3) -> float | None:
    """Seconds of this thread's CPU a sampled uprobe hit costs (a sample with one register written
    to a ring at each hit, as goal probes take them) at an instruction the kernel emulates: getenv's
    ``push``, called ``calls`` times without and with a sampler on this thread, alternately, the
    median of ``rounds``; None if it cannot be measured (0.58 us on a Xeon with AMX, bench/probecost.py,
    against 0.41 us counting only)."""
    from cyclescope.collect import kernel
    from cyclescope.perf.abi import X86Reg

    pmu = kernel.uprobe_pmu_type()
    probed = _probed_call(True)
    if pmu is None or probed is None:
        return None
    where, call = probed
    pages = 256  # 1 MiB: every sample of a round fits (about 80 bytes each)
    per_hit: list[float] = []
    for _ in range(rounds):
        off = _thread_ns(call, calls)
        try:
            fd = kernel.open_uprobe_sampler(pmu, where[0], where[1], 0, -1, 1 << int(X86Reg.DI), False, False,
                                            pages * kernel.PAGE_SIZE)
        except (OSError, kernel.PerfOpenError):
            return None
        ring = None
        try:
            ring = kernel.RingBuffer(fd, pages)
            kernel.ioctl_enable(fd)
            on = _thread_ns(call, calls)
            got = len(ring.read())
        except OSError:
            return None
        finally:
            if ring is not None:
                ring.close()
            kernel.close_fd(fd)
        if got < calls * 40:  # the samples did not land: not measured
            return None
        per_hit.append((on - off) / calls / 1e9)
    return _median_within(per_hit, 0.02e-6)


def sampled_hit_cost(cache_dir: Path | None) -> float | None:
    """measure_sampled_hit_s, once per boot."""
    return _per_boot(cache_dir, "uprobe-sampled-emulated", measure_sampled_hit_s)


def uprobe_hit_cost(cache_dir: Path | None, emulated: bool = False) -> float | None:
    """measure_uprobe_hit_s, once per boot (about 0.05-0.15 s the first time)."""
    return _per_boot(cache_dir, "uprobe-hit-emulated" if emulated else "uprobe-hit",
                     lambda: measure_uprobe_hit_s(emulated=emulated))


def charged_hit_s(at_least_s: float, extra_s: float, emulated: bool = False) -> float:
    """What a budget charges a uprobe hit on this machine: the trap as measured once per boot
    (uprobe_hit_cost) plus ``extra_s`` (what follows it, or the sample it writes), never less than
    ``at_least_s`` (the constant set on Zen 3). A Xeon with AMX traps in 16-17 us, 2.7 times Zen 3's:
    charged Zen 3's constants, its anchors spent about 2.5 times their budget and its goal probes
    1.5 times (bench/out/probecost_intel1.json). A hit on an instruction the kernel emulates
    (``emulated``) is charged its own trap as measured, plus ``extra_s``; where that cannot be
    measured, as a single-stepped one."""
    from cyclescope.images.cache import Cache

    if emulated:
        cheap = uprobe_hit_cost(Cache().root, emulated=True)
        if cheap:
            return cheap + extra_s
    measured = uprobe_hit_cost(Cache().root)
    return max(at_least_s, measured + extra_s) if measured else at_least_s
