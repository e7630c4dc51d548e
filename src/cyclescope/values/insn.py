"""What value capture needs to know of one x86-64 instruction, from capstone's details.

Registers are named as the instruction uses them (``edi``, ``al``, ``r8d``); each
name maps to a general-purpose register of the perf sample (a column of the
user-register array) and a way to extract it (mask, shift). Floating-point and
vector registers are not in perf's user registers on x86-64: they are known only
in exact mode (ptrace) and after the interpreter has written them.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from functools import lru_cache

from cyclescope.perf.abi import X86_REGS_USER_MASK, regs_in_mask

# The columns of a decoded user-register row (regs_in_mask order), by 64-bit name.
_PERF_NAMES = {"AX": "rax", "BX": "rbx", "CX": "rcx", "DX": "rdx", "SI": "rsi", "DI": "rdi", "BP": "rbp",
               "SP": "rsp", "IP": "rip", "FLAGS": "flags", "CS": "cs", "SS": "ss"}
PERF_COLUMNS: dict[str, int] = {}
for _i, _r in enumerate(regs_in_mask(X86_REGS_USER_MASK)):
    PERF_COLUMNS[_PERF_NAMES.get(_r.name, _r.name.lower())] = _i
GP64 = ("rax", "rbx", "rcx", "rdx", "rsi", "rdi", "rbp", "rsp", "r8", "r9", "r10", "r11", "r12", "r13", "r14", "r15")
# A register row of the interpreter and of step batches: the general-purpose registers, rip, flags.
ROW_REGS = (*GP64, "rip", "flags")
ROW_COL = {name: i for i, name in enumerate(ROW_REGS)}
ROW_STRUCT = struct.Struct(f"<{len(ROW_REGS)}Q")  # a row packed: what the interpreter keeps per step
_Q = struct.Struct("<Q")


def row_value(row: bytes, col: int) -> int:
    """Column ``col`` of a packed register row."""
    return int(_Q.unpack_from(row, 8 * col)[0])


@dataclass(frozen=True)
class RegView:
    """A (sub-)register: which 64-bit register, and the bits of it."""

    name: str  # as written: "edi"
    full: str  # "rdi"
    shift: int  # 8 for ah/bh/ch/dh
    bits: int  # 8, 16, 32, 64

    @property
    def mask(self) -> int:
        return (1 << self.bits) - 1

    def extract(self, value: int) -> int:
        return (value >> self.shift) & self.mask


def _reg_views() -> dict[str, RegView]:
    out: dict[str, RegView] = {}
    for x in ("a", "b", "c", "d"):
        full = f"r{x}x"
        out[full] = RegView(full, full, 0, 64)
        out[f"e{x}x"] = RegView(f"e{x}x", full, 0, 32)
        out[f"{x}x"] = RegView(f"{x}x", full, 0, 16)
        out[f"{x}l"] = RegView(f"{x}l", full, 0, 8)
        out[f"{x}h"] = RegView(f"{x}h", full, 8, 8)
    for x in ("si", "di", "bp", "sp"):
        full = f"r{x}"
        out[full] = RegView(full, full, 0, 64)
        out[f"e{x}"] = RegView(f"e{x}", full, 0, 32)
        out[x] = RegView(x, full, 0, 16)
        out[f"{x}l"] = RegView(f"{x}l", full, 0, 8)
    for n in range(8, 16):
        full = f"r{n}"
        out[full] = RegView(full, full, 0, 64)
        out[f"r{n}d"] = RegView(f"r{n}d", full, 0, 32)
        out[f"r{n}w"] = RegView(f"r{n}w", full, 0, 16)
        out[f"r{n}b"] = RegView(f"r{n}b", full, 0, 8)
    out["rip"] = RegView("rip", "rip", 0, 64)
    return out


REG_VIEWS = _reg_views()


@dataclass(frozen=True)
class MemRef:
    """A memory operand: segment:[base + index*scale + disp], ``size`` bytes."""

    base: str  # 64-bit name or "" (rip for rip-relative)
    index: str
    scale: int
    disp: int
    segment: str  # "" or "fs"/"gs"
    size: int
    read: bool
    write: bool

    @property
    def constant(self) -> bool:
        """The address is the same every time (absolute or rip-relative without an index)."""
        return not self.index and self.base in ("", "rip") and not self.segment


@dataclass(frozen=True)
class InsnDetail:
    address: int
    size: int
    mnemonic: str
    op_str: str
    reads: tuple[RegView, ...]  # general-purpose registers read (explicit and implicit)
    writes: tuple[RegView, ...]  # general-purpose registers written
    vreads: tuple[str, ...]  # vector/FP registers read (xmm0...)
    vwrites: tuple[str, ...]
    mem: MemRef | None  # the memory operand actually accessed (not lea's)
    kind: str  # "branch" (conditional), "jump", "ijump", "call", "icall", "ret", "syscall", "other"
    target: int | None  # direct branch/call target
    fp: str  # "f64" / "f32" when the memory operand holds a float, else ""
    lea: bool
    string_op: bool = False  # rep/movs/stos...: several memory operands, or many
    stack_op: bool = False  # touches the stack implicitly (push, pop, call, ret, leave)

    @property
    def text(self) -> str:
        return f"{self.mnemonic} {self.op_str}".rstrip()

    @property
    def next_address(self) -> int:
        return self.address + self.size


_SYSCALLS = frozenset({"syscall", "sysenter", "int", "int3", "int1", "into", "ud2", "hlt", "cpuid", "rdtsc",
                       "rdtscp", "rdrand", "rdseed", "xgetbv", "vzeroupper_"})


def _kind(mnem: str, has_imm_target: bool) -> str:
    if mnem in _SYSCALLS:
        return "syscall"
    if mnem.startswith("ret"):
        return "ret"
    if mnem == "call":
        return "call" if has_imm_target else "icall"
    if mnem == "jmp":
        return "jump" if has_imm_target else "ijump"
    if mnem.startswith("j") or mnem.startswith("loop"):
        return "branch"
    return "other"


def _fp_kind(mnem: str, op_str: str, size: int) -> str:
    if "xmm" not in op_str and "ymm" not in op_str:
        return ""
    if mnem.startswith(("cvtsi", "vcvtsi", "movq", "movd", "vmovq", "vmovd", "pinsr", "vpinsr")):
        return ""
    if size == 8 and (mnem.endswith("sd") or mnem in ("movlpd", "movhpd", "movddup")):
        return "f64"
    if size == 4 and mnem.endswith("ss"):
        return "f32"
    return ""


@lru_cache(maxsize=1 << 16)
def decode(code: bytes, address: int) -> InsnDetail | None:
    """The first instruction of ``code`` at ``address`` (None if it does not decode)."""
    import capstone
    from capstone import x86_const

    from cyclescope.images.disasm import _cs

    md = _cs(True)
    ins = next(iter(md.disasm(code, address, 1)), None)
    if ins is None or ins.id == 0:
        return None
    try:
        r, w = ins.regs_access()
    except capstone.CsError:
        r, w = [], []
    reads: list[RegView] = []
    writes: list[RegView] = []
    vreads: list[str] = []
    vwrites: list[str] = []
    for ids, gp, vec in ((r, reads, vreads), (w, writes, vwrites)):
        for x in ids:
            name = ins.reg_name(x)
            view = REG_VIEWS.get(name)
            if view is not None:
                if view not in gp:
                    gp.append(view)
            elif name.startswith(("xmm", "ymm", "zmm")) and name not in vec:
                vec.append(name)
    mem: MemRef | None = None
    target = None
    lea = ins.mnemonic == "lea"
    for op in ins.operands:
        if op.type == x86_const.X86_OP_MEM and mem is None:
            base = ins.reg_name(op.mem.base) if op.mem.base else ""
            index = ins.reg_name(op.mem.index) if op.mem.index else ""
            seg = ins.reg_name(op.mem.segment) if op.mem.segment else ""
            access = op.access
            mem = MemRef(REG_VIEWS[base].full if base in REG_VIEWS else base,
                         REG_VIEWS[index].full if index in REG_VIEWS else index,
                         op.mem.scale, op.mem.disp, seg if seg in ("fs", "gs") else "", op.size,
                         bool(access & capstone.CS_AC_READ), bool(access & capstone.CS_AC_WRITE))
        elif op.type == x86_const.X86_OP_IMM and (ins.group(capstone.CS_GRP_JUMP)
                                                  or ins.group(capstone.CS_GRP_CALL)):
            target = op.imm
    mnem = ins.mnemonic
    if mnem.startswith(("nop", "prefetch", "endbr")):
        reads, writes = [], []  # hints: they compute nothing
    mem_access = None if lea or mnem.startswith(("nop", "prefetch", "endbr")) else mem
    ops = ins.op_str.split(", ")
    if mnem in ("xor", "sub", "pxor", "xorps", "xorpd") and len(ops) == 2 and ops[0] == ops[1]:
        reads = []  # zero idioms read nothing
    kind = _kind(mnem, target is not None)
    fp = _fp_kind(mnem, ins.op_str, mem.size) if mem_access is not None and mem is not None else ""
    return InsnDetail(ins.address, ins.size, mnem, ins.op_str, tuple(reads), tuple(writes), tuple(vreads),
                      tuple(vwrites), mem_access, kind, target if kind in ("branch", "jump", "call") else None,
                      fp, lea, mnem.startswith("rep") or (mnem in STRING_OPS and "xmm" not in ins.op_str),
                      kind in ("call", "icall", "ret") or mnem.startswith(("push", "pop", "leave")))


# String instructions (implicit rsi/rdi operands, rcx repeats). By name, not by prefix: movsx,
# movsxd, and SSE's movsd, movss and cmpsd share the first letters (and movsd/cmpsd the whole name,
# with xmm operands).
STRING_OPS = frozenset(f"{op}{w}" for op in ("movs", "stos", "lods", "scas", "cmps", "ins", "outs") for w in "bwdq")


def effective_address(mem: MemRef, regs: dict[str, int], next_pc: int) -> int | None:
    """The address ``mem`` refers to, given 64-bit register values (None if one is unknown)."""
    if mem.segment:
        return None  # fs/gs bases are not in the sampled registers
    if any(r and r != "rip" and r not in regs for r in (mem.base, mem.index)):
        return None
    return effective_address_row(mem, ROW_STRUCT.pack(*(regs.get(n, 0) & 0xFFFFFFFFFFFFFFFF for n in ROW_REGS)),
                                 next_pc)


def effective_address_row(mem: MemRef, row: bytes, next_pc: int) -> int | None:
    """The address ``mem`` refers to, given a packed register row (ROW_STRUCT; ``mem`` has no
    segment); None for a register outside the row."""
    a = mem.disp
    if mem.base == "rip":
        a += next_pc
    elif mem.base:
        c = ROW_COL.get(mem.base)
        if c is None:
            return None
        a += row_value(row, c)
    if mem.index:
        c = ROW_COL.get(mem.index)
        if c is None:
            return None
        a += row_value(row, c) * mem.scale
    return a & 0xFFFFFFFFFFFFFFFF
