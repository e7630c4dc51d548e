"""BOLT's profile without branch records ("no_lbr" fdata), as `perf2bolt -nl` writes it.

The format (llvm-project bolt/lib/Profile/DataAggregator.cpp, writeAggregatedFile): a header line
`no_lbr EVENT...`, then one line per sampled instruction: `1 FUNCTION OFFSET COUNT`, where 1 says
FUNCTION is a symbol, OFFSET is the instruction's offset from the function's start in hex, and
COUNT is the samples there. FUNCTION is the symbol's linkage (mangled) name, as BOLT knows
functions by their symbols; a space in a name is escaped with a backslash. BOLT names a local
(static) function NAME/FILE/N, N counting the same NAME/FILE from 1 in address order
(RewriteInstance's uniquified alternative name), so that is what such a function is called here. BOLT turns the samples
into block and edge counts itself (its own inference for profiles without branch records).

PLT stubs (the `name@plt` symbols images/elf.py makes for them) are left out: BOLT keeps no profile
for them (llvm-bolt-16 reads a line for `printf@plt` or `printf@PLT` exactly as one for a name it
does not know), so writing them would only make the file claim functions BOLT never matches.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np


@dataclass
class FdataResult:
    text: str
    functions: int
    samples: int
    outside: int  # samples at addresses no function symbol covers (not written)
    plt: int = 0  # samples in PLT stubs (not written: BOLT keeps no profile for them)


def escape(name: str) -> str:
    return name.replace("\\", "\\\\").replace(" ", "\\ ")


def bolt_names(starts: np.ndarray, names: Sequence[str], local: dict[int, tuple[str, str]]) -> list[str]:
    """The name BOLT gives each function: its symbol name, or NAME/FILE/N for a local symbol."""
    seen: dict[tuple[str, str], int] = {}
    out = []
    for a, n in zip(starts.tolist(), names, strict=True):
        loc = local.get(int(a))
        if loc is None or loc[0] != n:
            out.append(n)
            continue
        k = seen[loc] = seen.get(loc, 0) + 1
        out.append(f"{n}/{loc[1]}/{k}" if loc[1] else f"{n}/{k}")
    return out


def render(events: Iterable[str], offsets: np.ndarray, counts: np.ndarray, starts: np.ndarray,
           ends: np.ndarray, names: Sequence[str]) -> FdataResult:
    """offsets/counts: samples per instruction (the image's link-time addresses); starts/ends/names:
    its function symbols, sorted by start."""
    lines = ["no_lbr " + " ".join(events)]
    order = np.argsort(offsets, kind="stable")
    offsets, counts = offsets[order], counts[order]
    idx = np.searchsorted(starts, offsets, side="right").astype(np.int64) - 1
    ok = idx >= 0
    safe = np.where(ok, idx, 0)
    ok &= offsets < ends[safe]
    funcs: set[int] = set()
    written = plt = 0
    for i, off, c in zip(safe[ok].tolist(), offsets[ok].tolist(), counts[ok].tolist(), strict=True):
        if c <= 0:
            continue
        if names[i].endswith("@plt"):
            plt += int(c)
            continue
        lines.append(f"1 {escape(names[i])} {off - int(starts[i]):x} {int(c)}")
        funcs.add(i)
        written += int(c)
    outside = int(counts[~ok].sum())
    return FdataResult("\n".join(lines) + "\n", len(funcs), written, outside, plt)
