"""calc on the committed binary tests/data/inl with synthetic samples: structure and accounting."""

from __future__ import annotations

import numpy as np
import pytest

from cyclescope.analysis.calc import calc_procedure
from cyclescope.analysis.skid import skidded
from cyclescope.errors import CycleScopeError
from cyclescope.images.disasm import Insn, disassemble, insn_info, read_code
from cyclescope.report.calc import calc_to_json, summarize
from tests.unit.test_listing import DATA

# The synthetic samples below are drawn from znver3's schedule (llvm-mca's), whatever core runs the tests.
MCPU = "znver3"


def test_skid_moves_cycles_to_where_samples_land() -> None:
    code = read_code(str(DATA / "inl"), 0x11A0, 0x11BD)
    insns = disassemble(code, 0x11A0)
    infos = insn_info(code, 0x11A0)
    ms = [0, 1, 1, 0, 0, 0, 1, 0, 0]  # llvm-mca: shl, sub and xor are waited on
    assert skidded(ms, insns, infos, wraps=True) == [0, 0, 1, 1, 0, 0, 0, 1, 0]  # one instruction later
    assert sum(skidded([*ms[:7], 0, 1], insns, infos, wraps=False)) == 3  # the last one's cycles leave the block


@pytest.fixture
def calc() -> object:
    code = read_code(str(DATA / "inl"), 0x1190, 0x11C6)
    f = 100.0
    # Samples drawn from the skidded model at F=100 per P: a stall-free loop.
    counts = {0x11A7: np.array([f]), 0x11AA: np.array([f]), 0x11B8: np.array([f]), 0x1190: np.array([1.0])}
    return calc_procedure("work", 0x1190, 0x11C6, code, counts, ["cpu-clock"], "cpu-clock", 1_000_000.0, mcpu=MCPU)


def test_a_stall_free_loop_gets_its_frequency_in_high_confidence(calc: object) -> None:
    c = calc
    loop = next(b for b in c.cfg.blocks if b.start == 0x11A0)
    assert c.freq.block[loop.id] == pytest.approx(100.0, rel=0.02)
    assert c.freq.block_confidence[loop.id] == "high" and c.freq.block_method[loop.id] == "clean-blocks"
    assert c.executions(loop.id) == pytest.approx(1e8, rel=0.02)
    assert all(d < 0.5 for d in c.dyn[c.cfg.block_of.index(loop.id) :][:9])  # no dynamic stall to explain


def test_the_procedure_summary_adds_up(calc: object) -> None:
    s = summarize(calc)
    parts = s.execution + s.static_total + s.dynamic_total - s.gain
    assert parts == pytest.approx(s.tallied, rel=1e-6)
    assert s.best_cpi <= s.actual_cpi + 1e-9
    doc = calc_to_json(calc, s)
    assert doc["summary"]["execution_percent"] + sum(doc["summary"]["static_percent"].values()) + doc["summary"][
        "dynamic_percent_total"] == pytest.approx(100.0, abs=0.01)
    assert {b["start"] for b in doc["blocks"]} >= {0x1190, 0x11A0, 0x11BD}
    assert all(e["frequency"] is None or e["frequency"] >= 0 for e in doc["edges"])


def test_a_stalled_instruction_gets_culprits_and_a_lower_confidence() -> None:
    code = read_code(str(DATA / "inl"), 0x1190, 0x11C6)
    counts = {0x11A7: np.array([100.0]), 0x11AA: np.array([100.0]), 0x11B8: np.array([100.0]),
              0x11A0: np.array([3000.0])}  # a stall at the loop head, 30 cycles per iteration
    c = calc_procedure("work", 0x1190, 0x11C6, code, counts, ["cpu-clock"], "cpu-clock", 1_000_000.0, mcpu=MCPU)
    loop = next(b for b in c.cfg.blocks if b.start == 0x11A0)
    k = loop.first
    assert c.dyn[k] > 10 and c.culprits[k] is not None
    assert "p" in c.culprits[k].codes  # the head of a block entered by a conditional branch
    assert 0x11BB in c.culprits[k].culprit_addrs["p"]
    assert c.freq.block_confidence[loop.id] == "low"


