"""Block counts from the branch outcomes of sampled paths (analysis/paths.py), without the kernel."""

from __future__ import annotations

import numpy as np
import pytest

from cyclescope.analysis.paths import PathBlock, block_frequencies, edge_outcomes, shape_counts
from cyclescope.db.hotlist import VALUE_DTYPE, HotlistSet
from cyclescope.db.values import KEY_DTYPE, NamedHotlists, ValueSelection

# A diamond inside a loop: 0 (entry) -> 1 (header: branch) -> 2 (rare side) or 3 (common side)
# -> 4 (latch: back to 1, or out). Addresses: block i spans 0x100*i .. 0x100*i + 2 (three insns).
BLOCKS = [
    PathBlock([0x000, 0x001, 0x002], [1], [None]),
    PathBlock([0x100, 0x101, 0x102], [2, 3], [None, None]),
    PathBlock([0x200, 0x201, 0x202], [4], [None]),
    PathBlock([0x300, 0x301, 0x302], [4], [None]),
    PathBlock([0x400, 0x401, 0x402], [1, -1], [None, None]),
]


def test_frequencies_follow_the_observed_branch_probabilities() -> None:
    # The header goes to the rare side 1 time in 8; the latch loops 99 times in 100.
    # (The exit goes nowhere in the function: never an outcome the shaping counts.)
    seen = {0x102: {0x200: 100.0, 0x300: 700.0}, 0x402: {0x100: 990.0}}
    f = block_frequencies(BLOCKS, seen, prior_weight=0.0)
    # Without a prior the latch's exit has probability 0: a loop without a way out, not trusted.
    assert f is None
    f = block_frequencies(BLOCKS, seen, prior_weight=2.0)
    assert f is not None
    p_back = (990 + 2 * 0.5) / (990 + 2)  # uniform prior over (back, exit), two pseudo-observations
    assert f[0] == pytest.approx(1.0)
    assert f[1] == pytest.approx(1 / (1 - p_back))
    p_rare = (100 + 2 * 0.5) / (800 + 2)
    assert f[2] / f[1] == pytest.approx(p_rare) and f[3] / f[1] == pytest.approx(1 - p_rare)
    assert f[4] == pytest.approx(f[1])


def test_calc_edge_estimates_are_the_prior_of_branches_seen_seldom_or_never() -> None:
    blocks = list(BLOCKS)
    blocks[1] = PathBlock(BLOCKS[1].addresses, [2, 3], [30.0, 10.0])  # calc: 3 to 1 for the rare side
    blocks[4] = PathBlock(BLOCKS[4].addresses, [1, -1], [9.0, 1.0])
    f = block_frequencies(blocks, {}, prior_weight=2.0)
    assert f is not None
    assert f[1] == pytest.approx(10.0) and f[2] / f[3] == pytest.approx(3.0)
    # One observation against calc's 3:1 moves it by a third of the way (two pseudo-observations).
    f = block_frequencies(blocks, {0x102: {0x300: 1.0}}, prior_weight=2.0)
    assert f is not None and f[2] / f[1] == pytest.approx((0 + 2 * 0.75) / 3)


def test_a_loop_calc_never_leaves_and_no_path_left_keeps_calcs_counts() -> None:
    # calc: the loop's exit edge 0, and no path left it: singular equations, no shape.
    blocks = list(BLOCKS)
    blocks[4] = PathBlock(BLOCKS[4].addresses, [1, -1], [50.0, 0.0])
    assert block_frequencies(blocks, {0x102: {0x200: 100.0, 0x300: 700.0}, 0x402: {0x100: 900.0}}) is None
    # Nor without observations: calc's counts stay as they are.
    assert block_frequencies(blocks, {}) is None


def test_a_loop_run_many_times_per_entry_is_still_shaped() -> None:
    # main's loop: 10^8 iterations per call, as calc's edge estimates say; the exit never observed.
    blocks = list(BLOCKS)
    blocks[4] = PathBlock(BLOCKS[4].addresses, [1, -1], [1e8, 1.0])
    f = block_frequencies(blocks, {0x102: {0x200: 100.0, 0x300: 700.0}, 0x402: {0x100: 5000.0}})
    assert f is not None and f[1] > 1e8
    assert f[2] / f[1] == pytest.approx((100 + 2 * 0.5) / 802)


