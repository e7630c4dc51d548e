"""LLVM's text sample profile (for clang -fprofile-sample-use) from calc's execution-count estimates.

Without branch records, block counts come from `calc` (DCPI's frequency estimation from PC
samples and the binary), not from raw sample counts: that is what lets a timer-sampled profile
say how often code ran rather than where time was spent.

The format (llvm/docs/SampleProfile, AutoFDO's text form)::

    function:TOTAL:HEAD
     LINE_OFFSET[.DISCRIMINATOR]: COUNT [callee:COUNT ...]

LINE_OFFSET is the source line minus the function's first line (its DW_AT_decl_line), as clang
computes it from DILocation; COUNT is the most any instruction at that line (and discriminator)
executed, as AutoFDO does; HEAD is the entry block's count; TOTAL the sum of the body counts.
Instructions inlined from other functions are counted at the line of the outermost inlined call
(no nested inline profiles: a documented simplification).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field


@dataclass
class FunctionProfile:
    name: str  # linkage (mangled) name
    head: int = 0
    body: dict[tuple[int, int], int] = field(default_factory=dict)  # (line offset, discriminator) -> count
    calls: dict[tuple[int, int], dict[str, int]] = field(default_factory=dict)  # location -> callee -> count

    def add(self, offset: int, disc: int, count: int) -> None:
        if offset < 0 or offset > 0xFFFF:
            return  # a line before the function's own (inlined or macro code): no valid offset
        k = (offset, disc)
        self.body[k] = max(self.body.get(k, 0), count)

    def add_call(self, offset: int, disc: int, callee: str, count: int) -> None:
        if offset < 0 or offset > 0xFFFF or count <= 0:
            return
        d = self.calls.setdefault((offset, disc), {})
        d[callee] = max(d.get(callee, 0), count)
        self.add(offset, disc, count)

    @property
    def total(self) -> int:
        return sum(self.body.values())


def render(functions: Iterable[FunctionProfile]) -> str:
    out: list[str] = []
    for f in sorted(functions, key=lambda f: (-f.total, f.name)):
        if f.total <= 0:
            continue
        out.append(f"{f.name}:{f.total}:{f.head}")
        for (off, disc), n in sorted(f.body.items()):
            if n <= 0:
                continue
            loc = f"{off}.{disc}" if disc else f"{off}"
            calls = f.calls.get((off, disc), {})
            tail = "".join(f" {c}:{k}" for c, k in sorted(calls.items(), key=lambda kv: (-kv[1], kv[0])))
            out.append(f" {loc}: {n}{tail}")
    return "\n".join(out) + ("\n" if out else "")
