"""Dynamic stall culprits (analysis/culprits.py) on hand-assembled blocks: which memory accesses
can be blamed for a D-cache miss."""

from __future__ import annotations

from cyclescope.analysis.cfg import build_cfg
from cyclescope.analysis.culprits import Stall, dynamic_culprits
from cyclescope.images.disasm import disassemble, insn_info

AT = 0x1000


def stalls_at(code: bytes, stalled: int) -> Stall:
    """The culprits of a stall of 20 cycles at instruction ``stalled`` of straight-line ``code``."""
    insns, infos = disassemble(code, AT), insn_info(code, AT)
    cfg = build_cfg(insns, AT, AT + len(code), infos=infos)
    dyn = [20.0 if k == stalled else 0.0 for k in range(len(insns))]
    out = dynamic_culprits(cfg, infos, dyn, [1.0] * len(cfg.blocks), [1.0] * len(cfg.edges))
    got = out[stalled]
    assert got is not None
    return got


# movzx edx, word ptr [rdi + rax*2]; mov word ptr [r8 + rdx*2], cx; add rax, 1; ret
# (a scatter: the index is loaded, then the store goes wherever it says, as bzip2's radix sort)
SCATTER = bytes.fromhex("0fb71447" "6641890c50" "4883c001" "c3")


def test_a_store_is_blamed_beside_the_load_that_fed_its_address() -> None:
    st = stalls_at(SCATTER, 1)
    assert "d" in st.codes
    assert st.culprit_addrs["d"] == [0x1000, 0x1004]  # the index's load, and the store itself


def test_a_stall_just_past_a_store_blames_the_store() -> None:
    st = stalls_at(SCATTER, 2)  # the add after it: within the skid
    assert "d" in st.codes and 0x1004 in st.culprit_addrs["d"]


# movss xmm1, [rsi + rax*4]; addss xmm1, [rdi + rax*4]; movss [rdi + rax*4], xmm1; add rax, 1; ret
# (saxpy: y[i] is loaded, then stored back to the line the load brought in)
SAXPY = bytes.fromhex("f30f100c86" "f30f580c87" "f30f110c87" "4883c001" "c3")


def test_a_store_to_what_the_block_just_loaded_is_not_blamed() -> None:
    st = stalls_at(SAXPY, 3)
    assert "d" in st.codes
    assert st.culprit_addrs["d"] == [0x1000, 0x1005]  # the two loads; not the store at 0x100a


def test_a_stack_push_is_not_a_d_cache_suspect() -> None:
    # push rbx; add rax, 1; ret: nothing but the stack is written
    st = stalls_at(bytes.fromhex("53" "4883c001" "c3"), 1)
    assert "d" not in st.codes


def test_a_stack_slot_is_not_a_d_cache_suspect_but_a_stack_array_is() -> None:
    # mov rax, [rsp + 8]; mov eax, [rsp + rcx*4 + 16]; add rax, 1; ret
    code = bytes.fromhex("488b442408" "8b448c10" "4883c001" "c3")
    st = stalls_at(code, 1)
    assert "d" in st.codes and st.culprit_addrs["d"] == []  # the array's load itself (none listed), not the slot
    only_slot = stalls_at(bytes.fromhex("488b442408" "4883c001" "c3"), 1)  # a spill reloaded, then used
    assert "d" not in only_slot.codes
