"""The static processor model: M_i, the cycles each instruction spends as the
oldest unretired instruction when nothing stalls dynamically.

DCPI's M_i was "cycles at the head of the issue queue" of an in-order Alpha.
On an out-of-order x86 a timer interrupt is taken at an instruction
boundary and reports the next instruction to retire: the oldest unretired
one. So a sample lands on instruction i for as long as i is what retirement
waits for, and the static analog of M_i is the gap between i's retirement
and its predecessor's in a schedule without dynamic stalls.

That schedule comes from llvm-mca (LLVM's machine-code analyzer, the newest
installed, with the scheduling model of the host CPU: :func:`host_mcpu`): one
invocation per procedure, each basic block a region, each region run for
ITERATIONS iterations; M_i is the mean retire-cycle gap over the steady-state
iterations. As DCPI did, a block is scheduled on its own (code before it is
ignored).

Static stall reasons come from the same timeline: an instruction whose
operands become ready after it was dispatched waits on a dependency (on the
nearest earlier instruction writing a register it reads); one ready but not
issued waits on an execution resource.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import shutil
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass, field

from cyclescope.errors import CycleScopeError
from cyclescope.images.disasm import GPR32, Insn, insn_info

ITERATIONS = 24
WARMUP = 8
_TARGET_RE = re.compile(r"(?<=\s)(?:0x[0-9a-f]+)$")


@dataclass
class InsnModel:
    m: float  # cycles as the oldest unretired instruction, steady state
    latency: float  # dispatch to executed
    wait_operands: float  # ready - dispatched: waiting on earlier results
    wait_resources: float  # issued - ready: waiting on an execution unit
    replaced: bool = False  # llvm-mca could not model it; M_i defaulted
    own: float = 1.0  # the instruction's own latency in the CPU's scheduling model (issue to result)


@dataclass
class BlockModel:
    insns: list[InsnModel]
    cycles: float  # sum of M_i: cycles per execution of the block, best case


@dataclass
class ProcedureModel:
    mcpu: str
    blocks: list[BlockModel]
    notes: list[str] = field(default_factory=list)


# Newest first: LLVM 17 brought scheduling models of Zen 4 and Sapphire Rapids, LLVM 16 Alder Lake's
# P-cores. LLVM 14 schedules every Intel core since Skylake-server with Skylake's model (a 64-bit idiv
# takes 100 cycles in it; 18 measured on a Sapphire Rapids class Xeon) and knows no Zen after Zen 3.
LLVM_MCA_NAMES = ("llvm-mca-19", "llvm-mca-18", "llvm-mca-17", "llvm-mca-16", "llvm-mca-15", "llvm-mca-14",
                  "llvm-mca")


@functools.cache
def llvm_mca() -> str:
    for name in LLVM_MCA_NAMES:
        p = shutil.which(name)
        if p:
            return p
    raise CycleScopeError("llvm-mca is not installed (apt-get install llvm-19)")


@functools.cache
def mca_cpus() -> frozenset[str]:
    """The CPU models this llvm-mca knows (``-mcpu=help``)."""
    try:
        p = subprocess.run([llvm_mca(), "-mcpu=help"], input="", capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return frozenset()
    return frozenset(re.findall(r"^\s+(\S+)\s+- Select the", p.stdout + p.stderr, re.M))


# Zen 4's models in family 0x19 (Genoa 0x10-0x1f, Raphael 0x60-0x6f, Phoenix 0x70-0x7f, Bergamo and
# Siena 0xa0-0xaf); the rest of the family is Zen 3.
_ZEN4_MODELS = (range(0x10, 0x20), range(0x60, 0x80), range(0xA0, 0xB0))


def cpu_models(cpuinfo: str) -> list[str]:
    """llvm's names for the core /proc/cpuinfo describes, best first (each a fallback for the one before).

    Intel's cores are told apart by their features, not their model numbers: a VM may report any
    model (this project's Xeons with AMX say family 6, model 167, a Rocket Lake's number, which is
    what llvm's host detection then picks)."""
    def field_of(name: str) -> str:
        m = re.search(rf"^{name}\s*:\s*(.*)$", cpuinfo, re.M)
        return m.group(1).strip() if m else ""

    vendor = field_of("vendor_id")
    try:
        family, model = int(field_of("cpu family")), int(field_of("model"))
    except ValueError:
        return []
    flags = set(field_of("flags").split())
    if vendor in ("AuthenticAMD", "HygonGenuine"):
        if family == 0x17:
            return ["znver2" if model >= 0x30 else "znver1"]
        if family == 0x19:
            return ["znver4", "znver3"] if any(model in r for r in _ZEN4_MODELS) else ["znver3"]
        if family > 0x19:
            return ["znver5", "znver4", "znver3"]
    if vendor == "GenuineIntel" and family == 6:
        if "amx_fp16" in flags:
            return ["graniterapids", "sapphirerapids"]
        if "amx_tile" in flags or "avx512_fp16" in flags:
            return ["sapphirerapids"]
        if "avx512f" in flags:
            if "avx512_vbmi2" in flags:
                return ["icelake-server"]
            return ["cascadelake"] if "avx512_vnni" in flags else ["skylake-avx512"]
        if "avx_vnni" in flags:
            return ["alderlake"]
    return []


def host_mcpu() -> str:
    """The llvm-mca CPU model for this machine (from /proc/cpuinfo; 'native', llvm's own guess, when
    the core is none that :func:`cpu_models` knows or this llvm-mca knows none of its names)."""
    try:
        with open("/proc/cpuinfo") as fh:
            text = fh.read()
    except OSError:
        return "native"
    known = mca_cpus()
    return next((c for c in cpu_models(text) if c in known), "native")


def asm_line(ins: Insn) -> str:
    """Capstone's Intel syntax, with direct branch targets turned into a local label llvm-mca accepts,
    and ``push``/``pop`` of a register as the store or load the core's stack engine makes of them.

    x86 cores since the Pentium M (and every Zen) track rsp's offset at decode, so successive pushes
    and pops do not wait on each other's rsp update. llvm-mca does not model that: its pop writes rsp
    with the load's latency, and on znver3 an epilogue of six pops and a ret costs 31 cycles per
    execution in its schedule (1.7 with this rewrite). Measured on SQLite's clang build against
    callgrind's counts, classes of 16 or more model cycles (mostly such epilogues) ran at a fifth to a
    quarter of the model's cycles, so their counts came out that much low. A plain ``mov`` to or from
    [rsp] keeps the access and drops the chain, which is what the stack engine does (an explicit use
    of rsp, such as ``add rsp`` or ``mov rsp, rbp``, stays a real dependency)."""
    t = ins.text
    if ins.direct_target is not None:
        t = _TARGET_RE.sub(".Ltgt", t)
    if ins.mnemonic in ("push", "pop") and ins.op_str in GPR32:  # the 64-bit register forms only
        reg = ins.op_str
        t = f"mov {reg}, qword ptr [rsp]" if ins.mnemonic == "pop" else f"mov qword ptr [rsp], {reg}"
    return t


def model_blocks(blocks: Sequence[Sequence[Insn]], mcpu: str | None = None, timeout_s: float = 120) -> ProcedureModel:
    """Run llvm-mca once over all blocks (one region each) and derive M_i per instruction."""
    mcpu = mcpu or host_mcpu()
    notes: list[str] = []
    lines = [".intel_syntax noprefix", ".Ltgt:"]
    where: list[tuple[int, int]] = []  # source line -> (block, insn)
    breakers = [carried_registers(blk) for blk in blocks]  # zero idioms after each block's region
    for b, blk in enumerate(blocks):
        lines.append(f"# LLVM-MCA-BEGIN b{b}")
        for k, ins in enumerate(blk):
            where.append((len(lines), b * 1_000_000 + k))
            lines.append(asm_line(ins))
        lines += [f"xor {r}, {r}" for r in breakers[b]]
        lines.append(f"# LLVM-MCA-END b{b}")
    replaced: set[int] = set()
    line_of = {src: key for src, key in where}
    out = None
    for _ in range(200):
        p = subprocess.run(
            [llvm_mca(), f"-mcpu={mcpu}", f"-iterations={ITERATIONS}", "-timeline",
             f"-timeline-max-iterations={ITERATIONS}", "-timeline-max-cycles=0", "--json"],
            input="\n".join(lines) + "\n", capture_output=True, text=True, timeout=timeout_s,
        )
        m = re.search(r"<stdin>:(\d+):\d+: error", p.stderr)
        if m:
            ln = int(m.group(1)) - 1
            key = line_of.get(ln)
            if key is None:
                raise CycleScopeError(f"llvm-mca failed: {p.stderr.strip().splitlines()[0]}")
            replaced.add(key)
            lines[ln] = "nop"
            continue
        if p.returncode != 0:
            raise CycleScopeError(f"llvm-mca failed: {(p.stderr.strip().splitlines() or ['?'])[0]}")
        out = json.loads(p.stdout)
        break
    if out is None:
        raise CycleScopeError("llvm-mca rejected too many instructions")
    if replaced:
        notes.append(f"{len(replaced)} instruction(s) llvm-mca cannot model were given 1 cycle")
    regions = {r.get("Name", ""): r for r in out.get("CodeRegions", [])}
    models: list[BlockModel] = []
    for b, blk in enumerate(blocks):
        r = regions.get(f"b{b}")
        n = len(blk)
        if r is None or not n:
            models.append(BlockModel([InsnModel(1.0, 1.0, 0.0, 0.0, True, 1.0) for _ in blk], float(n)))
            continue
        tl = r["TimelineView"]["TimelineInfo"]
        info = r.get("InstructionInfoView", {}).get("InstructionList", [])
        own = [float(info[k].get("Latency", 1)) if k < len(info) else 1.0 for k in range(n)]
        stride = n + len(breakers[b])  # the dependency breakers' rows are skipped
        its = len(tl) // stride
        lo = min(WARMUP, max(0, its - 2))
        gaps = [0.0] * n
        lat = [0.0] * n
        wop = [0.0] * n
        wres = [0.0] * n
        cnt = 0
        for it in range(lo, its):
            cnt += 1
            for k in range(n):
                row = tl[it * stride + k]
                prev = tl[it * stride + k - 1] if it * stride + k > 0 else None
                prev_r = prev["CycleRetired"] if prev is not None else row["CycleDispatched"]
                gaps[k] += max(0, row["CycleRetired"] - prev_r)
                lat[k] += max(0, row["CycleExecuted"] - row["CycleDispatched"])
                wop[k] += max(0, row["CycleReady"] - row["CycleDispatched"])
                wres[k] += max(0, row["CycleIssued"] - row["CycleReady"])
        cnt = max(cnt, 1)
        ins_models = [
            InsnModel(gaps[k] / cnt, lat[k] / cnt, wop[k] / cnt, wres[k] / cnt, (b * 1_000_000 + k) in replaced,
                      own[k])
            for k in range(n)
        ]
        for im in ins_models:
            if im.replaced:
                im.m = max(im.m, 1.0)
        models.append(BlockModel(ins_models, sum(i.m for i in ins_models)))
    return ProcedureModel(mcpu, models, notes)


def carried_registers(blk: Sequence[Insn]) -> list[str]:
    """The 32-bit names of the registers a block writes, for a block that does not loop to itself.
    Run as a loop by llvm-mca, a register the block writes and reads (before writing it, or by a
    partial write such as ``mov cl, [mem]`` merging into rcx) chains one iteration to the next, a
    dependency the program does not have, since the block's executions are separated by other code.
    A zero idiom per register at the end of the region breaks each chain (llvm-mca models them as
    dependency-breaking); their rows are skipped in the timeline. A block that jumps to its own
    start keeps its chains: they are real."""
    if not blk:
        return []
    last = blk[-1]
    if last.direct_target == blk[0].address:
        return []
    infos = insn_info(b"".join(i.raw for i in blk), blk[0].address)
    written: set[str] = set()
    for info in infos:
        written |= info.writes  # capstone does not count a partial write's merge as a read: break them all
    return [GPR32[r] for r in sorted(written) if r in GPR32 and r != "rsp"]


MODEL_VERSION = "5"  # 3: dependency breakers after non-looping blocks; 4: the stack engine; 5: own latency


def model_key(blocks: Sequence[Sequence[Insn]], mcpu: str) -> str:
    h = hashlib.sha1((MODEL_VERSION + mcpu + os.path.basename(llvm_mca())).encode())
    for blk in blocks:
        h.update(b"|")
        for ins in blk:
            h.update(ins.raw)
    return h.hexdigest()[:24]
