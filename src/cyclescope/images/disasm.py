"""Disassembly of x86-64 code with capstone, and reading code bytes from images."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache, lru_cache
from typing import Any, overload

from cyclescope.errors import DataError
from cyclescope.images.elf import ElfInfo, read_load_info

BRANCH_PREFIXES = ("j", "call", "loop")


@dataclass(frozen=True)
class Insn:
    address: int
    size: int
    mnemonic: str
    op_str: str
    raw: bytes

    @property
    def text(self) -> str:
        return f"{self.mnemonic} {self.op_str}".rstrip()

    @property
    def direct_target(self) -> int | None:
        """The target of a direct jump or call (an immediate operand), else None."""
        if not self.mnemonic.startswith(BRANCH_PREFIXES):
            return None
        op = self.op_str.strip()
        if op.startswith("0x"):
            try:
                return int(op, 16)
            except ValueError:
                return None
        return None


@cache
def _cs(detail: bool) -> Any:
    import capstone

    md = capstone.Cs(capstone.CS_ARCH_X86, capstone.CS_MODE_64)
    md.detail = detail
    md.skipdata = True  # data in text (jump tables, padding) decodes as .byte instead of stopping
    return md


def disassemble(code: bytes, address: int) -> list[Insn]:
    """Every instruction in ``code`` as loaded at ``address`` (undecodable bytes as .byte)."""
    out = []
    for addr, size, mnem, ops in _cs(False).disasm_lite(code, address):
        off = addr - address
        out.append(Insn(addr, size, mnem, ops, code[off : off + size]))
    return out


def uprobe_emulated(raw: bytes) -> bool:
    """Does the kernel emulate this instruction at a uprobe hit instead of single-stepping a copy
    of it? x86's uprobes emulate relative jumps, calls and conditional jumps, the one-byte nop and
    pushes of a 64-bit register (arch/x86/kernel/uprobes.c: branch_setup_xol_ops refuses the 0x66
    prefix; push_setup_xol_ops takes REX.B alone). An emulated hit costs the trap alone: 0.48 us
    against 14.3 us single-stepped on the Xeon with AMX (collect/clock.measure_uprobe_hit_s), which
    is why the probes that count blocks are put on such instructions where a block has one."""
    i = 0
    while i < len(raw) and raw[i] in (0xF2, 0xF3, 0x2E, 0x3E):  # bnd, rep, branch hints
        i += 1
    if i >= len(raw) or raw[i] == 0x66:
        return False
    op = raw[i]
    if op in (0xEB, 0xE9, 0xE8, 0x90) or 0x70 <= op <= 0x7F:
        return i == 0 or op != 0x90
    if op == 0x0F:
        return i + 1 < len(raw) and 0x80 <= raw[i + 1] <= 0x8F
    if i == 0 and 0x50 <= op <= 0x57:
        return True
    return i == 0 and op == 0x41 and len(raw) > 1 and 0x50 <= raw[1] <= 0x57


def uprobe_emulated_at(path: str, file_offset: int) -> bool:
    """uprobe_emulated of the instruction at ``file_offset`` of ``path`` (False where it cannot be
    read)."""
    try:
        with open(path, "rb") as f:
            f.seek(file_offset)
            return uprobe_emulated(f.read(2))  # the opcode and the byte after (0x0f 0x8x, REX + push)
    except OSError:
        return False


def first_emulated(insns: Sequence[Insn]) -> int | None:
    """The index of the first of ``insns`` (straight-line code: a block, or part of one) that the
    kernel emulates at a uprobe hit, up to the first call, whose callee may not return; None if
    none. Every instruction before it runs as often as the first."""
    for k, ins in enumerate(insns):
        if uprobe_emulated(ins.raw):
            return k
        if ins.mnemonic == "call":
            break
    return None


def read_code(path: str, start: int, end: int, info: ElfInfo | None = None) -> bytes:
    """Bytes of [start, end) (ELF virtual addresses) from the file at ``path``."""
    info = info or read_load_info(path)
    off = info.file_offset(start)
    if off is None:
        raise DataError(f"{path}: address {start:#x} is not in any loaded segment")
    seg_end = next((s.vaddr + s.filesz for s in info.loads if s.vaddr <= start < s.vaddr + s.filesz), end)
    end = min(end, seg_end)
    with open(path, "rb") as f:
        f.seek(off)
        return f.read(max(0, end - start))


@dataclass(frozen=True)
class MemOperand:
    """An explicit memory operand: [base + index*scale + disp] (64-bit register names, "" for none),
    ``size`` bytes; rip-relative and segment-based operands are not described."""

    base: str
    index: str
    scale: int
    disp: int
    size: int


@dataclass(frozen=True)
class InsnInfo:
    """What the analysis needs of an instruction beyond its text (capstone details)."""

    reads: frozenset[str]  # registers read (full 64-bit names: eax and ax count as rax)
    writes: frozenset[str]
    loads: bool  # reads memory
    stores: bool  # writes memory
    mem_regs: frozenset[str]  # registers used to form the memory address
    kind: str  # "div", "sqrt", "mul", "fp", "branch", "call", "ret", "other"
    mem: MemOperand | None = None  # the explicit memory operand (not push/pop/call/ret's stack)


# The general-purpose registers by their 64-bit names, with their 32-bit halves (writing one
# zero-extends into the whole register).
GPR32 = {**{f"r{x}": f"e{x}" for x in ("ax", "bx", "cx", "dx", "si", "di", "bp", "sp")},
         **{f"r{n}": f"r{n}d" for n in range(8, 16)}}

_WIDE = {}
for _r in ("ax", "bx", "cx", "dx"):
    _WIDE.update({f"r{_r}": f"r{_r}", f"e{_r}": f"r{_r}", _r: f"r{_r}", f"{_r[0]}l": f"r{_r}", f"{_r[0]}h": f"r{_r}"})
for _r in ("si", "di", "bp", "sp"):
    _WIDE.update({f"r{_r}": f"r{_r}", f"e{_r}": f"r{_r}", _r: f"r{_r}", f"{_r}l": f"r{_r}"})
for _n in range(8, 16):
    _WIDE.update({f"r{_n}": f"r{_n}", f"r{_n}d": f"r{_n}", f"r{_n}w": f"r{_n}", f"r{_n}b": f"r{_n}"})
for _n in range(32):
    _WIDE.update({f"xmm{_n}": f"v{_n}", f"ymm{_n}": f"v{_n}", f"zmm{_n}": f"v{_n}"})
_WIDE.update({"eflags": "flags", "rflags": "flags", "flags": "flags", "rip": "rip"})


_ZERO_IDIOMS = frozenset({"xor", "sub", "pxor", "xorps", "xorpd", "vpxor", "vxorps", "vxorpd", "psubd", "psubq"})


def _wide(name: str) -> str:
    return _WIDE.get(name, name)


def wide_register(name: str) -> str | None:
    """The full register an operand names (``ecx`` -> ``rcx``, ``xmm3`` -> ``v3``), or None when
    ``name`` is not a register."""
    return _WIDE.get(name.strip())


def _kind(mnem: str) -> str:
    if mnem.startswith(("div", "idiv")) or mnem in ("divss", "divsd", "divps", "divpd", "vdivss", "vdivsd"):
        return "div"
    if "sqrt" in mnem:
        return "sqrt"
    if mnem.startswith(("mul", "imul")) or mnem in ("mulx",):
        return "mul"
    if mnem == "call":
        return "call"
    if mnem.startswith("ret"):
        return "ret"
    if mnem.startswith("j") or mnem.startswith("loop"):
        return "branch"
    if mnem.startswith(("f", "v", "add", "sub")) and ("ss" in mnem[-3:] or "sd" in mnem[-3:] or mnem.startswith("f")):
        return "fp"
    return "other"


_EMPTY_INFO = InsnInfo(frozenset(), frozenset(), False, False, frozenset(), "other")


def _info(ins: Any) -> InsnInfo:
    """InsnInfo of one capstone instruction decoded with details."""
    import capstone
    from capstone import x86_const

    if ins.id == 0:  # .byte from skipdata
        return _EMPTY_INFO
    try:
        r, w = ins.regs_access()
        reads = {_wide(ins.reg_name(x)) for x in r}
        writes = {_wide(ins.reg_name(x)) for x in w}
    except capstone.CsError:
        reads, writes = set(), set()
    loads = stores = False
    mem_regs: set[str] = set()
    mem: MemOperand | None = None
    for op in ins.operands:
        if op.type == x86_const.X86_OP_MEM:
            if ins.mnemonic in ("lea", "nop") or ins.mnemonic.startswith("nop") or ins.mnemonic == "prefetcht0":
                continue
            acc = op.access
            if acc & capstone.CS_AC_READ:
                loads = True
            if acc & capstone.CS_AC_WRITE:
                stores = True
            for reg in (op.mem.base, op.mem.index):
                if reg:
                    mem_regs.add(_wide(ins.reg_name(reg)))
            base = _wide(ins.reg_name(op.mem.base)) if op.mem.base else ""
            if mem is None and not op.mem.segment and base != "rip":
                mem = MemOperand(base, _wide(ins.reg_name(op.mem.index)) if op.mem.index else "",
                                 op.mem.scale, op.mem.disp, op.size)
    ops = ins.op_str.split(", ")
    if ins.mnemonic in _ZERO_IDIOMS and len(ops) == 2 and ops[0] == ops[1]:
        reads = set()  # xor eax, eax and the like: no input, whatever capstone says
    if ins.mnemonic.startswith(("push", "call")):
        stores = True
    if ins.mnemonic.startswith(("pop", "ret")):
        loads = True
    return InsnInfo(frozenset(reads), frozenset(writes), loads, stores, frozenset(mem_regs), _kind(ins.mnemonic),
                    mem)


def insn_info(code: bytes, address: int) -> list[InsnInfo]:
    """Register and memory access per instruction of ``code`` (same order as disassemble())."""
    return list(_insn_info(code, address))


@lru_cache(maxsize=32)
def _insn_info(code: bytes, address: int) -> tuple[InsnInfo, ...]:
    # Memoized: capstone's details cost about 10 us an instruction, and the web UI's views of one
    # procedure (its listing, calc, the CFG) ask for the same code again (1.3 s for a 10,000
    # instruction interpreter loop).
    return tuple(_info(ins) for ins in _cs(True).disasm(code, address))


class LazyInfos(Sequence[InsnInfo]):
    """``insn_info`` of ``insns`` decoded one instruction at a time, when first asked for: an analysis
    that looks at a few of a procedure's instructions (the collector's loop counting) need not pay
    for details of all of them (capstone's details cost about 10 us an instruction)."""

    def __init__(self, insns: Sequence[Insn]) -> None:
        self.insns = insns
        self._done: dict[int, InsnInfo] = {}

    def __len__(self) -> int:
        return len(self.insns)

    @overload
    def __getitem__(self, k: int) -> InsnInfo: ...

    @overload
    def __getitem__(self, k: slice) -> Sequence[InsnInfo]: ...

    def __getitem__(self, k: int | slice) -> InsnInfo | Sequence[InsnInfo]:
        if isinstance(k, slice):
            return [self[i] for i in range(*k.indices(len(self)))]
        got = self._done.get(k)
        if got is None:
            ins = self.insns[k]
            dec = list(_cs(True).disasm(ins.raw, ins.address, 1))
            got = self._done[k] = _info(dec[0]) if dec else _EMPTY_INFO
        return got
