"""Goal-directed value profiling's cost-benefit model (analysis/goal.py) on hand-written code, and
the goal module's dynamic elimination (values/goal.py), without the kernel."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from cyclescope.analysis.cfg import build_cfg
from cyclescope.analysis.goal import TEST_COST_ZERO, GoalModel, select
from cyclescope.images.disasm import disassemble, insn_info

pytestmark = pytest.mark.skipif(shutil.which("as") is None or shutil.which("objcopy") is None,
                                reason="needs binutils' as and objcopy to assemble the test code")

AT = 0x1000


def assemble(text: str, tmp: Path) -> bytes:
    src, obj, raw = tmp / "t.s", tmp / "t.o", tmp / "t.bin"
    src.write_text(".intel_syntax noprefix\n.text\n" + text + "\n")
    subprocess.run(["as", "--64", "-o", str(obj), str(src)], check=True, capture_output=True)
    subprocess.run(["objcopy", "-O", "binary", "-j", ".text", str(obj), str(raw)], check=True)
    return raw.read_bytes()


def model(text: str, tmp: Path, hot: dict[int, float], lat: dict[str, float] | None = None) -> GoalModel:
    """The model of ``text`` with block frequencies ``hot`` (block index -> executions; others 1)
    and latencies by mnemonic (others 1)."""
    code = assemble(text, tmp)
    insns = disassemble(code, AT)
    infos = insn_info(code, AT)
    cfg = build_cfg(insns, AT, AT + len(code), infos=infos)
    freq = [hot.get(cfg.block_of[k], 1.0) for k in range(len(insns))]
    lats = [(lat or {}).get(i.mnemonic, 1.0) for i in insns]
    edges = []
    for e in cfg.edges:
        if e.src < 0:
            edges.append(hot.get(e.dst, 1.0))
        else:
            edges.append(min(freq[cfg.blocks[e.src].last], hot.get(e.dst, 1.0) if e.dst >= 0 else 1.0))
    return GoalModel(cfg, infos, lats, freq, edges)


# A chain of evaluatable instructions from an argument: edi -> and -> shl -> cmp -> je.
CHAIN = """
    mov eax, edi
    and eax, 0xf
    shl eax, 2
    cmp eax, 8
    je 1f
    add rax, rsi
1:  ret
"""


def test_a_chain_of_evaluatable_instructions_credits_the_defining_register(tmp_path: Path) -> None:
    m = model(CHAIN, tmp_path, {})
    by = {(c.point, c.reg): c for c in m.candidates()}
    arg = by[(-1, "rdi")]
    # mov, and, shl, cmp, je each fold (latency 1, once each); add reads rsi too: not evaluatable.
    assert arg.benefit == pytest.approx(5.0)
    assert [m.cfg.insns[k].mnemonic for k in arg.folded] == ["mov", "and", "shl", "cmp", "je"]
    assert by[(-1, "rsi")].benefit == 0.0
    # Each step of the chain is credited with what follows it only.
    assert by[(1, "rax")].benefit == pytest.approx(3.0)  # after `and`: shl, cmp, je


# A loop that divides by an argument it never writes, and tests each element it loads.
LOOP = """
    mov ecx, edx
    xor r9d, r9d
2:  mov eax, [rdi]
    test eax, eax
    je 3f
    xor edx, edx
    div ecx
    add r9, rax
3:  add rdi, 4
    dec rsi
    jne 2b
    mov rax, r9
    ret
