"""Value capture at the sampling interrupt, in bulk, and the daemon's in-memory hotlists.

For every user-mode sample that carries registers and a stack snapshot (and whose
process may be value-sampled), the instruction at the sampled PC is decoded once
(per image and offset) into a plan: what each customization module wants of it.
Plans are evaluated over all samples of that PC at once with numpy:

- the registers the instruction reads (its inputs: the interrupt precedes it);
- the effective address of its memory operand;
- the outputs of the instruction before it, when PC is not a branch target (the
  previous instruction has just retired, so its destination registers hold its
  results); at a return point that is the call, and rax is what the callee returned;
- the call context: a return address into the caller, from the word at the top of
  the stack at a procedure's entry, else [rbp+8] when rbp frames the snapshot, else
  the first word of the snapshot that points just after a call instruction.

One sample in ``every`` is also interpreted for ``length`` instructions (see
interp.py); the tuple sequence goes through each module's ``transform``.

Only the interpretation runs at every drain (it reads the processes' memory, which
should change as little as possible since the interrupt); the rest waits until a few
drains' samples have gathered (CRUNCH_SAMPLES) and runs over them at once: about 5 ms
of each drain's work was fixed cost (grouping, the stack scan, the modules, hotlist
counting), whatever the drain's size. The observations of a batch of a hotlist whose p has
fallen below 1 since the last flush are first each kept with that p (hotlist.RunningP, the
paper's online rule); what remains becomes exact counts per (owner, image, offset, kind,
value), is reduced to hotlists, and waits to be merged into the hotlists of the flush
(hotlist.merge_sets): no Python runs per value.
"""

from __future__ import annotations

import os
import random
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from cyclescope.arrays import distinct, group
from cyclescope.binaries.symbolize import Symbolizer
from cyclescope.db.hotlist import (
    VALUE_DTYPE,
    HotlistSet,
    RunningP,
    cat_struct,
    hotlist_sizes,
    merge_sets,
    reduce_set,
    unique_struct,
)
from cyclescope.db.values import NamedHotlists, ValuesMeta
from cyclescope.images.disasm import read_code
from cyclescope.images.elf import ElfInfo, read_load_info
from cyclescope.images.maps import lookup_user
from cyclescope.images.registry import ImageTable
from cyclescope.perf.abi import MISC_USER
from cyclescope.values.api import MASK64, BatchEmit, Capture, Emit, Kinds, Step, StepBatch, ValueModule
from cyclescope.values.insn import PERF_COLUMNS, ROW_REGS, InsnDetail, decode
from cyclescope.values.modules import DEFAULT_MODULES, MAP_CODE, load_modules

if TYPE_CHECKING:
    from cyclescope.values.interp import Interpreter

MEM_KEY_DTYPE = np.dtype([("uid", "<i4"), ("image", "<i8"), ("offset", "<u8"), ("kind", "<i4")])
MAX_PROC_BYTES = 1 << 18  # disassemble procedures up to 256 KiB for boundaries and branch targets
SCAN_WORDS = 32  # stack words searched for a return address when nothing better is known
# Drains' samples gathered before capture and counting run over them at once (about 3 drains at
# 5 kHz), waiting at most CRUNCH_AGE_S (low rates: a library unloaded meanwhile would take its
# return addresses along) or until CRUNCH_STEPS interpreted steps wait (long runs: about 11 MB).
CRUNCH_SAMPLES = 2048
CRUNCH_AGE_S = 0.5
CRUNCH_STEPS = 1 << 15
_RSP, _RBP, _RIP = PERF_COLUMNS["rsp"], PERF_COLUMNS["rbp"], PERF_COLUMNS["rip"]
_ROW_PERM = [PERF_COLUMNS[name] for name in ROW_REGS]  # perf's register columns → interpreter rows


@dataclass
class ValueOptions:
    modules: tuple[str, ...] = DEFAULT_MODULES
    length: int = 4  # instructions interpreted after a sample (0: no interpretation)
    every: int = 2  # interpret one sample in this many
    stack: int = 512  # bytes of user stack copied at each interrupt
    users: frozenset[int] | None = None  # only processes of these uids (None: any)
    commands: frozenset[str] | None = None  # only processes with these command names
    seed: int | None = None
    # Interpretation may use at most this share of one CPU, measured per drain; past it the chosen
    # samples are not interpreted (counted as "over budget"), so that a long L never stalls draining
    # and costs PC samples. Capture at the interrupt is not limited: it is cheap and vectorized.
    budget: float = 0.5
    exact: bool = False  # sequences come from single-stepping (values/exact.py), not the interpreter
    goal: str | None = None  # a plan of `specialize --plan`: the goal module captures its candidates
    # A share of one CPU the programs may lose to the goal plan's probes (values/probes.py), which
    # capture cheap candidates at every execution; 0: samples only.
    goal_budget: float = 0.0


@dataclass
class ProcCode:
    start: int
    end: int
    addrs: np.ndarray  # instruction addresses (ELF vaddr), sorted
    targets: frozenset[int]  # direct branch targets inside the procedure


# A plan's captures as rows of int64 columns, for evaluating the captures of all a drain's PCs at
# once (plain columns: gathering and concatenating structured rows costs numpy several times more).
OP_REG, OP_REG_CTX, OP_PREV, OP_ADDR, OP_CTX, OP_STACK, OP_DIFF, OP_ADDRDIFF = range(8)
# _DISP: the stack offset for OP_STACK; _COL3.._DISP2: OP_ADDRDIFF's second address
_KIND, _OP, _COL, _COL2, _SCALE, _DISP, _SHIFT, _MASK, _KOFF, _COL3, _COL4, _SCALE2, _DISP2 = range(13)
_NO_OPS = np.zeros((0, 13), np.int64)


