"""Call stacks from PERF_SAMPLE_CALLCHAIN (frame-pointer unwinding in the kernel), mapped and counted.

A callchain is a list of addresses, leaf first, with context markers (PERF_CONTEXT_KERNEL,
PERF_CONTEXT_USER, ...) before the frames of each context. The first frame of a context is the
interrupted PC; the others are return addresses, so they are looked up one byte earlier (the call
instruction, in the caller's procedure and line, even when the call is the caller's last
instruction). Frames map to (image, offset) like samples; stacks are interned as tuples and
counted per (stack, event) between flushes.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from cyclescope.db.stacks import StackCounts
from cyclescope.perf.abi import PERF_CONTEXT_HV, PERF_CONTEXT_KERNEL, PERF_CONTEXT_MAX

if TYPE_CHECKING:
    from pathlib import Path

    from cyclescope.collect.processor import Context, Drain
    from cyclescope.collect.session import CallGraph
    from cyclescope.collect.unwind import DwarfStacks
    from cyclescope.db.layout import Database



def split_chain(chain: tuple[int, ...], sampled_ip: int) -> list[tuple[int, bool, bool]]:
    """(address, is kernel, is a return address) per frame, leaf first, markers removed.
    Without markers (older kernels), every frame is user and the first is the sampled ip."""
    out: list[tuple[int, bool, bool]] = []
    kernel = False
    first_in_context = True
    for a in chain:
        if a >= PERF_CONTEXT_MAX:
            kernel = a in (PERF_CONTEXT_KERNEL, PERF_CONTEXT_HV)
            first_in_context = True
            continue
        if a == 0:
            continue  # the end of a frame-pointer chain in code without frame pointers
        # The first user frame after kernel frames is where user space was interrupted (a PC, not a
        # return address); the very first frame is the sampled ip.
        out.append((a, kernel, not first_in_context))
        first_in_context = False
    if not out and sampled_ip:
        out.append((sampled_ip, False, False))
    return out


class StackAggregator:
    def __init__(self) -> None:
        self.cur = StackCounts()
        self.samples = 0
        self.frames = 0

    def add(self, mapper: Any, pids: np.ndarray, ips: np.ndarray, events: np.ndarray,
            chains: Sequence[tuple[int, ...] | None], comms: Sequence[int] | None = None,
            counts: Sequence[int] | None = None, python: Sequence[tuple[int, ...]] | None = None,
            python_stack: Any = None) -> None:
        """One drain: per sample, its pid, ip, event index, callchain (None: none recorded) and
        command when it was taken (a CommTable index); ``counts``: the samples each row stands for
        (None: one); ``python``: each row's Python frames as the eBPF program read them, which
        ``python_stack(pids, native stacks, pythons)`` splices into the stacks (all of the drain's
        at once: collect/pyframes.py's PythonFrames.stacks)."""
        # Equal samples (same process, chain, event and command) are mapped and interned once:
        # in a hot loop most samples repeat a few chains.
        cm = list(comms) if comms is not None else [-1] * len(pids)
        ns = list(counts) if counts is not None else [1] * len(pids)
        py = list(python) if python is not None and python_stack is not None else [()] * len(pids)
        groups: dict[tuple[int, int, tuple[int, ...], int, int, tuple[int, ...]], int] = {}
        for pid, ip, ch, e, comm, c, pf in zip(pids.tolist(), ips.tolist(), chains, events.tolist(), cm, ns, py,
                                               strict=True):
            k = (pid, ip if len(ch or ()) <= 2 else 0, ch or (), e, int(comm), pf)  # short: maybe no frame
            groups[k] = groups.get(k, 0) + c
        per: list[list[tuple[int, bool, bool]]] = []
        fp, fa, fk = [], [], []
        for pid, ip, ch, _, _, _ in groups:
            frames = split_chain(ch, ip)  # no callchain: the sampled ip alone
            per.append(frames)
            for a, kern, ret in frames:
                fp.append(pid)
                fa.append(a - 1 if ret else a)
                fk.append(kern)
        if not fa:
            return
        img, off = mapper.map_frames(np.array(fp, np.int64), np.array(fa, np.uint64), np.array(fk, bool))
        img_l, off_l = img.tolist(), off.tolist()
        pos = 0
        stacks = []
        for frames in per:
            n = len(frames)
            stacks.append(tuple(zip(img_l[pos : pos + n], off_l[pos : pos + n], strict=True)))
            pos += n
        withpy = [r for r, g in enumerate(groups) if g[5] and stacks[r]]
        if withpy:  # the Python frames of the drain's stacks named at once
            keys = list(groups)
            named = python_stack([keys[r][0] for r in withpy], [stacks[r] for r in withpy],
                                 [keys[r][5] for r in withpy])
            for r, st in zip(withpy, named, strict=True):
                stacks[r] = st
        cur = self.cur
        for stack, ((_, _, _, e, comm, _), c) in zip(stacks, groups.items(), strict=True):
            if not stack:
                continue
            cur.counts[(cur.intern(stack), e, comm)] += c
            self.samples += c
            self.frames += len(stack) * c

    def take(self) -> StackCounts:
        out, self.cur = self.cur, StackCounts()
        return out


# At the end of a run, how long to wait for unwind tables still loading before the samples that
# need them are unwound as far as the tables at hand go.
FINISH_WAIT_S = 120.0


class StackProcessor:
    """Call stacks as one of the collector's processors (collect/processor.py): the drains'
    callchains (frame pointers, walked by the kernel) or user stack snapshots (unwound here with
    the binaries' .eh_frame: collect/unwind.py) go in; stack counts come out at every flush."""

    name = "stacks"
    needs_regs = False  # --call-graph dwarf asks the session for registers and stack itself

    def __init__(self, call_graph: CallGraph) -> None:
        self.call_graph = call_graph
        # The eBPF program walks the stacks (frame pointers, or unwind rows with dwarf:
        # collect/bpfunwind.py) and the drains bring callchains, as with fp.
        self.in_kernel = False
        self.agg = StackAggregator()
        self.dwarf: DwarfStacks | None = None
        self._ctx: Context | None = None

    def bind(self, ctx: Context) -> None:
        self._ctx = ctx
        if self.call_graph.mode == "dwarf" and not self.in_kernel:
            from cyclescope.collect.unwind import DwarfStacks, TableLoader
            from cyclescope.images.cache import Cache

            self.dwarf = DwarfStacks(TableLoader(ctx.table, Cache(), ctx.vdso))

    def process(self, d: Drain) -> None:
        if self._ctx is None or d.chains is None or not len(d):
            return
        if self.dwarf is None:
            self.agg.add(self._ctx.mapper, d.samples["pid"].astype(np.int64), d.samples["ip"], d.event, d.chains,
                         d.comm.tolist(), d.count.tolist() if d.count is not None else None, d.python,
                         self._ctx.python_stack)
            return
        rows = d.samples["regs"].tolist() if d.regs is not None else [-1] * len(d)
        self._unwound(self.dwarf.chains(self._ctx.mapper, d.samples["pid"].tolist(), d.samples["ip"].tolist(),
                                        d.event.tolist(), d.comm.tolist(), d.chains, rows, d.regs, d.stack,
                                        d.stack_len))

    def _unwind_waiting(self, force: bool = False) -> None:
        """Unwind the samples held back for tables that have arrived since (all of them: force)."""
        assert self.dwarf is not None and self._ctx is not None
        self._unwound(self.dwarf.chains(self._ctx.mapper, [], [], [], [], [], [], None, None, None, force=force))

    def _unwound(self, out: Any) -> None:
        if out.pids and self._ctx is not None:
            self.agg.add(self._ctx.mapper, np.array(out.pids, np.int64), np.array(out.ips, np.uint64),
                         np.array(out.events, np.int64), out.chains, out.comms)

    def forget(self, pid: int, tid: int) -> None:
        pass  # stacks are mapped when they are counted

    def finish(self) -> None:
        if self.dwarf is None:
            return
        # Tables still loading: wait for them (a walk may meet a new image on its way, so repeat
        # while that brings progress), then unwind what is left regardless.
        give_up = time.monotonic() + FINISH_WAIT_S
        while self.dwarf.waiting and self.dwarf.loader.pending() and time.monotonic() < give_up:
            self.dwarf.loader.wait(timeout=give_up - time.monotonic())
            self._unwind_waiting()
        self._unwind_waiting(force=True)

    def flush(self, db: Database, epoch: int, host: str) -> list[Path]:
        from cyclescope.db.stacks import write_stacks

        if self._ctx is None:
            return []
        if self.dwarf is not None and self.dwarf.waiting:
            self._unwind_waiting()  # stacks whose tables arrived since the last drain
        sc = self.agg.take()
        if not len(sc):
            return []
        table = self._ctx.table
        used = {i for st in sc.stacks for i, _ in st}
        if self._ctx.keep_symbols is not None:
            self._ctx.keep_symbols(i for i in used if i > 0)
        images = {table[i].key: table[i].to_json() for i in used if i > 0}
        return [write_stacks(db, epoch, host, sc, table.keys(), list(self._ctx.events), images,
                             self._ctx.mapper.comms.names)]

    def close(self) -> None:
        if self.dwarf is not None:
            self.dwarf.loader.close()

    def status(self) -> dict[str, Any]:
        out: dict[str, Any] = {"mode": self.call_graph.mode, "samples": self.agg.samples}
        if self.dwarf is not None:
            st = self.dwarf.stats
            out.update(unwound=st.samples, waiting=len(self.dwarf.waiting), no_tables=len(self.dwarf.loader.failed))
        return out

    def summary(self) -> str | None:
        """One line on --call-graph dwarf: stacks unwound, mean depth, why walks stopped."""
        if self.dwarf is None:
            return None
        st = self.dwarf.stats
        if not st.samples:
            return "unwound no user stacks"
        stops = ", ".join(f"{k} {100 * v / st.samples:.1f}%" for k, v in st.stops.most_common())
        line = (f"unwound {st.samples:,} user stacks, {st.frames / st.samples:.1f} frames on average; "
                f"stopped at: {stops}")
        if st.truncated_loading:
            line += f"; {st.truncated_loading:,} cut short while unwind tables loaded"
        if self.dwarf.loader.failed:
            line += f"; no unwind tables for {len(self.dwarf.loader.failed)} images"
        return line