"""


def test_a_value_known_outside_a_hot_loop_pays_and_one_tested_inside_it_does_not(tmp_path: Path) -> None:
    hot = {1: 1000.0, 2: 900.0, 3: 1000.0}  # the loop's blocks; entry and exit run once
    m = model(LOOP, tmp_path, hot, {"div": 14.0})
    cands = m.candidates()
    by = {(c.point, c.reg): c for c in cands}
    div = next(k for k, i in enumerate(m.cfg.insns) if i.mnemonic == "div")
    # The divisor, known at entry: the copy folds, the division becomes a multiply and a shift.
    arg = by[(-1, "rdx")]
    assert div in arg.folded
    assert arg.benefit == pytest.approx(1.0 + 900.0 * (14.0 - 4.0))
    # The loaded element: test and je fold (2 cycles an iteration) against a test of 1 cycle an
    # iteration; with phi above zero it cannot pay, whatever its values.
    load = next(k for k, i in enumerate(m.cfg.insns) if i.mnemonic == "mov" and "[" in i.op_str)
    elem = by[(load, "rax")]
    assert elem.benefit == pytest.approx(2000.0)
    phi = 1500.0
    kept = select(cands, phi)
    assert arg in kept and elem not in kept
    assert elem.benefit < TEST_COST_ZERO * elem.freq + phi
    # The loop's induction (dec rsi reaches itself) ends: the cycle contributes nothing.
    assert by[(-1, "rsi")].benefit >= 0.0
    # The divisor is live (in rcx after the copy) at every instruction of the loop: where samples show it.
    live = {k for k, r in m.available(-1, "rdx") if r == "rcx"}
    assert div in live and load in live


def test_rule_3_switches_a_candidate_off_once_its_top_value_cannot_reach_the_threshold(tmp_path: Path) -> None:
    from cyclescope.db.hotlist import HotlistSet
    from cyclescope.db.values import NamedHotlists
    from cyclescope.values.goal import GoalModule, GoalPoint, Plan, top_upper

    m = model(LOOP, tmp_path, {1: 1000.0, 2: 900.0, 3: 1000.0}, {"div": 14.0})
    arg = next(c for c in m.candidates() if (c.point, c.reg) == (-1, "rdx"))
    need = arg.min_prob(phi=1500.0)
    assert 0 < need < 1
    # Rule (1) holds exactly at that probability.
    assert arg.net(need, 0) == pytest.approx(1500.0)
    assert arg.other_threshold(1500.0) == pytest.approx((1 - need) * arg.freq)

    plan = Plan([GoalPoint("img", "f", "rdx", 0.5, [(0x1010, "rcx")]), GoalPoint("img", "g", "rsi", 0.5,
                                                                                 [(0x1020, "rsi")])])
    mod = GoalModule(plan)

    def flush(spread: list[tuple[int, int, int]]) -> list[int]:
        """Hotlists of (offset, value, count) with p = 1, kinds goal:rcx at 0x1010, goal:rsi at 0x1020."""
        keys = np.zeros(2, dtype=[("image", "<i8"), ("offset", "<u8"), ("kind", "<i4")])
        keys["offset"] = [0x1010, 0x1020]
        keys["kind"] = [0, 1]
        hot, vals, cnts = [], [], []
        for off, v, c in spread:
            hot.append(0 if off == 0x1010 else 1)
            vals.append(v)
            cnts.append(c)
        values = np.zeros(len(vals), dtype=[("v0", "<u8"), ("v1", "<u8"), ("vimg", "<i8")])
        values["v0"] = vals
        totals = [sum(c for o, _, c in spread if o == off) for off in (0x1010, 0x1020)]
        hs = HotlistSet(keys, np.ones(2), np.array(totals, np.int64), np.array(hot, np.int64), values,
                        np.array(cnts, np.float64))
        return mod.observe(NamedHotlists(hs, ["img"], ["goal:rcx", "goal:rsi"]))

    assert mod.plan_in("img", type("I", (), {"address": 0x1010})())  # captured while on
    # 0x1010 sees one value; 0x1020 forty values evenly, too few yet to judge.
    assert flush([(0x1010, 16, 40)] + [(0x1020, v, 1) for v in range(40)]) == []
    # More of the same: 0x1020's top share (1/80) cannot reach 0.5 even two standard errors up.
    assert top_upper(2, 80) < 0.5
    assert flush([(0x1010, 16, 40)] + [(0x1020, v, 1) for v in range(40)]) == [1]
    assert plan.points[0].on and not plan.points[1].on
    assert not mod.plan_in("img", type("I", (), {"address": 0x1020})())  # its capture stops
    assert mod.switched_off == 1


# mix's loop from tests/programs/difference.c: two arguments compared on every trip, and a register
# compared with one redefined in the loop.
DIFF = """
    xor eax, eax
1:  cmp rdx, rcx
    je 2f
    add rax, 3
2:  add rdi, 8
    cmp rdi, rsi
    jne 1b
    ret
"""


def test_a_difference_of_two_arguments_is_live_everywhere_and_of_a_counter_only_after_its_step(
        tmp_path: Path) -> None:
    m = model(DIFF, tmp_path, {1: 64.0, 2: 32.0, 3: 64.0})
    cands = {c.reg: c for c in m.differences()}
    assert set(cands) == {"rdx-rcx", "rdi-rsi"}
    name, where = m.difference_range(cands["rdx-rcx"].point)
    assert name == "rdx-rcx" and where == list(range(len(m.cfg.insns)))  # two arguments: never redefined
    name, where = m.difference_range(cands["rdi-rsi"].point)
    # from just after `add rdi, 8` to the loop's exit (the values of the last trip), not before it
    assert name == "rdi-rsi" and where[0] == cands["rdi-rsi"].point
    assert [m.cfg.insns[j].mnemonic for j in where] == ["cmp", "jne", "ret"]


# accumulate's loop from tests/programs/loads.c: a store through rdi, then a load through rsi that
# may read the same cell; then a load through rdi again (the same registers: statically known), a
# call (nothing survives it) and a load after rsi changed.
LOADS = """
1:  add rcx, rax
    mov qword ptr [rdi + 8], rcx
    mov r8, qword ptr [rsi + 8]
    mov r9, qword ptr [rdi + 16]
    add r9, r8
    add rax, 1
    cmp rax, rdx
    jne 1b
    call 2f
    mov r10, qword ptr [rsi]
