"""Where timer samples land relative to the instruction retirement waits on.

Measured on this kind of machine (AMD EPYC, Zen 3, under Firecracker;
bench/skid.py fits it against callgrind's exact counts): a cpu-clock
interrupt is taken at an instruction boundary *after* the instruction the
core was waiting on, for most instructions: the cycles llvm-mca attributes
to instruction j (the gap before it retires) show up as samples on j+1.
Dividers are the exception (samples land on the divide itself: the
interrupt does not wait for it), and loads spread over the next few
instructions (the interrupt waits for the data, then retirement runs on).

So frequency estimation compares samples with the model *moved by the
skid*: M'_i = sum_j K_kind(j)[i - j] * M_j, within the block (wrapping
around in a loop whose block jumps to itself). Cycles skidding past the end
of a block land in a successor: they are left out of M', and show up there
as extra samples at the block head, which the smallest-ratio rule ignores.
"""

from __future__ import annotations

from collections.abc import Sequence

from cyclescope.images.disasm import Insn, InsnInfo

# Share of a blocking instruction's cycles landing 0, 1, 2, 3 instructions later.
KERNELS: dict[str, tuple[float, ...]] = {
    "div": (1.0,),
    "load": (0.58, 0.2, 0.07, 0.15),
    "store": (0.0, 1.0),
    "other": (0.0, 1.0),
}


def kind(info: InsnInfo, ins: Insn) -> str:
    if info.kind in ("div", "sqrt"):
        return "div"
    if info.loads and not ins.mnemonic.startswith(("pop", "ret")):
        return "load"
    if info.stores:
        return "store"
    return "other"


def skidded(ms: Sequence[float], insns: Sequence[Insn], infos: Sequence[InsnInfo], wraps: bool,
            kernels: dict[str, tuple[float, ...]] | None = None) -> list[float]:
    """M' for one block: each instruction's model cycles moved to where its samples land."""
    kernels = kernels or KERNELS
    n = len(ms)
    out = [0.0] * n
    for j, m in enumerate(ms):
        if m <= 0:
            continue
        k = kernels.get(kind(infos[j], insns[j]), KERNELS["other"])
        for d, w in enumerate(k):
            if not w:
                continue
            i = j + d
            if i >= n:
                if not wraps:
                    continue
                i %= n
            out[i] += m * w
    return out
