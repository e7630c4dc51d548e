"""Reading callgrind's output (`valgrind --tool=callgrind --dump-instr=yes`): exact
per-instruction execution counts, the ground truth for frequency estimates.

The format (valgrind docs, "Callgrind Format Specification"): after the
header, ``ob=``/``fl=``/``fn=`` lines set the object, file and function
(names compressed as ``(id) name`` the first time, ``(id)`` after), and
cost lines give subpositions (here ``instr line``) then event counts.
Subpositions are compressed: ``+N``/``-N`` relative to the previous one,
``*`` the same. A ``calls=COUNT TARGET`` line is followed by a cost line
holding the call's *inclusive* cost, not an execution count, which is
skipped; ``jump=``/``jcnd=`` lines give branch counts. The same address can
appear on several lines (for instance under different source lines): they
add up. Addresses are as the object file lays them out (ELF addresses, for
PIE executables and shared libraries alike).
"""

from __future__ import annotations

import contextlib
import re
from collections import defaultdict
from dataclasses import dataclass, field

_NAME_RE = re.compile(r"^\((\d+)\)(?:\s+(.*))?$")


@dataclass
class CallgrindProfile:
    events: list[str]
    # object path -> address -> counts of the first event (Ir: executions)
    counts: dict[str, dict[int, int]] = field(default_factory=lambda: defaultdict(dict))
    # object path -> (source address, target address) -> times taken, for jumps and conditional jumps
    jumps: dict[str, dict[tuple[int, int], int]] = field(default_factory=lambda: defaultdict(dict))
    # object path -> source address -> times the conditional jump executed
    cond_exec: dict[str, dict[int, int]] = field(default_factory=lambda: defaultdict(dict))
    functions: dict[str, dict[str, int]] = field(default_factory=lambda: defaultdict(dict))  # ob -> fn -> first addr
    summary: int = 0
    # object path -> address -> every event's count (the events line's order), with keep_all=True:
    # with --cache-sim=yes --branch-sim=yes, the D1/LL misses and mispredicts of each instruction
    costs: dict[str, dict[int, list[int]]] = field(default_factory=lambda: defaultdict(dict))

    def event(self, ob: str, name: str) -> dict[int, int]:
        """One event's count per address of ``ob`` (needs keep_all)."""
        if name not in self.events:
            return {}
        k = self.events.index(name)
        return {a: v[k] for a, v in self.costs[ob].items() if v[k]}

    def total(self) -> int:
        return sum(sum(d.values()) for d in self.counts.values())

    def object_for(self, path_suffix: str) -> str | None:
        for ob in self.counts:
            if ob == path_suffix or ob.endswith("/" + path_suffix.lstrip("/")):
                return ob
        return None


def _sub(tok: str, prev: int) -> int:
    if tok == "*":
        return prev
    if tok.startswith(("+", "-")):
        return prev + int(tok, 0)
    return int(tok, 0)


def parse_callgrind(text: str, keep_all: bool = False) -> CallgrindProfile:
    npos = 1
    names: dict[tuple[str, str], str] = {}
    prof = CallgrindProfile([])
    ob = ""
    last = [0, 0]
    skip_next = False
    pending_jump: tuple[int, list[str]] | None = None

    def name(kind: str, value: str) -> str:
        m = _NAME_RE.match(value.strip())
        if not m:
            return value.strip()
        key = (kind, m.group(1))
        if m.group(2) is not None:
            names[key] = m.group(2)
        return names.get(key, m.group(1))

    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        c = line[0]
        if c.isdigit() or c in "+-*":
            parts = line.split()
            pos = [_sub(parts[i], last[i]) if i < len(parts) else last[i] for i in range(npos)]
            last[: len(pos)] = pos
            if skip_next:
                skip_next = False
                continue
            if pending_jump is not None:
                kind, jp = pending_jump
                pending_jump = None
                _record_jump(prof, ob, pos[0], kind, jp)
            vals = parts[npos:]
            if vals:
                d = prof.counts[ob]
                d[pos[0]] = d.get(pos[0], 0) + int(vals[0])
                if keep_all:
                    cur = prof.costs[ob].get(pos[0])
                    if cur is None:
                        cur = prof.costs[ob][pos[0]] = [0] * max(1, len(prof.events))
                    for i, v in enumerate(vals[: len(cur)]):
                        cur[i] += int(v)
            continue
        key, eq, value = line.partition("=")
        if eq:
            if key == "ob":
                ob = name("ob", value)
            elif key == "cob":
                name("ob", value)
            elif key in ("fl", "fi", "fe", "cfi", "cfl"):
                name("fl", value)
            elif key == "fn":
                prof.functions[ob].setdefault(name("fn", value), -1)
            elif key == "cfn":
                name("fn", value)
            elif key == "calls":
                # The target subpositions are compressed like a cost line's but do not move the
                # reference for the next cost line (checked against the summary total).
                skip_next = True
            elif key in ("jump", "jcnd"):
                pending_jump = (1 if key == "jump" else 2, value.split())
            continue
        hk, _, hv = line.partition(":")
        hk = hk.strip()
        if hk == "events":
            prof.events = hv.split()
        elif hk == "positions":
            npos = len(hv.split())
            last = [0] * npos
        elif hk in ("summary", "totals") and hv.split():
            with contextlib.suppress(ValueError):
                prof.summary = int(hv.split()[0])
    return prof


def _record_jump(prof: CallgrindProfile, ob: str, src: int, kind: int, parts: list[str]) -> None:
    """jump=COUNT TARGET; jcnd=TAKEN/EXECUTED TARGET. The cost line after it gives the source.

    callgrind 3.19 writes jcnd as taken/executed (898/899 for a loop of 899
    iterations), the reverse of the order the format documentation names.
    """
    try:
        if kind == 1:
            taken = int(parts[0])
            execs = taken
        else:
            a, _, b = parts[0].partition("/")
            taken, execs = int(a), int(b)
        tgt_tok = parts[1]
        tgt = int(tgt_tok, 0) if not tgt_tok.startswith(("+", "-", "*")) else _sub(tgt_tok, src)
    except (IndexError, ValueError):
        return
    j = prof.jumps[ob]
    j[(src, tgt)] = j.get((src, tgt), 0) + taken
    if kind == 2:
        ce = prof.cond_exec[ob]
        ce[src] = ce.get(src, 0) + execs