2:  mov r11, qword ptr [rdi]
    add rdi, 8
    mov r11, qword ptr [rsi]
    ret
"""


def test_load_avoidance_pairs_a_load_with_the_access_before_it_whose_address_it_may_share(
        tmp_path: Path) -> None:
    m = model(LOADS, tmp_path, {0: 64.0})
    pairs = m.load_pairs()
    got = {(m.cfg.insns[c.pair].address - AT, m.cfg.insns[c.point].address - AT) for c in pairs}
    store, load_q = 3, 7  # mov [rdi + 8], rcx; mov r8, [rsi + 8]
    assert (store, load_q) in got
    c = next(c for c in pairs if m.cfg.insns[c.point].address - AT == load_q)
    assert c.kind == "load" and c.reg == f"same-as-{AT + store:x}-{AT + load_q:x}" and c.benefit == c.freq * 1.0
    assert len({c.reg for c in pairs}) == len(pairs)  # one M1 pairs with several loads: each its own name
    # [rdi + 16] after [rdi + 8]: the same register, a known difference, no candidate; the loads
    # after the call pair with nothing before it; [rsi] after `add rdi, 8` is not paired with [rdi]
    # (its register changed between them)
    points = [m.cfg.insns[c.point].address - AT for c in pairs]
    assert all(m.cfg.insns[c.pair].mnemonic == "mov" for c in pairs)
    assert len([p for p in points if p == load_q]) == 1
    last = next(k for k, i in enumerate(m.cfg.insns) if i.mnemonic == "ret") - 1
    assert all(c.point != last or m.infos[c.pair].mem.base != "rdi" for c in pairs)  # type: ignore[union-attr]
    # where the two addresses are the ones at the load: the whole loop (rdi, rsi never change in it)
    where = m.load_range(c.pair, c.point)
    assert {m.cfg.block_of[x] for x in where} >= {m.cfg.block_of[c.point]}


def test_one_store_paired_with_two_loads_names_each_pair(tmp_path: Path) -> None:
    """[rdi + 8] is stored, then [rsi + 8] and [rdx + 8] are loaded: both loads may take the stored
    value, and the two expressions, live over the same instructions, are two hotlists."""
    m = model("""
    mov qword ptr [rdi + 8], rcx
    mov r8, qword ptr [rsi + 8]
    mov r9, qword ptr [rdx + 8]
    add r8, r9
    ret
""", tmp_path, {0: 64.0})
    store = [c for c in m.load_pairs() if m.cfg.insns[c.pair].address == AT]
    assert len(store) == 2 and len({c.reg for c in store}) == 2, [c.reg for c in store]


def test_a_probe_moves_to_where_the_kernel_emulates_the_hit_while_the_value_stays(tmp_path: Path) -> None:
    """app/specialize.probe_site: a value defined by the first `mov` is probed at the block's `jne`
    (emulated: a fraction of a single-stepped hit's cost), the register unchanged in between; where
    the register is written first, or a call comes first, at the instruction after the definition."""
    from cyclescope.app.specialize import probe_site

    m = model("""
    mov rax, rdi
    add rcx, 1
    cmp rcx, rdx
    jne 1f
    mov rax, rsi
1:  ret
""", tmp_path, {})
    live = [(k, "rax") for k in range(1, 5)]
    assert probe_site(m, 1, "rax", live) == (3, True)  # the jne, same block, rax still the mov's
    assert probe_site(m, 1, "rax", live[:1]) == (1, False)  # rax not held to the jne
    m2 = model("""
    mov rax, rdi
    call 2f
    cmp rax, rdx
    jne 1f
1:  ret
2:  ret
""", tmp_path, {})
    assert probe_site(m2, 1, "rax", [(k, "rax") for k in range(1, 4)]) == (1, True)  # the call itself
    assert probe_site(m2, 2, "rax", [(2, "rax")]) == (2, False)