def test_a_measured_loops_back_branch_is_not_blamed_for_mispredicts() -> None:
    """The same stalled loop, its count measured by its counter (rdx, pairs of samples a thousand
    iterations apart): its count is the measured one, and its back branch, which a predictor gets
    wrong at most once an execution, is no longer a candidate for the stall on every iteration."""
    from cyclescope.analysis.loopcount import LoopStats

    code = read_code(str(DATA / "inl"), 0x1190, 0x11C6)
    counts = {0x11A7: np.array([100.0]), 0x11AA: np.array([100.0]), 0x11B8: np.array([100.0]),
              0x11A0: np.array([3000.0])}
    stats = {0x11A0: LoopStats(own=3300, own_period=3300 * 1e6, followed=3300, next_own=3299, pairs=3299,
                               iterations=3299 * 1000.0, pair_period=3299 * 1e6)}
    c = calc_procedure("work", 0x1190, 0x11C6, code, counts, ["cpu-clock"], "cpu-clock", 1_000_000.0, mcpu=MCPU,
                       loop_stats=stats, mean_period=1e6)
    loop = next(b for b in c.cfg.blocks if b.start == 0x11A0)
    assert c.freq.block_method[loop.id] == "loop-counter" and c.freq.block_confidence[loop.id] == "high"
    assert c.executions(loop.id) == pytest.approx(3300 * 1000, rel=0.01)
    k = loop.first
    assert c.dyn[k] > 10 and c.culprits[k] is not None
    assert 0x11BB not in c.culprits[k].culprit_addrs.get("p", [])


def test_a_measured_loops_exit_is_still_blamed_for_the_stall_after_it() -> None:
    """The measured loop again, now with a stall at its exit's first instruction: the back branch
    mispredicts at most once an execution of the loop, which is every execution of its exit, so
    it stays a candidate there (and only there)."""
    from cyclescope.analysis.loopcount import LoopStats

    code = read_code(str(DATA / "inl"), 0x1190, 0x11C6)
    counts = {0x11A7: np.array([100.0]), 0x11AA: np.array([100.0]), 0x11B8: np.array([100.0]),
              0x11A0: np.array([3000.0]), 0x1190: np.array([10.0]), 0x11BD: np.array([400.0])}
    stats = {0x11A0: LoopStats(own=3300, own_period=3300 * 1e6, followed=3300, next_own=3299, pairs=3299,
                               iterations=3299 * 1000.0, pair_period=3299 * 1e6)}
    c = calc_procedure("work", 0x1190, 0x11C6, code, counts, ["cpu-clock"], "cpu-clock", 1_000_000.0, mcpu=MCPU,
                       loop_stats=stats, mean_period=1e6)
    loop = next(b for b in c.cfg.blocks if b.start == 0x11A0)
    out = next(b for b in c.cfg.blocks if b.start == 0x11BD)
    assert c.dyn[loop.first] > 10 and 0x11BB not in c.culprits[loop.first].culprit_addrs.get("p", [])
    k = out.first
    assert c.dyn[k] > 10 and c.culprits[k] is not None
    assert "p" in c.culprits[k].codes and 0x11BB in c.culprits[k].culprit_addrs["p"]


def _block(code: bytes, at: int = 0x1000) -> list[Insn]:
    return disassemble(code, at)


# luaH_getshortstr's first block (clang-14 -O2): `mov cl, [rdi+0xb]` merges into rcx, which the block
# rewrites at its end, so llvm-mca running it as a loop chains each iteration to the next.
GETSHORTSTR = bytes.fromhex("8a4f0b" "b8ffffffff" "d3e0" "f7d0" "23460c" "4898" "488d0c40" "48c1e103"
                            "48034f18" "488d059cfc0000" "eb1b")


