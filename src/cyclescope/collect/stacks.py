"""Call stacks from PERF_SAMPLE_CALLCHAIN (frame-pointer unwinding in the kernel), mapped and counted.

A callchain is a list of addresses, leaf first, with context markers (PERF_CONTEXT_KERNEL,
PERF_CONTEXT_USER, ...) before the frames of each context. The first frame of a context is the
interrupted PC; the others are return addresses, so they are looked up one byte earlier (the call
instruction, in the caller's procedure and line, even when the call is the caller's last
instruction). Frames map to (image, offset) like samples; stacks are interned as tuples and
counted per (stack, event) between flushes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from cyclescope.db.stacks import StackCounts

PERF_CONTEXT_HV = (1 << 64) - 32
PERF_CONTEXT_KERNEL = (1 << 64) - 128
PERF_CONTEXT_USER = (1 << 64) - 512
PERF_CONTEXT_GUEST = (1 << 64) - 2048
PERF_CONTEXT_MAX = (1 << 64) - 4095
MAX_DEPTH = 127  # attr.sample_max_stack


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
            chains: Sequence[tuple[int, ...] | None], comms: Sequence[int] | None = None) -> None:
        """One drain: per sample, its pid, ip, event index, callchain (None: none recorded) and
        command when it was taken (a CommTable index)."""
        per: list[list[tuple[int, bool, bool]]] = []
        fp, fa, fk = [], [], []
        for pid, ip, ch in zip(pids.tolist(), ips.tolist(), chains, strict=True):
            frames = split_chain(ch or (), ip)  # no callchain: the sampled ip alone
            per.append(frames)
            for a, k, ret in frames:
                fp.append(pid)
                fa.append(a - 1 if ret else a)
                fk.append(k)
        if not fa:
            return
        img, off = mapper.map_frames(np.array(fp, np.int64), np.array(fa, np.uint64), np.array(fk, bool))
        img_l, off_l = img.tolist(), off.tolist()
        pos = 0
        cur = self.cur
        cm = list(comms) if comms is not None else [-1] * len(per)
        for frames, e, comm in zip(per, events.tolist(), cm, strict=True):
            n = len(frames)
            if not n:
                continue
            stack = tuple(zip(img_l[pos : pos + n], off_l[pos : pos + n], strict=True))
            pos += n
            cur.counts[(cur.intern(stack), e, int(comm))] += 1
            self.samples += 1
            self.frames += n

    def take(self) -> StackCounts:
        out, self.cur = self.cur, StackCounts()
        return out