def test_shape_keeps_calcs_total_and_changes_nothing_without_observations() -> None:
    calc = {a: 50 for b in BLOCKS for a in b.addresses}
    calc.update({a: 1 for a in BLOCKS[0].addresses})
    total = sum(calc.values())
    assert shape_counts(BLOCKS, calc, {}) == (calc, total)
    seen = {0x102: {0x200: 100.0, 0x300: 700.0}, 0x402: {0x100: 99.0, 0x999: 1.0}}
    out, kept = shape_counts(BLOCKS, calc, seen)
    assert kept == 0 and sum(out.values()) == pytest.approx(total, rel=0.01)
    assert out[0x200] < out[0x300] / 5 and out[0x100] == out[0x400] and out[0x000] < out[0x100] / 10
    # No trusted solution (no prior, no exit seen): calc's counts as they were.
    shaped = shape_counts(BLOCKS, calc, {0x402: {0x100: 10.0}}, prior_weight=0.0)
    assert shaped.counts is calc and shaped.kept == total


def test_outcomes_come_from_the_edge_hotlists_of_one_image_scaled_by_their_p() -> None:
    keys = np.zeros(5, KEY_DTYPE)
    keys["image"] = [0, 0, 0, 1, 0]
    keys["offset"] = [0x102, 0x102, 0x102, 0x102, 0x50]
    keys["kind"] = [0, 0, 0, 0, 1]
    vals = np.zeros(5, VALUE_DTYPE)
    vals["v0"] = [0x200, 0x300, 0x300, 0x200, 7]
    vals["vimg"] = [0, 0, 0, 1, -1]
    lists = HotlistSet.exact(keys, vals)
    lists.p[:] = 0.5
    vs = ValueSelection(NamedHotlists(lists, ["a", "b"], ["edge", "in:rdi"]), None, 1, 0, [])
    assert edge_outcomes(vs, "a") == {0x102: {0x200: 2.0, 0x300: 4.0}}
    assert edge_outcomes(vs, "c") == {}


def test_a_cold_trap_passes_no_flow_on_and_the_rest_is_shaped() -> None:
    # Lua's luaV_execute: error paths end in calls to luaG_runerror (noreturn, unknown to the CFG),
    # each falling into the next in the disassembly, the last jumping back: a cycle no flow leaves,
    # which made the whole function's equations singular.
    blocks = [
        PathBlock([0x000, 0x001], [1, 3], [None, None]),  # the loop's head: body or error
        PathBlock([0x100, 0x101], [0, 2], [None, None]),  # body: back to the head, or out
        PathBlock([0x200], [-1], [None]),                 # return
        PathBlock([0x300, 0x301], [4], [None]),           # call luaG_runerror
        PathBlock([0x400, 0x401], [3], [None]),           # call luaG_forerror, then back (jmp)
    ]
    seen = {0x001: {0x100: 99.0, 0x300: 1.0}, 0x101: {0x000: 900.0, 0x200: 100.0}}
    assert block_frequencies(blocks, seen) is None  # calc's counts unknown: nothing to say it is cold
    f = block_frequencies(blocks, seen, weights=[1000, 1000, 1, 0, 0])
    assert f is not None
    p_err = (1 + 2 * 0.5) / (100 + 2)
    p_out = (100 + 2 * 0.5) / (1000 + 2)
    # Each pass through the head leaves by the error path or by the body's exit: f0 = 1 / P(leave).
    assert f[0] == pytest.approx(1 / (p_err + (1 - p_err) * p_out))
    # The error path runs as often as it is taken; the next one, entered only from it, not at all.
    assert f[3] == pytest.approx(f[0] * p_err) and f[4] == 0
    # A trap calc counts as more than COLD_TRAP of the function is not cut: no shape.
    assert block_frequencies(blocks, seen, weights=[1000, 1000, 1, 30, 0]) is None