def test_a_block_that_does_not_loop_is_modelled_without_the_loop_llvm_mca_would_make_of_it() -> None:
    from cyclescope.analysis.schedule import carried_registers, llvm_mca, model_blocks

    blk = _block(GETSHORTSTR)
    assert [i.mnemonic for i in blk][:2] == ["mov", "mov"] and blk[-1].mnemonic == "jmp"
    assert carried_registers(blk) == ["eax", "ecx"]
    loop = _block(bytes.fromhex("4801c8" "48ffc9" "75f8"))  # add rax, rcx; dec rcx; jne back to itself
    assert loop[-1].direct_target == loop[0].address and carried_registers(loop) == []
    try:
        llvm_mca()
    except CycleScopeError as e:  # the model needs the tool; scripts/setup installs llvm-14
        pytest.skip(f"llvm-mca is not installed: {e}")
    m = model_blocks([blk, loop], "znver3")
    # The chain through rcx (load, shl, not, and-load, cdqe, lea, shl, add-load) is about 15 cycles;
    # without it the block costs what its throughput allows.
    assert m.blocks[0].cycles < 5
    assert m.blocks[1].cycles >= 1.0  # the real chain through rcx in the loop stays: dec's latency each iteration


# insertCell's epilogue in SQLite's clang-14 build: add rsp, 0x38; pop rbx, r12, r13, r14, r15, rbp; ret.
EPILOGUE = bytes.fromhex("4883c438" "5b" "415c" "415d" "415e" "415f" "5d" "c3")


def test_pushes_and_pops_are_the_stack_engines_loads_and_stores() -> None:
    from cyclescope.analysis.schedule import asm_line, llvm_mca, model_blocks

    blk = _block(EPILOGUE)
    assert [asm_line(i) for i in blk][:3] == ["add rsp, 0x38", "mov rbx, qword ptr [rsp]", "mov r12, qword ptr [rsp]"]
    push = _block(bytes.fromhex("55" "ff30" "c3"))  # push rbp; push qword ptr [rax]; ret
    assert [asm_line(i) for i in push] == ["mov qword ptr [rsp], rbp", "push qword ptr [rax]", "ret"]
    try:
        llvm_mca()
    except CycleScopeError as e:  # the model needs the tool; scripts/setup installs llvm-14
        pytest.skip(f"llvm-mca is not installed: {e}")
    # llvm-mca chains each pop to the next through rsp with a load's latency: 31 cycles per execution
    # for this block. With the stack engine's view the six loads overlap.
    assert model_blocks([blk], "znver3").blocks[0].cycles < 4


def test_paths_split_a_procedures_forward_branches_and_an_anchor_scales_them() -> None:
    """The committed `work`: `jle` at 0x1193 skips the loop for n <= 0 (block 0x11c0), `jne` at
    0x11bb closes the loop. Sampled outcomes send 30% of the entries to 0x11c0; the anchor's
    entry count scales them. The loop's back branch keeps calc's split whatever its outcomes say
    (a loop's count goes as 1/(1-p): a biased p would wreck it)."""
    from cyclescope.analysis.anchors import AnchorStats

    code = read_code(str(DATA / "inl"), 0x1190, 0x11C6)
    counts = {0x11A7: np.array([100.0]), 0x11AA: np.array([100.0]), 0x11B8: np.array([100.0]),
              0x1190: np.array([1.0]), 0x1197: np.array([1.0]), 0x11BD: np.array([1.0]), 0x11C0: np.array([1.0]),
              0x11C5: np.array([1.0])}
    total = 305.0
    # 10^4 entries of about 30,000 cycles each: long enough for the traps not to disturb the count
    anchor = AnchorStats(hits=3_290, samples=100, counted_s=1.0, windows=10)
    outcomes = {0x1193: {0x11C0: 30.0, 0x1195: 70.0}, 0x11BB: {0x11A0: 1.0, 0x11BD: 99.0}}
    plain = calc_procedure("work", 0x1190, 0x11C6, code, counts, ["cpu-clock"], "cpu-clock", 1_000_000.0, mcpu=MCPU,
                           anchor=anchor)
    c = calc_procedure("work", 0x1190, 0x11C6, code, counts, ["cpu-clock"], "cpu-clock", 1_000_000.0, mcpu=MCPU,
                       anchor=anchor, outcomes=outcomes)
    at = {b.start: b.id for b in c.cfg.blocks}
    entries = 3_290 / 100 * total
    assert c.executions(at[0x1190]) == pytest.approx(entries, rel=0.01)
    skip = at[0x11C0]
    assert c.freq.block_method[skip] == "paths" and c.freq.block_confidence[skip] == "low"
    assert c.executions(skip) == pytest.approx(0.3 * entries, rel=0.05)
    loop = at[0x11A0]
    assert c.freq.block_method[loop] != "paths"
    assert c.executions(loop) == pytest.approx(plain.executions(loop), rel=0.05)


