"""Exact mode: stop the sampled thread, single-step the next L instructions, record what they did.

A cpu-clock perf event opened on the traced thread with attr.sigtrap (which needs
remove_on_exec, so it is opened after each exec) stops the thread with SIGTRAP
(si_code TRAP_PERF) where the sample falls. cyclescope, its tracer, then reads the
registers (general and xmm), copies the top of the stack, and steps L instructions
with PTRACE_SINGLESTEP, reading the registers after each step and the memory each
instruction touches (the thread is stopped, so memory is exactly what it sees).
About 95 us a step here: for targeted capture and ground truth, not everyday use.

Each stop also runs the interpreter (interp.py) from the same registers and stack
against the stopped process, and compares it step by step with the real execution:
``check`` counts how often the interpreter's results agree.

With ``how="interpret"`` (``record --exact interpret``) a stop is interpreted instead of
stepped, while the thread waits: the same paths at about 1.8 ms a stop for L = 32 rather
than 12.7 ms (the SQLite shell), which is how `optimize` samples paths (analysis/paths.py).
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from cyclescope.collect import kernel, ptrace
from cyclescope.collect.procmem import ProcessMemory
from cyclescope.perf.abi import PERF_ATTR_SIZE, AttrFlag, EventType, PerfEventAttr, SwId
from cyclescope.perf.records import SAMPLE_DTYPE
from cyclescope.values.api import Step
from cyclescope.values.insn import GP64, PERF_COLUMNS, decode, effective_address
from cyclescope.values.interp import Interpreter, RunResult

MISC_USER = 2
WALL = 0x40000000  # __WALL: wait for the thread whatever its kind


@dataclass
class ExactStop:
    tid: int
    regs: dict[str, int]  # at the stop: perf-style names (flags, not eflags)
    stack: bytes
    steps: list[Step]
    reason: str


@dataclass
class CheckStats:
    """The interpreter against single-stepping, step by step."""

    compared: int = 0  # steps both executed
    agree: int = 0  # same next PC, same results, same loaded value
    pc_differs: int = 0
    result_differs: int = 0
    load_differs: int = 0
    interp_shorter: int = 0  # the interpreter stopped before the real execution did
    reasons: Counter[str] = field(default_factory=Counter)

    def as_dict(self) -> dict[str, int]:
        d = {"compared": self.compared, "agree": self.agree, "pc_differs": self.pc_differs,
             "result_differs": self.result_differs, "load_differs": self.load_differs,
             "interp_shorter": self.interp_shorter}
        d.update({f"interp_stop_{k}": v for k, v in self.reasons.items()})
        return d


def compare(exact: list[Step], interp: RunResult, stats: CheckStats) -> None:
    stats.reasons[interp.reason] += 1
    n = min(len(exact), len(interp.steps))
    if len(interp.steps) < len(exact):
        stats.interp_shorter += 1
    for a, b in zip(exact[:n], interp.steps[:n], strict=True):
        stats.compared += 1
        if a.next_pc != b.next_pc:
            stats.pc_differs += 1
        elif a.results != b.results:
            stats.result_differs += 1
        elif a.loaded is not None and b.loaded is not None and a.loaded != b.loaded:
            stats.load_differs += 1
        else:
            stats.agree += 1


class ExactTracer:
    """Handles the stops of one traced process: arming the sigtrap event, capturing at each."""

    def __init__(self, pid: int, length: int, stack_bytes: int, period_ns: int, band: float = 1 / 16,
                 check: bool = True, seed: int | None = None, how: str = "step") -> None:
        self.pid = pid
        self.length = length
        self.stack_bytes = stack_bytes
        self.period_ns = period_ns
        self.band = band
        self.how = how  # "step": single-step with ptrace; "interpret": interpret while stopped
        self.check = check and how == "step"
        self.fd: int | None = None
        self.mem = ProcessMemory(pid)
        self.tracee = ptrace.Tracee(pid)
        self.interp = Interpreter(reader=lambda p: self.mem.read) if self.check or how == "interpret" else None
        self.stats = CheckStats()
        self.stops: list[ExactStop] = []
        self.perf_stops = 0
        self.traps_while_stepping = 0
        self.pending_signal = 0
        self.exited: int | None = None  # wait status once the process is gone
        self._rng = random.Random(seed)
        self._armed_once = False

    # --- the sigtrap event --------------------------------------------------------------------
    def _period(self) -> int:
        lo = int(self.period_ns * (1 - self.band))
        return self._rng.randint(max(1, lo), max(1, self.period_ns))

    def arm(self) -> None:
        """Open the sigtrap event on the (stopped, just exec'd) thread."""
        if self.fd is not None:
            kernel.close_fd(self.fd)  # removed from the task by the exec anyway
        a = PerfEventAttr()
        a.type = EventType.SOFTWARE
        a.size = PERF_ATTR_SIZE
        a.config = SwId.TASK_CLOCK
        a.sample_period = self._period()
        a.flags = int(AttrFlag.SIGTRAP | AttrFlag.REMOVE_ON_EXEC | AttrFlag.EXCLUDE_KERNEL | AttrFlag.EXCLUDE_HV)
        a.sig_data = 0x637363  # "csc": tells our traps from others
        self.fd = kernel.perf_event_open(a, self.pid, -1, what="the exact-mode sigtrap event")
        if not self._armed_once:
            ptrace.set_options(self.pid, ptrace.PTRACE_O_EXITKILL | ptrace.PTRACE_O_TRACEEXEC)
            self._armed_once = True

    def close(self) -> None:
        if self.fd is not None:
            kernel.close_fd(self.fd)
            self.fd = None

    # --- stops -----------------------------------------------------------------------------------
    def on_stop(self, status: int) -> None:
        """One wait status of the traced process; resumes it (or notes that it is gone)."""
        if os.WIFEXITED(status) or os.WIFSIGNALED(status):
            self.exited = status
            self.close()
            return
        if not os.WIFSTOPPED(status):
            return
        sig = os.WSTOPSIG(status)
        event = status >> 16
        if sig == signal.SIGTRAP and (event == ptrace.PTRACE_EVENT_EXEC or not self._armed_once):
            self.arm()  # the first stop (the exec of the command) or a later exec: re-arm
            ptrace.cont(self.pid, 0)
            return
        if sig == signal.SIGTRAP:
            _signo, code = self.tracee.siginfo()
            if code == ptrace.TRAP_PERF:
                self.perf_stops += 1
                self._capture()
                if self.fd is not None:
                    with contextlib.suppress(OSError):
                        kernel.ioctl_period(self.fd, self._period())
                if self.exited is None:
                    sig_out, self.pending_signal = self.pending_signal, 0
                    ptrace.cont(self.pid, sig_out)
                return
        ptrace.cont(self.pid, sig)  # the program's own signal: deliver it

    def _capture(self) -> None:
        regs = self.tracee.regs()
        xmm = self.tracee.xmm()
        state = {n: regs[n] for n in (*GP64, "rip")}
        state["flags"] = regs["flags"]
        stack = self._stack(state["rsp"])
        if self.how == "interpret":
            # The thread is stopped: the interpreter reads its memory as the thread sees it, and
            # its xmm registers are known, so only what it cannot run ends a run early.
            assert self.interp is not None
            res = self.interp.run(self.pid, dict(state), stack, self.length, known_vec=xmm)
            steps, reason = res.steps, res.reason
        else:
            interp = self.interp.run(self.pid, dict(state), stack, self.length) if self.interp is not None else None
            steps, reason = self._step(state, xmm)
            if interp is not None:
                compare(steps, interp, self.stats)
        perf_regs = dict(state)
        perf_regs["cs"], perf_regs["ss"] = regs["cs"], regs["ss"]
        self.stops.append(ExactStop(self.pid, perf_regs, stack, steps, reason))

    def _stack(self, rsp: int) -> bytes:
        n = self.stack_bytes
        while n >= 8:
            data = self.mem.read(rsp, n)
            if data is not None:
                return data
            n //= 2  # the stack ends before rsp + n
        return b""

    def _step(self, state: dict[str, int], xmm: dict[str, int]) -> tuple[list[Step], str]:
        steps: list[Step] = []
        cur: dict[str, int] = {**state, **xmm}
        pc = state["rip"]
        for i in range(self.length):
            code = self.mem.read(pc, 16)
            insn = decode(code, pc) if code else None
            if insn is None:
                return steps, "undecodable" if code else "unmapped"
            if insn.kind == "syscall":
                return steps, "syscall"  # where the interpreter stops too
            step = Step(pc, insn, dict(cur), sampled=(i == 0))
            m = insn.mem
            if m is not None:
                step.ea = effective_address(m, cur, insn.next_address)
                if m.segment:
                    step.ea = None
                if m.read and step.ea is not None:
                    data = self.mem.read(step.ea, min(m.size, 8))
                    step.loaded = int.from_bytes(data, "little") if data else None
            ptrace.singlestep(self.pid)
            _, status = os.waitpid(self.pid, WALL)
            if os.WIFEXITED(status) or os.WIFSIGNALED(status):
                self.exited = status
                self.close()
                return steps, "exited"
            sig = os.WSTOPSIG(status) if os.WIFSTOPPED(status) else 0
            if sig != signal.SIGTRAP:
                self.pending_signal = sig  # delivered when the thread resumes
                return steps, "signal"
            _signo, si_code = self.tracee.siginfo()
            if si_code == ptrace.TRAP_PERF:
                self.traps_while_stepping += 1
            regs = self.tracee.regs()
            if regs["rip"] == pc and si_code == ptrace.TRAP_PERF:
                return steps, "signal"  # the trap came before the step: stop here, the sample stands
            step.results = {w.name: w.extract(regs[w.full]) for w in insn.writes}
            if insn.vwrites:
                newx = self.tracee.xmm()
                for v in insn.vwrites:
                    if v in newx:
                        step.results[v] = newx[v] & 0xFFFFFFFFFFFFFFFF
                cur.update(newx)
            if m is not None and m.write and step.ea is not None:
                data = self.mem.read(step.ea, min(m.size, 8))
                step.stored = int.from_bytes(data, "little") if data else None
            step.next_pc = regs["rip"]
            steps.append(step)
            for n in GP64:
                cur[n] = regs[n]
            cur["rip"], cur["flags"] = regs["rip"], regs["flags"]
            pc = regs["rip"]
        return steps, "length"

    # --- handing the stops to value capture -----------------------------------------------------------
    def take_batch(self, stack_bytes: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray,
                                                    list[ExactStop]]:
        """The stops so far as a decoded-sample batch (samples, regs, stack, stack_len) and the stops."""
        stops, self.stops = self.stops, []
        n = len(stops)
        samples = np.zeros(n, SAMPLE_DTYPE)
        samples["ip"] = [s.regs["rip"] for s in stops]
        samples["pid"] = self.pid
        samples["tid"] = [s.tid for s in stops]
        samples["cpumode"] = MISC_USER
        samples["extra"] = -1
        samples["regs"] = np.arange(n, dtype=np.int32)
        regs = np.zeros((n, len(PERF_COLUMNS)), np.uint64)
        for name, col in PERF_COLUMNS.items():
            regs[:, col] = [s.regs.get(name, 0) for s in stops]
        stack = np.zeros((n, stack_bytes), np.uint8)
        stack_len = np.zeros(n, np.uint32)
        for i, s in enumerate(stops):
            b = np.frombuffer(s.stack[:stack_bytes], np.uint8)
            stack[i, : len(b)] = b
            stack_len[i] = len(b)
        return samples, regs, stack, stack_len, stops