@dataclass
class Plan:
    entry: int | None  # the procedure's first address
    here: list[tuple[int, Capture]]  # (kind id, capture) at this PC
    prev_off: int | None
    prev: list[tuple[int, Capture]]  # captures of the previous instruction's outputs
    ops: np.ndarray = field(default_factory=lambda: _NO_OPS)  # the captures of here and prev, as op rows


def _compile(plan: Plan, insn: InsnDetail | None) -> np.ndarray:
    """The plan's captures as op rows (_KOFF: the key's offset, -1 for the sampled PC's); the
    captures that can never give a value here (a segment or rip-relative address, an instruction's
    address where it was not decoded, a context outside a known procedure) are left out."""
    rows: list[tuple[int, ...]] = []

    def col(r: str) -> int:
        return PERF_COLUMNS[r] if r else -1

    def reg_row(kind: int, op: int, cap: Capture, koff: int) -> None:
        assert cap.reg is not None
        rows.append((kind, op, PERF_COLUMNS[cap.reg.full], -1, 0, 0, cap.reg.shift, cap.reg.mask, koff))

    for kind, cap in plan.here:
        if cap.source == "reg":
            reg_row(kind, OP_REG_CTX if cap.with_ctx else OP_REG, cap, -1)
        elif cap.source == "addr":
            m = insn.mem if insn is not None else None
            if m is None or m.segment or m.base == "rip":
                continue
            rows.append((kind, OP_ADDR, col(m.base), col(m.index), m.scale, m.disp & MASK64, 0, 0, -1))
        elif cap.source == "ctx" and plan.entry is not None:
            rows.append((kind, OP_CTX, -1, -1, 0, 0, 0, 0, plan.entry))
        elif cap.source == "stack" and cap.offset >= 0:
            rows.append((kind, OP_STACK, -1, -1, 0, cap.offset, 0, 0, -1))
        elif cap.source == "diff" and cap.reg is not None and cap.reg2 is not None and not cap.reg.shift \
                and not cap.reg2.shift:
            rows.append((kind, OP_DIFF, PERF_COLUMNS[cap.reg.full], PERF_COLUMNS[cap.reg2.full], 0, 0, 0,
                         cap.reg.mask, -1))
        elif cap.source == "addrdiff" and cap.mems is not None:
            a, b = cap.mems
            rows.append((kind, OP_ADDRDIFF, col(a.base), col(a.index), a.scale, a.disp & MASK64, 0, 0, -1,
                         col(b.base), col(b.index), b.scale, b.disp & MASK64))
    if plan.prev_off is not None:
        for kind, cap in plan.prev:
            reg_row(kind, OP_PREV, cap, plan.prev_off)
    # disp and mask are 64-bit patterns: kept as int64, read back as uint64.
    rows = [r if len(r) == 13 else (*r, -1, -1, 0, 0) for r in rows]
    return np.array([[x - (1 << 64) if x >= 1 << 63 else x for x in r] for r in rows], np.int64).reshape(-1, 13)


class CodeIndex:
    """Instructions, procedure boundaries and return-address checks, per image, from the binaries."""

    def __init__(self, table: ImageTable, symbolizer: Symbolizer | None = None) -> None:
        self.table = table
        self.sym = symbolizer or Symbolizer(None)
        self._elf: dict[int, tuple[str, ElfInfo] | None] = {}
        self._procs: dict[tuple[int, int], ProcCode | None] = {}
        self._insns: dict[tuple[int, int], InsnDetail | None] = {}
        self._ret: dict[tuple[int, int], bool] = {}

    def _image(self, img: int) -> tuple[str, ElfInfo] | None:
        if img in self._elf:
            return self._elf[img]
        out = None
        info = self.table[img]
        if info.kind == "elf" and info.offsets == "vaddr":
            path = self.sym.binary(info).path
            if path:
                try:
                    out = (path, read_load_info(path))
                except (OSError, ValueError, Exception):
                    out = None
        self._elf[img] = out
        return out

    def code(self, img: int, start: int, end: int) -> bytes:
        im = self._image(img)
        if im is None:
            return b""
        try:
            return read_code(im[0], start, end, im[1])
        except (OSError, ValueError, Exception):
            return b""

    def insn(self, img: int, off: int) -> InsnDetail | None:
        k = (img, off)
        if k in self._insns:
            return self._insns[k]
        raw = self.code(img, off, off + 16)
        d = decode(raw, off) if raw else None
        if len(self._insns) > 1 << 18:
            self._insns.clear()
        self._insns[k] = d
        return d

    def proc(self, img: int, off: int) -> ProcCode | None:
        info = self.table[img]
        table = self.sym.table(info)
        if not len(table):
            return None
        i = int(table.lookup(np.array([off], np.uint64))[0])
        if i < 0:
            return None
        start, end = int(table.starts[i]), int(table.ends[i])
        k = (img, start)
        if k in self._procs:
            return self._procs[k]
        pc = None
        if end - start <= MAX_PROC_BYTES:
            from cyclescope.images.disasm import _cs

            raw = self.code(img, start, end)
            if raw:
                addrs, targets = [], set()
                for a, _size, mnem, ops in _cs(False).disasm_lite(raw, start):
                    addrs.append(a)
                    if mnem.startswith(("j", "loop")) and ops.startswith("0x"):
                        try:
                            t = int(ops, 16)
                        except ValueError:
                            continue
                        if start <= t < end:
                            targets.add(t)
                pc = ProcCode(start, end, np.array(addrs, np.uint64), frozenset(targets))
        self._procs[k] = pc
        return pc

    def prev(self, img: int, off: int, proc: ProcCode | None) -> InsnDetail | None:
        """The instruction before ``off`` when control can only have come from it."""
        if proc is None or off == proc.start or off in proc.targets:
            return None
        i = int(np.searchsorted(proc.addrs, off))
        if i <= 0 or i >= len(proc.addrs) or int(proc.addrs[i]) != off:
            return None
        p = self.insn(img, int(proc.addrs[i - 1]))
        if p is None or p.kind in ("jump", "ijump", "ret", "syscall") or p.next_address != off:
            return None
        return p

    def is_return_address(self, img: int, off: int) -> bool:
        """``off`` follows a call instruction (2 to 7 bytes long, ending exactly at ``off``)."""
        k = (img, off)
        r = self._ret.get(k)
        if r is not None:
            return r
        r = False
        if off >= 7:
            raw = self.code(img, off - 7, off)
            if len(raw) == 7:
                for n in (5, 6, 2, 3, 7, 4):
                    d = decode(raw[7 - n :] + b"\x90" * 8, off - n)
                    if d is not None and d.size == n and d.mnemonic == "call":
                        r = True
                        break
        if len(self._ret) > 1 << 18:
            self._ret.clear()
        self._ret[k] = r
        return r