def test_paths_without_a_measured_count_keep_the_models_scale_in_low_confidence() -> None:
    """All the loop's samples on one instruction (a stall): no clean block, no measurement; the
    paths shape the procedure and calc's total scales it, in low confidence. The split holds."""
    code = read_code(str(DATA / "inl"), 0x1190, 0x11C6)
    counts = {0x11B5: np.array([300.0]), 0x1190: np.array([1.0]), 0x1197: np.array([1.0]),
              0x11BD: np.array([1.0]), 0x11C0: np.array([1.0]), 0x11C5: np.array([1.0])}
    c = calc_procedure("work", 0x1190, 0x11C6, code, counts, ["cpu-clock"], "cpu-clock", 1_000_000.0, mcpu=MCPU,
                       outcomes={0x1193: {0x11C0: 30.0, 0x1195: 70.0}})
    at = {b.start: b.id for b in c.cfg.blocks}
    shaped = [b.id for b in c.cfg.blocks if c.freq.block_method[b.id] == "paths"]
    assert at[0x11C0] in shaped and all(c.freq.block_confidence[b] == "low" for b in shaped)
    split = (c.freq.block[at[0x11C0]] or 0.0) / (c.freq.block[at[0x1190]] or 1.0)
    assert split == pytest.approx(0.3, rel=0.05)
    nothing = calc_procedure("work", 0x1190, 0x11C6, code, counts, ["cpu-clock"], "cpu-clock", 1_000_000.0, mcpu=MCPU,
                             outcomes={0x9999: {0x1: 3.0}})  # no branch of the procedure observed
    assert "paths" not in nothing.freq.block_method


def test_the_core_model_is_chosen_from_cpuinfo() -> None:
    from cyclescope.analysis.schedule import cpu_models

    def info(vendor: str, family: int, model: int, flags: str = "fpu sse2") -> str:
        return f"vendor_id\t: {vendor}\ncpu family\t: {family}\nmodel\t\t: {model}\nflags\t\t: {flags}\n"

    assert cpu_models(info("AuthenticAMD", 25, 1)) == ["znver3"]  # Milan
    assert cpu_models(info("AuthenticAMD", 25, 17)) == ["znver4", "znver3"]  # Genoa
    assert cpu_models(info("AuthenticAMD", 26, 2)) == ["znver5", "znver4", "znver3"]
    assert cpu_models(info("AuthenticAMD", 23, 49)) == ["znver2"]
    # A Xeon with AMX whose VM reports a Rocket Lake's model number: its features say what it is.
    assert cpu_models(info("GenuineIntel", 6, 167, "avx512f avx512_fp16 amx_tile avx_vnni")) == ["sapphirerapids"]
    assert cpu_models(info("GenuineIntel", 6, 173, "avx512f amx_tile amx_fp16")) == ["graniterapids",
                                                                                     "sapphirerapids"]
    assert cpu_models(info("GenuineIntel", 6, 106, "avx512f avx512_vbmi2 avx512_vnni")) == ["icelake-server"]
    assert cpu_models(info("GenuineIntel", 6, 85, "avx512f avx512_vnni")) == ["cascadelake"]
    assert cpu_models(info("GenuineIntel", 6, 151, "avx2 avx_vnni")) == ["alderlake"]
    assert cpu_models(info("GenuineIntel", 6, 60, "avx2")) == []  # Haswell: llvm's own guess
    assert cpu_models("") == []