def test_a_seldom_run_loop_whose_exit_calc_puts_at_zero_does_not_unshape_its_function() -> None:
    # sqlite3VdbeExec: an inner loop calc counts at half an execution, its exit edge at 0.
    blocks = [
        PathBlock([0x000, 0x001], [1, 3], [None, None]),
        PathBlock([0x100, 0x101], [0, 2], [None, None]),
        PathBlock([0x200], [-1], [None]),
        PathBlock([0x300, 0x301], [3, 1], [0.5, 0.0]),  # the loop: back to itself, or out (never)
    ]
    seen = {0x001: {0x100: 99.0, 0x300: 1.0}, 0x101: {0x000: 900.0, 0x200: 100.0}}
    assert block_frequencies(blocks, seen) is None
    f = block_frequencies(blocks, seen, weights=[1000, 1000, 1, 1])
    # The loop ends all the same: half of each pass leaves it (two passes an entry), and the code
    # after it runs as often as it is entered (cutting the flow there left bzip2's BZ2_blockSort
    # with 27% of its code at 0).
    p_loop = (1 + 2 * 0.5) / (100 + 2)
    assert f is not None and f[3] == pytest.approx(2 * p_loop * f[0]) and f[1] == pytest.approx(f[0])


def test_a_function_whose_entry_reaches_no_way_out_has_no_shape() -> None:
    # A loop that never ends (a server's): all of it trapped, and all of calc's count in it.
    blocks = [
        PathBlock([0x000], [1], [None]),
        PathBlock([0x100, 0x101], [2], [None]),  # call poll
        PathBlock([0x200, 0x201], [1, 3], [None, None]),
        PathBlock([0x300], [1], [None]),  # call serve
    ]
    assert block_frequencies(blocks, {0x201: {0x100: 5.0, 0x300: 1.0}}, weights=[1, 100, 100, 20]) is None


def test_a_closed_cycle_no_flow_reaches_does_not_unshape_its_function() -> None:
    # Error paths that jump back into each other, entered only by edges of probability 0.
    blocks = [
        PathBlock([0x000, 0x001], [1, 3], [10.0, 0.0]),
        PathBlock([0x100, 0x101], [0, 2], [None, None]),
        PathBlock([0x200], [-1], [None]),
        PathBlock([0x300], [4], [None]),
        PathBlock([0x400], [3], [None]),
    ]
    f = block_frequencies(blocks, {0x101: {0x000: 900.0, 0x200: 100.0}})
    assert f is not None and f[3] == f[4] == 0 and f[1] == pytest.approx(f[0])


def test_blocks_calc_counts_that_no_flow_reaches_keep_calcs_counts() -> None:
    # SQLite's balance: balance_nonroot, inlined, is entered by an edge calc puts at 0 and no path
    # saw taken, while its samples (in a loop of its own) say it ran. The flow gave it 0, and most
    # of the function's count with it; it keeps calc's counts, and the rest is shaped and keeps
    # calc's weight.
    blocks = [
        PathBlock([0x000, 0x001], [1, 2], [1000.0, 0.0]),  # entry: the common way, or into nonroot
        PathBlock([0x100, 0x101], [4], [None]),
        PathBlock([0x200], [3], [None]),                   # nonroot's entry
        PathBlock([0x300, 0x301], [3, 4], [0.0, 0.0]),     # nonroot's loop, then on
        PathBlock([0x400, 0x401], [5, 6], [None, None]),   # a diamond before the return
        PathBlock([0x500], [-1], [None]),
        PathBlock([0x600], [-1], [None]),
    ]
    seen = {0x001: {0x100: 50.0}, 0x401: {0x500: 30.0, 0x600: 10.0}}
    calc = {0x000: 100, 0x001: 100, 0x100: 100, 0x101: 100, 0x200: 3, 0x300: 400, 0x301: 400, 0x400: 100,
            0x401: 100, 0x500: 50, 0x600: 50}
    f = block_frequencies(blocks, seen, weights=[200, 200, 3, 800, 200, 50, 50])
    assert f is not None and f[2] == f[3] == 0 and f[4] == pytest.approx(1.0)
    out, kept = shape_counts(blocks, calc, seen)
    assert {a: out[a] for a in (0x200, 0x300, 0x301)} == {0x200: 3, 0x300: 400, 0x301: 400} and kept == 803
    p = (30 + 2 * 0.5) / (40 + 2)  # the diamond: shaped by its outcomes
    assert out[0x500] == round(100 * p) and out[0x600] == round(100 * (1 - p)) and out[0x000] == 100
    assert sum(out.values()) == pytest.approx(sum(calc.values()), abs=2)
