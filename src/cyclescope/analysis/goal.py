"""Goal-directed value profiling: the optimizer's cost-benefit model of value-based specialization
(Watterson and Debray, ../shared/seeds/002_704d1f54f0e04446.txt, section 4), over one procedure.

Specializing code C for the value v of register r at program point p makes it
``if (r == v) <C>_{r=v} else C``: the residual code drops every instruction that knowing v
evaluates, and pays a test at p on every execution. The model, as the paper gives it:

- Uses(p, r): the instructions that read the value r holds at p, from reaching definitions on the
  procedure's CFG (analysis/cfg.ReachingDefs; a call clobbers what the ABI lets it).
- Savings(I, r): I's latency (the static model's, llvm-mca) when I is *evaluatable* given r: it
  reads no memory, writes none, and r is the only register it reads (``cmp r, 5`` sets flags that
  make the following ``jcc`` evaluatable in turn). The paper's footnote 2, strength reduction, for
  the one case that pays most on x86: a division by r becomes a multiply-high and a shift
  (DIV_REDUCED cycles are left of its latency).
- IndirBenefit(I, r): when I is evaluatable, the benefit of knowing each register it writes, just
  after I. The equations are recursive through use-def cycles (a loop's induction variable); as
  alto does, they are solved approximately: a chain that comes back to a pair it is computing
  contributes nothing (a value redefined by every trip is known for one trip only).
- Benefit(p, r) = sum over Uses of ExecutionFreq(I) x Savings(I, r) + IndirBenefit(I, r), in
  cycles over the profiled run. A use reached by other definitions too sees p's value on at most
  ExecutionFreq(p) of its executions (the paper is silent on this; without path profiles that
  bound is what can be said).
- Rule (1): Benefit(p, r) x prob(v) - TestCost(r, v) x ExecutionFreq(p) >= phi, phi a share of
  the run's cycles (PHI_SHARE, an empirical choice as in the paper).
- Rule (2), static elimination: only pairs that pass rule (1) with prob(v) = 1 and the cheapest test
  (against zero) are worth profiling.
- Rule (3), dynamic elimination: the smallest probability the top value must reach,
  (phi + TestCost(r, 0) x ExecutionFreq(p)) / Benefit(p, r) (the paper writes phi + ..., which
  mixes cycles and a probability; this is rule (1) solved for prob(v)).

Candidates are every register at every program point where it is defined (and every register the
procedure reads as it was entered: arguments and the caller's values), plus expressions
(section 4.2): a loop's trip count where it depends on a register (unrolling: the loop's control
instructions go), and the difference of two registers a comparison tests (the branch goes).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from cyclescope.analysis.cfg import CFG, ENTRY, ReachingDefs
from cyclescope.analysis.loops import Loop
from cyclescope.images.disasm import Insn, InsnInfo, wide_register

# Costs in cycles per execution of the test at p. On x86-64 a compare (or test) and a conditional
# branch fuse into one micro-op: about a cycle of issue bandwidth where the branch predicts well.
# A value outside a sign-extended 32-bit immediate needs a movabs into a free register first.
TEST_COST_ZERO = 1.0
TEST_COST_IMM = 1.0
TEST_COST_WIDE = 2.0
DIV_REDUCED = 4.0  # cycles left of a division by a known divisor (multiply-high, shift)
PHI_SHARE = 0.001  # phi: a specialization must save at least this share of the run's cycles
NOT_CANDIDATES = frozenset({"rsp", "rip", "flags"})
NOT_FOLDABLE = frozenset({"syscall", "sysenter", "int", "int3", "cpuid", "rdtsc", "rdtscp", "rdrand", "rdseed",
                          "xchg", "cmpxchg", "lock", "pause", "lfence", "mfence", "sfence"})


def test_cost(value: int | None) -> float:
    """TestCost(r, v): comparing a register with ``value`` and branching (None: the cheapest, 0)."""
    if value is None or value == 0:
        return TEST_COST_ZERO
    signed = value - (1 << 64) if value >= 1 << 63 else value
    return TEST_COST_IMM if -(1 << 31) <= signed < (1 << 31) else TEST_COST_WIDE


@dataclass
class Candidate:
    """A profiling candidate: the value of ``reg`` (or of an expression) at a program point."""

    point: int  # instruction index: the definition (the value just after it); -1: the procedure's entry
    reg: str  # 64-bit register name, or the expression ("rdi-rsi", "trips@...", "same-as-ADDR-ADDR")
    kind: str  # "argument" (entry), "register" (a definition), "trips", "difference", "load"
    freq: float  # ExecutionFreq(p): executions of the point
    benefit: float  # Benefit(p, r): cycles the run would save if the value were always known
    folded: list[int] = field(default_factory=list)  # instructions evaluated or reduced, direct and indirect
    observe: list[tuple[int, str]] = field(default_factory=list)  # (instruction, register) that read the value
    at: int = -1  # instruction before which the test would go (the expressions' point)
    kept: bool = False  # rule (2)
    pair: int = -1  # "load": the instruction whose address the load's is compared with (M1)

    def net(self, prob: float, value: int | None) -> float:
        """Rule (1)'s left side, before phi: cycles saved net of the test."""
        return self.benefit * prob - test_cost(value) * self.freq

    def min_prob(self, phi: float) -> float:
        """Rule (3): the share the top value needs for rule (1) to hold (above 1: never)."""
        if self.benefit <= 0:
            return float("inf")
        return (phi + TEST_COST_ZERO * self.freq) / self.benefit

    def other_threshold(self, phi: float) -> float:
        """Rule (3) in counts: once the values other than the top one exceed this many of the
        point's executions, the candidate can no longer pass (the paper's cutoff)."""
        return max(0.0, (1.0 - self.min_prob(phi)) * self.freq)


