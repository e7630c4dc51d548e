"""Reading callgrind's output: execution counts, branches, and every event per instruction."""

from __future__ import annotations

from cyclescope.analysis.callgrind import parse_callgrind

# The shape callgrind 3.19 writes with --dump-instr=yes --collect-jumps=yes --cache-sim=yes
# --branch-sim=yes: positions "instr line", compressed subpositions, names given once.
TEXT = """# callgrind format
version: 1
positions: instr line
events: Ir Dr D1mr Bc Bcm
ob=(1) /bin/prog
fl=(1) prog.c
fn=(1) loop
0x1000 10 5 5 1
+4 * 5 0 0 5 2
jcnd=3/5 0x1000 10
+2 * 5
0x1000 11 1 1 1
summary: 16
"""


def test_counts_jumps_and_every_event_per_instruction() -> None:
    prof = parse_callgrind(TEXT, keep_all=True)
    ob = prof.object_for("/bin/prog")
    assert ob == "/bin/prog" and prof.events == ["Ir", "Dr", "D1mr", "Bc", "Bcm"]
    assert prof.counts[ob] == {0x1000: 6, 0x1004: 5, 0x1006: 5}  # the same address on two lines adds up
    assert prof.jumps[ob] == {(0x1006, 0x1000): 3} and prof.cond_exec[ob] == {0x1006: 5}
    assert prof.event(ob, "D1mr") == {0x1000: 2} and prof.event(ob, "Bcm") == {0x1004: 2}
    assert prof.event(ob, "nosuch") == {}
    assert parse_callgrind(TEXT).costs[ob] == {}  # only with keep_all