@dataclass
class OwnerStats:
    samples: int = 0
    interpreted: int = 0
    steps: int = 0
    over_budget: int = 0
    stops: Counter[str] = field(default_factory=Counter)


def _modules(opts: ValueOptions) -> list[ValueModule]:
    """The modules the options name; with a goal plan, the goal module built from it."""
    if opts.goal is None:
        return load_modules(opts.modules)
    from cyclescope.values.goal import GoalModule, read_plan

    others = [m for m in opts.modules if m != "goal"]
    return [*(load_modules(others) if others else []), GoalModule(read_plan(opts.goal))]


MAX_PARENTS = 8  # how far up the FORK records an exited process's owner is looked for (ValueCapture._uid)


class ValueCapture:
    """Turns sampled registers and stacks into hotlists, per owner; flushes hand them over."""

    def __init__(self, opts: ValueOptions, mapper: Any, table: ImageTable, code: CodeIndex | None = None,
                 interpreter: Interpreter | None = None, modules: list[ValueModule] | None = None) -> None:
        self.opts = opts
        self.mapper = mapper
        self.table = table
        self.code = code or CodeIndex(table)
        self.modules = modules if modules is not None else _modules(opts)
        if interpreter is None and opts.length > 0 and not opts.exact:
            from cyclescope.values.interp import Interpreter  # not imported where nothing is interpreted (--goal)

            interpreter = Interpreter()
        self.interp = interpreter
        self.check: Counter[str] = Counter()
        self.kinds: list[str] = []
        self._kind_ids: dict[str, int] = {}
        self._plans: dict[tuple[int, int], Plan | None] = {}
        self._owners: dict[int, int | None] = {}
        self._pinned: dict[int, int | None] = {}
        self._pending: list[HotlistSet] = []
        self._pending_rows = 0
        self._running_p = RunningP(MEM_KEY_DTYPE)  # each hotlist's p since the last take
        # Drains waiting for _crunch: their samples' columns, the interpreted runs' samples (indices
        # into the drains' samples, concatenated), and their processes.
        self._drains: list[tuple[np.ndarray, ...]] = []
        self._drained = 0
        self._first_wait = 0.0
        self._run_sample: list[np.ndarray] = []
        self._drain_pids: set[int] = set()
        self.stats: dict[int, OwnerStats] = defaultdict(OwnerStats)
        self.skipped = Counter[str]()
        self._rng = np.random.default_rng(opts.seed)
        self._pyrng = random.Random(opts.seed)
        self._prev_capturers: list[Any] = [m for m in self.modules if hasattr(m, "prev_plan")]
        # Every module plans from the address alone (a goal plan): nothing is decoded (values/api.py).
        self._by_address = bool(self.modules) and all(hasattr(m, "plan_at") for m in self.modules) \
            and not self._prev_capturers
        self.started = 0.0
        self._last_interp = time.perf_counter()
        self._only = self._only_at()  # None: samples anywhere may give values

    # --- owners and filters ---------------------------------------------------------------
    def pin_owner(self, pid: int) -> int | None:
        """Look up and keep the owner of ``pid`` past its exit (exact mode hands over its last stops
        after the process is gone)."""
        uid = self._uid(pid)
        self._pinned[pid] = uid
        return uid

    def _uid(self, pid: int, by_command: bool = True, depth: int = 0) -> int | None:
        """The uid whose values these are; -1: not to be sampled; None: unknown. ``by_command``:
        apply the command filter with the process's current name (callers that know each sample's
        command filter by it themselves).

        The owner is the process's real uid, read from /proc. A process that exited before its
        samples were drained (a short command in a shell loop) may take its parent's, as a FORK
        record named it (``_inherited``)."""
        if pid in self._pinned:
            return self._pinned[pid]
        if pid in self._owners:
            uid = self._owners[pid]
        else:
            uid = None
            try:
                with open(f"/proc/{pid}/status") as f:
                    for line in f:
                        if line.startswith("Uid:"):
                            uid = int(line.split()[1])
                            break
            except (OSError, ValueError, IndexError):
                uid = None
            if uid is None and depth < MAX_PARENTS:
                uid = self._inherited(pid, depth)
            if uid is not None and uid >= 0 and self.opts.users is not None and uid not in self.opts.users:
                uid = -1  # not ours to sample
            if len(self._owners) > 65536:
                self._owners.clear()
            self._owners[pid] = uid
        if by_command and uid is not None and uid >= 0 and self.opts.commands is not None:
            st = self.mapper.procs.get(pid)
            name = self.mapper.comms.names[st.comm] if st is not None else ""
            if name not in self.opts.commands:
                uid = -1
        return uid

    def _inherited(self, pid: int, depth: int) -> int | None:
        """The owner of a process /proc no longer knows, from the process that forked it, where
        that cannot hand another user's values to someone else. fork copies the real uid and exec
        keeps it, but a set-user-ID program can set it (sudo's child runs with real uid 0 under a
        user's shell), so an ancestor's uid says only that the process was at most as privileged
        as root: its values go to root, who may read any process, or, when this recorder runs as
        that same user, to them (the kernel let them sample it: nothing more is revealed), and are
        skipped otherwise."""
        st = self.mapper.procs.get(pid)
        parent = st.parent if st is not None else 0
        if parent <= 0 or parent == pid:
            return None
        uid = self._uid(parent, by_command=False, depth=depth + 1)
        if uid is None or uid < 0:
            return uid
        return uid if uid == 0 or uid == os.geteuid() else None

    def forget(self, pid: int) -> None:
        """A process exited or exec'd (its name, owner and memory may change)."""
        if pid in self._drain_pids:
            self._crunch()  # its waiting samples map through the maps they were taken under
        self._owners.pop(pid, None)
        if self.interp is not None:
            self.interp.forget(pid)

    def _kind(self, name: str) -> int:
        k = self._kind_ids.get(name)
        if k is None:
            k = len(self.kinds)
            self.kinds.append(name)
            self._kind_ids[name] = k
        return k

    # --- plans ------------------------------------------------------------------------------
    def _plan(self, img: int, off: int) -> Plan | None:
        key = (img, off)
        if key in self._plans:
            return self._plans[key]
        if self._by_address:
            return self._keep_plan(key, self._plan_at(img, off))
        insn = self.code.insn(img, off)
        plan = None
        if insn is not None:
            proc = self.code.proc(img, off)
            image_key = self.table[img].key
            here = [(self._kind(c.kind), c) for m in self.modules
                    for c in (m.plan_in(image_key, insn) if hasattr(m, "plan_in") else m.plan(insn))]
            prev_off, prev_caps = None, []
            prev = self.code.prev(img, off, proc)
            if prev is not None:
                prev_off = prev.address
                prev_caps = [(self._kind(c.kind), c) for m in self._prev_capturers
                             for c in m.prev_plan(prev)]
            plan = Plan(proc.start if proc is not None else None, here, prev_off, prev_caps)
            plan.ops = _compile(plan, insn)
        return self._keep_plan(key, plan)

    def _plan_at(self, img: int, off: int) -> Plan:
        """The plan of modules that need only the address (``plan_at``): no decoding."""
        image_key = self.table[img].key
        here = [(self._kind(c.kind), c) for m in self.modules
                for c in getattr(m, "plan_at")(image_key, off)]  # noqa: B009 (not part of ValueModule)
        plan = Plan(None, here, None, [])
        plan.ops = _compile(plan, None)
        return plan

    def _keep_plan(self, key: tuple[int, int], plan: Plan | None) -> Plan | None:
        if len(self._plans) > 1 << 18:
            self._plans.clear()
        self._plans[key] = plan
        return plan

    # --- one drain ----------------------------------------------------------------------------
    def process(self, samples: np.ndarray, image: np.ndarray, offset: np.ndarray, regs: np.ndarray,
                stack: np.ndarray, stack_len: np.ndarray, comm: np.ndarray | None = None) -> int:
        """Take the samples of one drain: interpret one in ``every`` now; capture and counting wait
        for CRUNCH_SAMPLES samples (or a flush, or an exit or exec of one of their processes).
        Returns how many samples give values.

        ``comm``: each sample's command (CommTable index) when it was taken. With a command filter
        it decides per sample, since one drain may hold a process's samples from before and after
        an exec (a forked profiler child, say, before it becomes the profiled command)."""
        rows = samples["regs"]
        sel = np.flatnonzero((rows >= 0) & (samples["cpumode"] == MISC_USER) & (image > 0))
        if len(sel) and self._only is not None:
            sel = self._restrict(sel, image, offset)
        if not len(sel):
            return 0
        pids = samples["pid"][sel].astype(np.int64)
        upids, pinv = group(pids)
        owner = np.array([(-2 if (u := self._uid(int(p), comm is None)) is None else u)
                          for p in upids.tolist()], np.int64)[pinv]
        if comm is not None and self.opts.commands is not None:
            ucomm, cinv = group(comm[sel])
            names = self.mapper.comms.names
            allowed = np.array([0 <= c < len(names) and names[c] in self.opts.commands
                                for c in ucomm.tolist()], bool)[cinv]
            owner = np.where((owner >= 0) & ~allowed, -1, owner)
        ok = owner >= 0
        self.skipped["not allowed"] += int((owner == -1).sum())
        self.skipped["owner unknown"] += int((owner == -2).sum())
        sel, pids, owner = sel[ok], pids[ok], owner[ok]
        if not len(sel):
            return 0
        r = rows[sel]
        R = regs[r]
        S = stack[r] if stack.shape[1] else np.zeros((len(r), 0), np.uint8)
        L = stack_len[r].astype(np.int64)
        img = image[sel].astype(np.int64)
        off = offset[sel].astype(np.uint64)
        n = len(sel)
        for o in distinct(owner).tolist():
            self.stats[o].samples += int((owner == o).sum())
        if self.interp is not None and self.opts.length > 0:
            runs = self._interpret(pids, owner, R, S, L, sum(len(x) for x in self._run_sample))
            self._run_sample.append(self._drained + runs)
        if not self._drains:
            self._first_wait = time.monotonic()
        self._drains.append((pids, owner, R, S, L, img, off))
        self._drained += n
        self._drain_pids.update(distinct(pids).tolist())
        if (self._drained >= CRUNCH_SAMPLES or time.monotonic() - self._first_wait >= CRUNCH_AGE_S
                or (self.interp is not None and self.interp.buffered_steps >= CRUNCH_STEPS)):
            self._crunch()
        return n

    def _restrict(self, sel: np.ndarray, image: np.ndarray, offset: np.ndarray) -> np.ndarray:
        """The samples at the only instructions the modules capture at (a goal plan's live ranges):
        the others cost nothing more, not even their instructions' decoding."""
        assert self._only is not None
        im, off = image[sel], offset[sel]
        keep = np.zeros(len(sel), bool)
        for i in distinct(im).tolist():
            offs = self._only.get(self.table[int(i)].key)
            if offs is not None and len(offs):
                m = im == i
                keep[m] = np.isin(off[m], offs)
        return sel[keep]

    def _crunch(self) -> None:
        """Capture, interpreted steps' values and hotlist counting over the drains waiting."""
        if not self._drains:
            return
        cols = list(zip(*self._drains, strict=True))
        pids, owner, R, S, L, img, off = (np.concatenate(c) if len(c) > 1 else c[0] for c in cols)
        runs = np.concatenate(self._run_sample) if self._run_sample else np.zeros(0, np.int64)
        self._drains, self._drained, self._run_sample = [], 0, []
        self._drain_pids.clear()
        n = len(pids)
        # Group by PC; plans and procedure entries per group.
        pcs = np.empty(n, dtype=[("i", "<i8"), ("o", "<u8")])
        pcs["i"], pcs["o"] = img, off
        upc, ginv, count = unique_struct(pcs)
        known = self._plans
        plans = [known[k] if k in known else self._plan(*k)
                 for k in zip(upc["i"].tolist(), upc["o"].tolist(), strict=True)]
        entry = np.array([(p.entry if p is not None and p.entry is not None else -1) for p in plans],
                         np.int64)[ginv]
        at_entry = entry == off.astype(np.int64)
        ctx_img, ctx_off = self._contexts(pids, R, S, L, at_entry)

        keys_parts: list[np.ndarray] = []
        vals_parts: list[np.ndarray] = []
        self._evaluate(plans, ginv, count, owner, R, S, L, img, off, ctx_img, ctx_off, keys_parts, vals_parts)
        if self.interp is not None:
            batch = self.interp.take(ctx_off[runs], ctx_img[runs])
            if len(batch):
                steps = np.bincount(batch.run, minlength=len(runs))
                ro = owner[runs]
                for o in distinct(ro).tolist():
                    self.stats[o].steps += int(steps[ro == o].sum())
                self._transform(batch, pids[runs], ro, keys_parts, vals_parts)
        if keys_parts:
            keys = cat_struct(keys_parts)
            vals = cat_struct(vals_parts)
            batch_set = reduce_set(self._running_p.exact(keys, vals, self._rng), hotlist_sizes(self.kinds),
                                   rng=self._rng)
            self._running_p.update(batch_set)
            self._pending.append(batch_set)
            self._pending_rows += batch_set.rows
            if self._pending_rows > 400_000 and len(self._pending) > 1:
                merged = merge_sets(self._pending, hotlist_sizes(self.kinds), rng=self._rng)
                self._pending = [merged]
                self._pending_rows = merged.rows

    def _evaluate(self, plans: list[Plan | None], ginv: np.ndarray, count: np.ndarray, owner: np.ndarray,
                  R: np.ndarray, S: np.ndarray, L: np.ndarray, img: np.ndarray, off: np.ndarray, ctx_img: np.ndarray,
                  ctx_off: np.ndarray, keys_parts: list[np.ndarray], vals_parts: list[np.ndarray]) -> None:
        """Every plan's captures over the samples of its PC (``ginv``: each sample's plan; ``count``:
        each plan's samples), all at once: one row per (capture, sample)."""
        per_plan = [p.ops if p is not None else _NO_OPS for p in plans]
        nops = np.array([len(o) for o in per_plan], np.int64)
        if not nops.any():
            return
        ops = np.concatenate(per_plan)
        op_plan = np.repeat(np.arange(len(plans)), nops)
        # The samples of each plan, contiguous: plan g's are by_plan[start[g]:start[g] + count[g]].
        by_plan = np.argsort(ginv, kind="stable")
        start = np.cumsum(count) - count
        per_op = count[op_plan]
        op = np.repeat(np.arange(len(ops)), per_op)
        first = np.cumsum(per_op) - per_op
        smp = by_plan[start[op_plan][op] + np.arange(len(op)) - first[op]]
        code = ops[:, _OP][op]
        kind = ops[:, _KIND][op]
        koff = ops[:, _KOFF][op]
        koff = np.where(koff >= 0, koff.view(np.uint64), off[smp])
        n = len(op)
        v0 = np.zeros(n, np.uint64)
        v1 = np.zeros(n, np.uint64)
        vimg = np.full(n, -1, np.int64)
        keep = np.ones(n, bool)
        u64 = ops.view(np.uint64)
        def address(at: np.ndarray, s_: np.ndarray, base: int, index: int, scale: int, disp: int) -> np.ndarray:
            """disp + base + index * scale of the op rows ``at`` over the samples ``s_`` (column
            numbers of the op rows: base and index -1 where there is none)."""
            b, i = ops[at, base], ops[at, index]
            out: np.ndarray = (u64[at, disp] + np.where(b >= 0, R[s_, np.maximum(b, 0)], 0)
                               + np.where(i >= 0, R[s_, np.maximum(i, 0)], 0) * u64[at, scale])
            return out

        with np.errstate(over="ignore"):
            regs = np.flatnonzero(code <= OP_PREV)
            if len(regs):
                r = op[regs]
                v0[regs] = (R[smp[regs], ops[r, _COL]] >> u64[r, _SHIFT]) & u64[r, _MASK]
            df = np.flatnonzero(code == OP_DIFF)
            if len(df):
                d, s_ = op[df], smp[df]
                v0[df] = (R[s_, ops[d, _COL]] - R[s_, ops[d, _COL2]]) & u64[d, _MASK]
            ad = np.flatnonzero(code == OP_ADDRDIFF)
            if len(ad):
                d, s_ = op[ad], smp[ad]
                v0[ad] = (address(d, s_, _COL, _COL2, _SCALE, _DISP) - address(d, s_, _COL3, _COL4, _SCALE2, _DISP2))
            ea = np.flatnonzero(code == OP_ADDR)
            if len(ea):
                v0[ea] = address(op[ea], smp[ea], _COL, _COL2, _SCALE, _DISP)
        pairs, ctx = code == OP_REG_CTX, code == OP_CTX
        with_ctx = pairs | ctx
        keep &= ~with_ctx | (ctx_img[smp] >= 0)
        v1[pairs] = ctx_off[smp[pairs]]
        v0[ctx] = ctx_off[smp[ctx]]
        vimg[with_ctx] = ctx_img[smp[with_ctx]]
        st = np.flatnonzero(code == OP_STACK)
        if len(st):
            at = ops[op[st], _DISP]  # the stack offset
            inside = (at + 8 <= S.shape[1]) & (L[smp[st]] >= at + 8)
            keep[st[~inside]] = False
            st, at = st[inside], at[inside]
            if len(st):
                v0[st] = np.ascontiguousarray(S[smp[st][:, None], at[:, None] + np.arange(8)]).view("<u8").reshape(-1)
        if not keep.all():
            smp, kind, koff, v0, v1, vimg = smp[keep], kind[keep], koff[keep], v0[keep], v1[keep], vimg[keep]
        k = np.empty(len(smp), MEM_KEY_DTYPE)
        k["uid"], k["image"], k["offset"], k["kind"] = owner[smp], img[smp], koff, kind
        v = np.empty(len(smp), VALUE_DTYPE)
        v["v0"], v["v1"], v["vimg"] = v0, v1, vimg
        keys_parts.append(k)
        vals_parts.append(v)

    # --- call context -----------------------------------------------------------------------------
    def _contexts(self, pids: np.ndarray, R: np.ndarray, S: np.ndarray, L: np.ndarray, at_entry: np.ndarray
                  ) -> tuple[np.ndarray, np.ndarray]:
        n = len(pids)
        ctx_img = np.full(n, -1, np.int64)
        ctx_off = np.zeros(n, np.uint64)
        nw = min(S.shape[1] // 8, SCAN_WORDS)
        if not nw:
            return ctx_img, ctx_off
        words = np.ascontiguousarray(S[:, : nw * 8]).view("<u8").reshape(n, nw)
        valid_words = np.minimum(L // 8, nw)
        # Candidates, best first: [rsp] at entry (only that one counts there); [rbp+8] when rbp frames
        # the snapshot; the first word of the snapshot that is a return address. The scan goes by
        # ranges of columns and only over the rows still without a context: most return addresses
        # lie in the first few words, and each word costs a map lookup.
        rsp, rbp = R[:, _RSP].astype(np.int64), R[:, _RBP].astype(np.int64)
        d = rbp - rsp
        fp_col = np.where((d >= 0) & (d % 8 == 0) & (d // 8 + 1 < valid_words), d // 8 + 1, -1)
        entry_rows = np.flatnonzero(at_entry & (valid_words > 0))
        self._take_context(pids, words, entry_rows, np.zeros(len(entry_rows), np.int64), ctx_img, ctx_off)
        fp_rows = np.flatnonzero(~at_entry & (fp_col >= 0))
        self._take_context(pids, words, fp_rows, fp_col[fp_rows], ctx_img, ctx_off)
        lo = 0
        for hi in (4, 12, nw):
            hi = min(hi, nw)
            todo = np.flatnonzero(~at_entry & (ctx_img < 0) & (valid_words > lo))
            if hi <= lo or not len(todo):
                break
            cols = np.arange(lo, hi)
            rows = np.repeat(todo, len(cols))
            col = np.tile(cols, len(todo))
            inside = col < valid_words[rows]
            rows, col = rows[inside], col[inside]
            img, off, ok = self._return_addresses(pids[rows], words[rows, col])
            # The first good column of each row: rows are in order and columns ascending within.
            rows, img, off = rows[ok], img[ok], off[ok]
            first = np.ones(len(rows), bool)
            first[1:] = rows[1:] != rows[:-1]
            ctx_img[rows[first]], ctx_off[rows[first]] = img[first], off[first]
            lo = hi
        return ctx_img, ctx_off

    def _take_context(self, pids: np.ndarray, words: np.ndarray, rows: np.ndarray, col: np.ndarray,
                      ctx_img: np.ndarray, ctx_off: np.ndarray) -> None:
        """``words[rows, col]`` becomes the context of the rows where it is a return address."""
        if not len(rows):
            return
        img, off, ok = self._return_addresses(pids[rows], words[rows, col])
        ctx_img[rows[ok]], ctx_off[rows[ok]] = img[ok], off[ok]

    def _return_addresses(self, pids: np.ndarray, words: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(image, offset, is a return address) of each word, in the address space of its pid."""
        img, off = lookup_user(self.mapper.procs, pids, words)
        ok = img > 0
        if ok.any():
            pairs = np.empty(int(ok.sum()), dtype=[("i", "<i8"), ("o", "<u8")])
            pairs["i"], pairs["o"] = img[ok], off[ok]
            up, inv, _ = unique_struct(pairs)
            good = np.array([self.code.is_return_address(i, o) for i, o in zip(up["i"].tolist(), up["o"].tolist(),
                                                                                  strict=True)], bool)
            ok[ok] = good[inv]
        return img, off, ok

    # --- interpretation -------------------------------------------------------------------------
    def _interpret(self, pids: np.ndarray, owner: np.ndarray, R: np.ndarray, S: np.ndarray, L: np.ndarray,
                   first_run: int) -> np.ndarray:
        """Interpret one sample in ``every`` of a drain now; their steps wait in the interpreter's
        buffer, tagged first_run on. The samples of the runs done (indices into the drain's)."""
        assert self.interp is not None
        k = max(1, self.opts.every)
        chosen = np.flatnonzero(self._rng.random(len(pids)) < 1.0 / k)
        now = time.perf_counter()
        # The budget is a share of the time since the last drain (bounded, so that a long pause
        # does not buy an unbounded stall now).
        deadline = now + self.opts.budget * min(max(now - self._last_interp, 0.01), 0.5)
        self._last_interp = now
        if not len(chosen):
            return chosen
        self._rng.shuffle(chosen)  # when the budget runs out, the ones left out are a random subset
        self.interp.next_drain()
        rows = np.ascontiguousarray(R[chosen][:, _ROW_PERM], "<u8")
        own_l = owner[chosen].tolist()
        reasons = self.interp.execute_many(pids[chosen].tolist(), rows, S[chosen], L[chosen], self.opts.length,
                                           deadline if self.opts.budget > 0 else 0.0, first_run)
        if len(reasons) < len(chosen):  # the budget ran out: the rest keep their interrupt-time values
            for o in own_l[len(reasons):]:
                self.stats[o].over_budget += 1
            self.skipped["interpretation over CPU budget"] += len(chosen) - len(reasons)
        for (o, reason), c in Counter(zip(own_l, reasons, strict=False)).items():
            st = self.stats[o]
            st.interpreted += c
            st.stops[reason] += c
        return chosen[: len(reasons)]

    def _transform(self, batch: StepBatch, pid: np.ndarray, uid: np.ndarray, keys_parts: list[np.ndarray],
                   vals_parts: list[np.ndarray]) -> None:
        """Every module's values from a batch of sequences; ``pid``/``uid``: each run's process and owner."""
        cols: list[tuple[np.ndarray, ...]] = []
        slow: list[tuple[int, int, Emit]] = []
        seqs: list[tuple[int, list[Step]]] | None = None
        for m in self.modules:
            fast = getattr(m, "emit_batch", None)
            if fast is not None:
                try:
                    mine = [self._batch_columns(batch, e, pid, uid) for e in fast(batch) if len(e.rows)]
                except Exception:  # a broken module loses its own values of this drain, nothing else
                    self.skipped[f"module {m.name} failed"] += len(distinct(batch.run))
                    continue
                cols.extend(mine)
                continue
            if seqs is None:
                seqs = batch.to_steps()  # Step lists for modules that only define transform
            for r, seq in seqs:
                try:
                    slow.extend([(int(pid[r]), int(uid[r]), e) for e in m.transform(seq)])
                except Exception:
                    self.skipped[f"module {m.name} failed"] += 1
        if slow:
            m64 = MASK64
            flat = [(p, u, e.pc & m64, e.value.v0 & m64, e.value.v1 & m64, e.value.image, self._kind(e.kind))
                    for p, u, e in slow]
            c = list(zip(*flat, strict=True))
            cols.append((np.array(c[0], np.int64), np.array(c[1], np.int64), np.array(c[2], np.uint64),
                         np.array(c[3], np.uint64), np.array(c[4], np.uint64), np.array(c[5], np.int64),
                         np.array(c[6], np.int32)))
        if cols:
            pid_, uid_, pc, v0, v1, vimg, kind = (np.concatenate(x) for x in zip(*cols, strict=True))
            self._emit_interpreted(pid_, uid_, pc, v0, v1, vimg, kind, keys_parts, vals_parts)

    def _batch_columns(self, batch: StepBatch, e: BatchEmit, pid: np.ndarray, uid: np.ndarray
                       ) -> tuple[np.ndarray, ...]:
        n = len(e.rows)
        run = batch.run[e.rows]
        if isinstance(e.kind, str):
            kind = np.full(n, self._kind(e.kind), np.int32)
        elif isinstance(e.kind, Kinds):
            codes = np.array([self._kind(k) for k in e.kind.names] or [0], np.int32)
            kind = codes[np.asarray(e.kind.codes, np.int64)]
        else:
            names, inv = group(np.asarray(e.kind).astype(str))
            kind = np.array([self._kind(str(k)) for k in names], np.int32)[inv.reshape(-1)]
        return (pid[run], uid[run], batch.pc[e.rows], np.asarray(e.v0, np.uint64),
                np.broadcast_to(np.asarray(e.v1, np.uint64), (n,)),
                np.broadcast_to(np.asarray(e.image, np.int64), (n,)), kind)

    def _emit_interpreted(self, pid: np.ndarray, uid: np.ndarray, pc: np.ndarray, v0: np.ndarray, v1: np.ndarray,
                          vimg: np.ndarray, kind: np.ndarray, keys_parts: list[np.ndarray],
                          vals_parts: list[np.ndarray]) -> None:
        """Values at absolute PCs → keys by (owner, image, offset, kind); code-address values
        (MAP_CODE) become (image, offset) too."""
        v0 = v0.copy()
        vimg = vimg.copy()
        img, off = lookup_user(self.mapper.procs, pid, pc)
        crow = np.flatnonzero(vimg == MAP_CODE)
        if len(crow):
            i2, o2 = lookup_user(self.mapper.procs, pid[crow], v0[crow])
            vimg[crow] = np.where(i2 > 0, i2, -1)
            v0[crow] = np.where(i2 > 0, o2, v0[crow])
        keep = img > 0
        k = np.empty(int(keep.sum()), MEM_KEY_DTYPE)
        k["uid"], k["image"], k["offset"], k["kind"] = uid[keep], img[keep], off[keep], kind[keep]
        v = np.empty(len(k), VALUE_DTYPE)
        v["v0"], v["v1"], v["vimg"] = v0[keep], v1[keep], vimg[keep]
        keys_parts.append(k)
        vals_parts.append(v)

    def add_sequences(self, pid: int, seqs: list[tuple[list[Step], str]]) -> None:
        """Tuple sequences from elsewhere (exact mode): each (steps, why it stopped)."""
        uid = self._uid(pid)
        if uid is None or uid < 0:
            self.skipped["owner unknown" if uid is None else "not allowed"] += len(seqs)
            return
        st = self.stats[uid]
        for steps, reason in seqs:
            st.interpreted += 1
            st.steps += len(steps)
            st.stops[reason] += 1
        batch = StepBatch.from_steps([steps for steps, _ in seqs])
        if not len(batch):
            return
        keys_parts: list[np.ndarray] = []
        vals_parts: list[np.ndarray] = []
        n = len(seqs)
        self._transform(batch, np.full(n, pid, np.int64), np.full(n, uid, np.int64), keys_parts, vals_parts)
        if keys_parts and sum(len(k) for k in keys_parts):
            batch_set = reduce_set(HotlistSet.exact(cat_struct(keys_parts), cat_struct(vals_parts)),
                                   hotlist_sizes(self.kinds), rng=self._rng)
            self._pending.append(batch_set)
            self._pending_rows += batch_set.rows

    def add_exact(self, pid: np.ndarray, image: np.ndarray, offset: np.ndarray, kinds: list[str],
                  which: np.ndarray, value: np.ndarray) -> int:
        """Register values of every execution of probed instructions (values/probes.py): one row
        per execution, of the kind ``kinds[which[row]]``; counted as they are, not thinned like
        samples. Returns the rows kept (the owner known and allowed, the image known)."""
        if not len(pid):
            return 0
        upids, inv = group(pid)
        owner = np.array([(-2 if (u := self._uid(int(p))) is None else u) for p in upids.tolist()], np.int64)[inv]
        self.skipped["not allowed"] += int((owner == -1).sum())
        self.skipped["owner unknown"] += int((owner == -2).sum())
        ok = (owner >= 0) & (image > 0)
        n = int(ok.sum())
        if not n:
            return 0
        # A kind's code per distinct kind, not per row: a probe's hits come at every execution
        # (27,000 of them in a recording of a few ms took 49 ms of naming row by row).
        codes = np.array([self._kind(k) for k in kinds], np.int32)[which]
        k = np.empty(n, MEM_KEY_DTYPE)
        k["uid"], k["image"], k["offset"], k["kind"] = owner[ok], image[ok], offset[ok], codes[ok]
        v = np.zeros(n, VALUE_DTYPE)
        v["v0"], v["vimg"] = value[ok], -1
        batch_set = reduce_set(HotlistSet.exact(k, v), hotlist_sizes(self.kinds), rng=self._rng)
        self._pending.append(batch_set)
        self._pending_rows += batch_set.rows
        return n

    # --- flushing -----------------------------------------------------------------------------
    def replan(self) -> None:
        """Forget the compiled plans: a module's captures changed (the goal module's pruning)."""
        self._plans.clear()
        self._only = self._only_at()

    def _only_at(self) -> dict[str, np.ndarray] | None:
        """Where the modules capture, if every one of them says (``only_at``): image key -> offsets."""
        if not self.modules or self.interp is not None or not all(hasattr(m, "only_at") for m in self.modules):
            return None
        out: dict[str, list[int]] = {}
        for m in self.modules:
            for key, offs in getattr(m, "only_at")().items():  # noqa: B009 (not part of ValueModule)
                out.setdefault(key, []).extend(offs)
        return {k: distinct(np.array(v, np.uint64)) for k, v in out.items()}

    def take(self, start: float, end: float) -> dict[int, tuple[NamedHotlists, ValuesMeta]]:
        """Everything since the last take, per owner uid."""
        self._crunch()
        if not self._pending and not self.stats:
            return {}
        merged = (merge_sets(self._pending, hotlist_sizes(self.kinds), rng=self._rng) if self._pending
                  else HotlistSet.empty(MEM_KEY_DTYPE))
        self._pending, self._pending_rows = [], 0
        self._running_p.reset()
        out: dict[int, tuple[NamedHotlists, ValuesMeta]] = {}
        images = self.table.keys()
        owners = set(self.stats) | set(distinct(merged.keys["uid"]).tolist() if len(merged) else [])
        for uid in sorted(owners):
            sel = np.flatnonzero(merged.keys["uid"] == uid) if len(merged) else np.zeros(0, np.int64)
            remap = np.full(len(merged.keys), -1, np.int64)
            remap[sel] = np.arange(len(sel))
            rows = np.flatnonzero(remap[merged.hot] >= 0) if len(merged) else np.zeros(0, np.int64)
            keys = np.zeros(len(sel), dtype=[("image", "<i8"), ("offset", "<u8"), ("kind", "<i4")])
            if len(sel):
                keys["image"] = merged.keys["image"][sel]
                keys["offset"] = merged.keys["offset"][sel]
                keys["kind"] = merged.keys["kind"][sel]
            hs = HotlistSet(keys, merged.p[sel], merged.total[sel], remap[merged.hot[rows]],
                            merged.values[rows], merged.counts[rows])
            st = self.stats.get(uid, OwnerStats())
            meta = ValuesMeta(uid, samples=st.samples, interpreted=st.interpreted, steps=st.steps,
                              over_budget=st.over_budget,
                              stops=dict(st.stops), modules=[m.name for m in self.modules],
                              length=self.opts.length, every=self.opts.every, start_time=start, end_time=end,
                              exact=self.opts.exact, check=dict(self.check))
            out[uid] = (NamedHotlists(hs, images, list(self.kinds)), meta)
        self.stats = defaultdict(OwnerStats)
        self.check = Counter()
        return out