def evaluatable(ins: Insn, info: InsnInfo, known: str) -> bool:
    """Whether knowing register ``known`` determines everything ``ins`` computes."""
    if info.loads or info.stores or info.kind in ("call", "ret") or ins.mnemonic in NOT_FOLDABLE:
        return False
    if ins.mnemonic.startswith(("rep", "lock")):
        return False
    reads = info.reads - {"rip"}
    return bool(reads) and reads <= {known}


def reduced(ins: Insn, info: InsnInfo, known: str) -> bool:
    """A division by ``known``: strength-reduced to a multiply and a shift once the divisor is known."""
    return info.kind == "div" and not info.loads and ins.mnemonic in ("div", "idiv") and \
        wide_register(ins.op_str) == known


class GoalModel:
    """Benefits of knowing register values in one procedure (see the module's docstring).

    ``latency``: cycles per instruction (the static model's); ``freq``: executions of each
    instruction over the profiled run (calc's counts); ``edge_freq``: of each CFG edge, by id. The
    procedure's entries are its entry edges' executions. ``confidence``: calc's confidence in each
    instruction's count (its block's: high, medium or low; all high when not given)."""

    def __init__(self, cfg: CFG, infos: Sequence[InsnInfo], latency: Sequence[float], freq: Sequence[float],
                 edge_freq: Sequence[float], confidence: Sequence[str] | None = None) -> None:
        self.cfg, self.infos, self.latency, self.freq, self.edge_freq = cfg, infos, latency, freq, edge_freq
        self.confidence = list(confidence) if confidence is not None else ["high"] * len(infos)
        self.entry_freq = sum(edge_freq[e.id] for e in cfg.edges if e.src == ENTRY)
        self.rd = ReachingDefs.of(cfg, infos)
        self.uses: dict[tuple[int, str], list[tuple[int, bool]]] = {}  # (def, reg) -> [(use, only def)]
        for k, info in enumerate(infos):
            if cfg.block_of[k] in cfg.unreachable:
                continue
            for r in info.reads - {"rip", "rsp"}:
                ds = self.rd.defs(r, k)
                for d in ds:
                    self.uses.setdefault((d, r), []).append((k, len(ds) == 1))
        self._memo: dict[tuple[int, str], tuple[float, frozenset[int]]] = {}
        self._active: set[tuple[int, str]] = set()
        self._live: dict[tuple[int, str], list[tuple[int, str]]] = {}

    def point_freq(self, d: int) -> float:
        return self.entry_freq if d < 0 else self.freq[d]

    def benefit(self, d: int, r: str) -> tuple[float, frozenset[int]]:
        """Benefit(p, r) for the value ``r`` holds just after instruction ``d`` (-1: at entry), and
        the instructions it folds or reduces."""
        key = (d, r)
        got = self._memo.get(key)
        if got is not None:
            return got
        if key in self._active:
            return 0.0, frozenset()  # a use-def cycle: the value is known for one trip only
        self._active.add(key)
        total = 0.0
        folded: set[int] = set()
        fp = self.point_freq(d)
        for k, only in self.uses.get(key, ()):
            ins, info = self.cfg.insns[k], self.infos[k]
            fk = self.freq[k]
            f = fk if only else min(fk, fp)  # executions of k that see this definition's value
            share = f / fk if fk > 0 else 1.0
            if evaluatable(ins, info, r):
                total += f * self.latency[k]
                folded.add(k)
                for w in info.writes - {"rip", "rsp"}:
                    b, fo = self.benefit(k, w)
                    total += b * share
                    folded |= fo
            elif reduced(ins, info, r):
                total += f * max(0.0, self.latency[k] - DIV_REDUCED)
                folded.add(k)
        self._active.discard(key)
        out = (total, frozenset(folded))
        self._memo[key] = out
        return out

    def observations(self, d: int, r: str) -> list[tuple[int, str]]:
        """Where the value of (d, r) is read, in the register it is read from: its uses reached by
        this definition alone, and the uses of copies of it (``mov ecx, edx``)."""
        out: list[tuple[int, str]] = []
        todo, seen = [(d, r)], set()
        while todo:
            key = todo.pop()
            if key in seen:
                continue
            seen.add(key)
            for k, only in self.uses.get(key, ()):
                if not only:
                    continue
                out.append((k, key[1]))
                ins, info = self.cfg.insns[k], self.infos[k]
                if ins.mnemonic == "mov" and evaluatable(ins, info, key[1]) and len(info.writes) == 1:
                    todo.append((k, next(iter(info.writes))))
        return out

    def available(self, d: int, r: str) -> list[tuple[int, str]]:
        """Every instruction at which the value of (d, r) is still in a register (this definition
        alone reaches it there, or one of its copies' does), with that register: where a sample
        shows the value, whether or not the instruction reads it."""
        got = self._live.get((d, r))
        if got is not None:
            return got
        out: list[tuple[int, str]] = []
        copies = [(d, r)] + [(k, reg) for k, reg in self.observations(d, r)
                             if self.cfg.insns[k].mnemonic == "mov" and (k, reg) != (d, r)]
        seen: set[tuple[int, str]] = set()
        for cd, cr in copies:
            src = (cd, cr)
            if src in seen:
                continue
            seen.add(src)
            if cd != d:  # a copy: the value lives in the register the mov writes
                info = self.infos[cd]
                if len(info.writes) != 1:
                    continue
                cr = next(iter(info.writes))
            for k in range(len(self.cfg.insns)):
                if self.cfg.block_of[k] not in self.cfg.unreachable and self.rd.defs(cr, k) == {cd}:
                    out.append((k, cr))
        live = self._live[(d, r)] = sorted(set(out))
        return live

    def candidates(self) -> list[Candidate]:
        """Every (point, register) with a use, arguments at entry first."""
        out = []
        for (d, r), _ in sorted(self.uses.items(), key=lambda x: x[0]):
            if r in NOT_CANDIDATES or r.startswith("v"):
                continue
            b, folded = self.benefit(d, r)
            out.append(Candidate(d, r, "argument" if d < 0 else "register", self.point_freq(d), b, sorted(folded),
                                 self.observations(d, r), at=d + 1 if d >= 0 else 0))
        return out

    def differences(self) -> list[Candidate]:
        """``cmp ra, rb`` (two registers): ra - rb known makes the comparison and what its flags
        decide evaluatable."""
        out = []
        for k, (ins, info) in enumerate(zip(self.cfg.insns, self.infos, strict=False)):
            if ins.mnemonic != "cmp" or info.loads or self.cfg.block_of[k] in self.cfg.unreachable:
                continue
            ops = [wide_register(o) for o in ins.op_str.split(",")]
            if len(ops) != 2 or None in ops or ops[0] == ops[1] or set(ops) & NOT_CANDIDATES:
                continue
            a, b = str(ops[0]), str(ops[1])
            fk = self.freq[k]
            flags, folded = self.benefit(k, "flags")
            out.append(Candidate(k, f"{a}-{b}", "difference", fk, fk * self.latency[k] + flags,
                                 sorted({k, *folded}), [(k, a), (k, b)], at=k))
        return out

    def difference_range(self, k: int) -> tuple[str, list[int]]:
        """The operands of the ``cmp`` at ``k`` as written ("edi-esi") and the instructions where
        both registers hold the values it compares: the same single definition of each reaches
        them (in its own block, any definitions that reach the cmp). Where a sample shows the
        difference; the cmp itself always."""
        ops = [o.strip() for o in self.cfg.insns[k].op_str.split(",")]
        regs = {str(wide_register(o)) for o in ops}
        same = self._same_definitions(regs, k)
        if same is None:
            b = self.cfg.blocks[self.cfg.block_of[k]]
            same = self._same_definitions(regs, k, range(b.first, b.last + 1), single=False) or [k]
        return "-".join(ops), same

    def _same_definitions(self, regs: set[str], k: int, where: Sequence[int] | None = None,
                          single: bool = True) -> list[int] | None:
        """The instructions (of ``where``, else every reachable one) that the same definitions of
        ``regs`` reach as reach ``k``, so that the registers hold the values they hold at ``k``;
        None when ``single`` and some register has several definitions reaching ``k``."""
        defs = {r: self.rd.defs(r, k) for r in regs}
        if single and any(len(d) != 1 for d in defs.values()):
            return None
        if where is None:
            where = [x for x in range(len(self.cfg.insns)) if self.cfg.block_of[x] not in self.cfg.unreachable]
        return [x for x in where if all(self.rd.defs(r, x) == d for r, d in defs.items())]

    def load_pairs(self, window: int = 8) -> list[Candidate]:
        """Section 4.2's load avoidance: a load M2 after a store or load M1 of the same size in its
        block, with no other store and no call between them, whose address registers have not
        changed since M1, and whose address is not statically M1's or statically different (the
        same registers): if the two addresses are usually equal, M2 need not load (it takes what
        M1 stored or loaded, after a test of the addresses). The expression profiled is
        address(M1) - address(M2), named ``same-as-<M1's address>-<M2's>`` (not @, which names
        call sites in kinds); the saving is M2's latency."""
        out = []
        infos = self.infos
        for b in self.cfg.blocks:
            if b.id in self.cfg.unreachable:
                continue
            prior: list[int] = []  # M1 candidates: the last store and the loads since
            for k in range(b.first, b.last + 1):
                info = infos[k]
                if info.kind in ("call", "ret"):
                    prior = []
                    continue
                mk = info.mem
                if info.loads and not info.stores and mk is not None and self.freq[k] > 0:
                    for j in prior[-window:]:
                        c = self._load_pair(j, k)
                        if c is not None:
                            out.append(c)
                if info.stores:
                    prior = [k] if mk is not None else []
                elif info.loads and mk is not None:
                    prior.append(k)
        return out

    def _load_pair(self, j: int, k: int) -> Candidate | None:
        mj, mk = self.infos[j].mem, self.infos[k].mem
        if mj is None or mk is None or mj.size != mk.size:
            return None
        regs_j = [r for r in (mj.base, mj.index) if r]
        regs_k = [r for r in (mk.base, mk.index) if r]
        if "rsp" in regs_j + regs_k:  # the stack frame: the compiler knows
            return None
        for r in regs_j:  # M1's address still formed by the same registers at M2
            d = self.rd.defs(r, j)
            if len(d) != 1 or self.rd.defs(r, k) != d:
                return None
        if (mj.base, mj.index, mj.scale) == (mk.base, mk.index, mk.scale):
            return None  # the same registers: the difference is the displacements', known statically
        fk = self.freq[k]
        # Named by both accesses: one M1 pairs with several loads, whose live ranges may overlap.
        name = f"same-as-{self.cfg.insns[j].address:x}-{self.cfg.insns[k].address:x}"
        return Candidate(k, name, "load", fk, fk * self.latency[k], [k], [(k, name)], at=k, pair=j)

    def load_range(self, j: int, k: int) -> list[int]:
        """Where both addresses of the pair (j, k) are formed by the same single definitions as at k."""
        regs = {r for m in (self.infos[j].mem, self.infos[k].mem) if m is not None for r in (m.base, m.index) if r}
        return self._same_definitions(regs, k) or [k]

    def trip_counts(self, loops: Sequence[Loop]) -> list[Candidate]:
        """A loop whose counter runs to a limit held in a register, or from a start held in one:
        its trip count known at entry unrolls it completely (its counter steps, compare and
        branch go); the limit's register, read by the loop's test, shows the count's values."""
        out = []
        index = {ins.address: k for k, ins in enumerate(self.cfg.insns)}
        for lp in loops:
            for c in lp.counters:
                if c.limit is None or c.init is None or (c.limit.reg is None and c.init.reg is None):
                    continue
                body = sorted(index[a] for a in lp.addresses if a in index)
                control = [k for k in body if c.reg in self.infos[k].writes or (c.reg in self.infos[k].reads
                           and "flags" in self.infos[k].writes)]
                control += [k for k in body if self.infos[k].kind == "branch" and k - 1 in control]
                hdr = index.get(lp.header)
                if hdr is None or not control:
                    continue
                entries = sum(self.edge_freq[e.id] for e in self.cfg.in_edges(self.cfg.block_of[hdr])
                              if e.src == ENTRY or e.src not in lp.blocks)
                benefit = sum(self.freq[k] * self.latency[k] for k in set(control))
                reg = c.limit.reg or c.init.reg or ""
                obs = [(k, reg) for k in body if reg in self.infos[k].reads]
                # The value profiled is the register's (the limit, else the start): the same value on
                # entry means the same trip count where the other end is fixed.
                out.append(Candidate(hdr, f"trips@{lp.header:#x}={reg}", "trips", entries, benefit,
                                     sorted(set(control)), obs, at=hdr))
                break
        return out


def select(cands: list[Candidate], phi: float) -> list[Candidate]:
    """Rule (2): the candidates that could pay in the best case (the only value, tested against 0)."""
    for c in cands:
        c.kept = c.benefit > 0 and c.benefit >= TEST_COST_ZERO * c.freq + phi
    return [c for c in cands if c.kept]
