"""Branch outcomes seen on sampled paths: the shape of a function's execution counts.

Timer samples say where time goes, not how often each block runs; calc divides them by a model's
cycles, and where the model is wrong (stalled, pointer-chasing code) the blocks' relative counts
are wrong. Value sampling's ``edges`` module records, for each branch on the next L instructions
after a sample, where control went (``record --values edges --exact interpret``: the thread is
stopped and the path interpreted from its exact state). That is what AutoFDO takes from branch
records (LBR), which see the branches before a sample rather than after it.

A branch is observed when a sample lands within the L instructions before it, so how often it is
observed is its executions times the time of the instructions before it: a window of L
instructions rather than one, but still biased towards code that follows slow code. Its outcomes,
though, share one window, and their ratio is the branch's probability whenever the way it goes
does not depend on the path before it. So the counts come from the probabilities: within each
function, every block's frequency solves the flow equations f = e + P^T f (e: one entry; P: each
block's probabilities of going to each successor), with each branch's observed outcomes pulled
towards calc's estimate of its edges by ``PRIOR_WEIGHT`` pseudo-observations (uniform where calc
has none) and unobserved branches taking calc's ratios. The result keeps the function's total
over its instructions from calc: the paths shape a function, calc's samples weigh it against the
others. (Measured on SQLite and Lua, docs/benchmarks.md: the exact-count shapes with calc's
totals are what reaches 87% of instrumented PGO's gain on SQLite, calc's own shapes 56%.)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

PRIOR_WEIGHT = 2.0  # pseudo-observations of calc's (or a uniform) split added to each observed branch
# A block run more often than this per entry: the equations are near singular (a loop whose exit has
# a probability under about 1e-12) and the solution is not trusted. Not a bound on real loops: a
# program's main may run its loop 10^8 times per entry, and calc's edge split may say so (1e7 here
# left such functions unshaped).
MAX_GAIN = 1e12
# A trap (blocks no flow leaves) that calc counts at most this share of the function is cold: its
# ways out are opened (block_frequencies); a hotter one leaves the function unshaped.
COLD_TRAP = 0.01


@dataclass(frozen=True)
class PathBlock:
    """A basic block as the shaping needs it: its instructions' addresses (the last one its exit),
    its successors (block indices; -1 leaves the function) and calc's count of each of those edges
    (None unknown)."""

    addresses: Sequence[int]
    succs: Sequence[int] = ()
    succ_counts: Sequence[float | None] = field(default_factory=tuple)


def edge_outcomes(vs: Any, image_key: str) -> dict[int, dict[int, float]]:
    """Image offset of each branch -> {image offset of where control went: how often}, from the
    ``edge`` hotlists of ``image_key`` in the value selection ``vs`` (each hotlist's counts scaled
    by 1/p where the hotlist was thinned; targets in other images left out)."""
    named = vs.hotlists
    if "edge" not in named.kinds or image_key not in named.images:
        return {}
    lists = named.lists
    img = named.images.index(image_key)
    key_sel = (lists.keys["kind"] == named.kinds.index("edge")) & (lists.keys["image"] == img)
    rows = np.flatnonzero(key_sel[lists.hot] & (lists.values["vimg"] == img))
    out: dict[int, dict[int, float]] = {}
    hot = lists.hot[rows]
    for src, dst, c, p in zip(lists.keys["offset"][hot].tolist(), lists.values["v0"][rows].tolist(),
                              lists.counts[rows].tolist(), lists.p[hot].tolist(), strict=True):
        d = out.setdefault(int(src), {})
        d[int(dst)] = d.get(int(dst), 0.0) + c / (p if p > 0 else 1.0)
    return out


def _reached_and_trapped(blocks: Sequence[PathBlock], probs: Sequence[np.ndarray]) -> tuple[list[int], set[int]]:
    """The blocks reached from the entry along edges of positive probability, and those of them
    from which no way out of the function is reachable."""
    n = len(blocks)
    reached, stack = {0}, [0]
    succ: list[list[int]] = [[] for _ in range(n)]
    pred: list[list[int]] = [[] for _ in range(n)]
    out: list[int] = []
    for i, b in enumerate(blocks):
        live = [s for s, p in zip(b.succs, probs[i], strict=True) if p > 0]
        if not b.succs or any(s < 0 for s in live):
            out.append(i)
        for s in live:
            if s >= 0:
                succ[i].append(s)
                pred[s].append(i)
    while stack:
        for s in succ[stack.pop()]:
            if s not in reached:
                reached.add(s)
                stack.append(s)
    leaves, stack = set(out), list(out)
    while stack:
        for p in pred[stack.pop()]:
            if p not in leaves:
                leaves.add(p)
                stack.append(p)
    return sorted(reached), reached - leaves


def block_frequencies(blocks: Sequence[PathBlock], outcomes: dict[int, dict[int, float]],
                      prior_weight: float = PRIOR_WEIGHT, weights: Sequence[float] | None = None
                      ) -> np.ndarray | None:
    """Each block's executions per entry of the function (block 0), from the branch probabilities
    (0 for blocks no edge of positive probability reaches); None when the equations have no
    trustworthy solution (a loop without a way out).

    ``weights``: calc's count of each block's instructions. Where flow is trapped (blocks from
    which no edge of positive probability leads out) and calc counts the trap at most COLD_TRAP of
    the function, half of each pass through a trapped block with an edge out of the trap takes it,
    and what no edge leads out of passes no flow on: cold code that neither calc nor the paths saw
    leave, which would otherwise leave the whole function unshaped. Two kinds in the benchmarks: error
    paths ending in calls that never return but that the CFG does not know (Lua's luaG_runerror;
    `cfg.NORETURN` has the C library's), falling into each other in the disassembly, the last
    jumping back (Lua's interpreter loop, 56% of its instructions, kept calc's shape for it); and a
    seldom-run loop whose exits calc puts at 0 (one in SQLite's sqlite3VdbeExec).

    Tried and not kept: a hotter trap's cycles left out of the solve (absorbing the flow that
    enters them, keeping calc's counts) and the rest shaped. Where the trap sits in an outer loop,
    the flow never comes back from it, so the code before it counts one pass per entry against the
    outer loop's many: bzip2's sendMTFValues went from 83% to 44% similar to exact counts."""
    n = len(blocks)
    if not n:
        return None
    probs: list[np.ndarray] = []
    for b in blocks:
        if not b.succs:
            probs.append(np.zeros(0))
            continue
        k = len(b.succs)
        known = [c for c in b.succ_counts if c is not None]
        prior = np.full(k, 1.0 / k)
        if len(known) == k and sum(known) > 0:
            # calc's split. Where it puts a loop's exits at 0 and no path left the loop, the flow is
            # trapped (handled below when the loop is cold). Tried and not kept: a floor of 1e-6 of a uniform
            # split under calc's, so that such loops are shaped too: they then run 10^6 times and
            # more per entry and the code around them goes cold (bzip2's share of instrumented
            # PGO's gain 87% -> 35% on the same recordings; docs/benchmarks.md).
            prior = np.array(known, float) / sum(known)
        seen = outcomes.get(b.addresses[-1]) if b.addresses else None
        counts = np.zeros(k)
        if seen and k > 1:
            for j, s in enumerate(b.succs):
                if s >= 0 and blocks[s].addresses:
                    counts[j] = seen.get(blocks[s].addresses[0], 0.0)
            if len(set(b.succs)) < k:  # two edges to one block (a jump table's): share its count
                for j, s in enumerate(b.succs):
                    counts[j] /= sum(1 for t in b.succs if t == s)
        total = counts.sum()
        probs.append((counts + prior_weight * prior) / (total + prior_weight) if total > 0 else prior)
    reached, trap = _reached_and_trapped(blocks, probs)
    if trap:
        w = np.asarray(weights, float) if weights is not None else None
        if w is None or w[sorted(trap)].sum() > COLD_TRAP * w.sum():
            return None
        # A cold loop whose exits calc put at 0 still ends: half of each pass through a block with an
        # edge out of the trap takes it (the code after the loop runs as often as the loop is
        # entered; cutting the flow there instead left the rest of bzip2's BZ2_blockSort, 27% of
        # it, at 0). What traps no edge leads out of (the error paths' calls) passes nothing on.
        for i in trap:
            ways = [j for j, s in enumerate(blocks[i].succs) if s < 0 or s not in trap]
            if ways:
                probs[i] = 0.5 * probs[i]
                probs[i][ways] += 0.5 / len(ways)
        reached, trap = _reached_and_trapped(blocks, probs)
    # Only the blocks reached: the rest run 0 times (and may hold a closed cycle of their own).
    at = {b: k for k, b in enumerate(reached)}
    pt = np.zeros((len(reached), len(reached)))  # transposed: pt[dst, src]
    for i in reached:
        if i in trap:
            continue
        for j, s in enumerate(blocks[i].succs):
            if s >= 0 and s in at:
                pt[at[s], at[i]] += probs[i][j]
    e = np.zeros(len(reached))
    e[at[0]] = 1.0
    try:
        sub = np.linalg.solve(np.eye(len(reached)) - pt, e)
    except np.linalg.LinAlgError:
        return None
    f = np.zeros(n)
    f[reached] = sub
    if not np.all(np.isfinite(f)) or f.min() < -1e-6 or f.max() > MAX_GAIN:
        return None
    out: np.ndarray = np.maximum(f, 0.0)
    return out


def observed(blocks: Sequence[PathBlock], outcomes: dict[int, dict[int, float]]) -> bool:
    """Whether any branch of the function (its blocks' exits) has outcomes."""
    return any(b.addresses and b.addresses[-1] in outcomes for b in blocks)


class Shaped(NamedTuple):
    """shape_counts' result: instruction address -> count, and how much of calc's total over the
    function's instructions kept calc's counts (all of it when nothing was shaped)."""

    counts: dict[int, int]
    kept: int


def shape_counts(blocks: Sequence[PathBlock], counts: dict[int, int], outcomes: dict[int, dict[int, float]],
                 prior_weight: float = PRIOR_WEIGHT) -> Shaped:
    """The block frequencies of the branch probabilities scaled to calc's total over the
    instructions of the blocks they reach (``counts``: calc's); blocks that calc counts and they
    do not reach keep calc's counts. ``counts`` unchanged when no branch of the function was
    observed, calc has no count, or the equations have no trusted solution.

    Blocks no edge of positive probability reaches are entered only by edges that calc puts at 0
    and that no path saw taken; where calc's samples say they ran all the same, calc's count is the
    better guess than 0. SQLite's `balance` inlines balance_nonroot behind such a branch: 95% of the
    function's executed instructions by exact counts, which the flow had set to 0 (4-7% of the
    whole profile's count; the function's similarity to exact counts went from 5% to 69%)."""
    total = sum(counts.values())
    if not observed(blocks, outcomes) or total <= 0:
        return Shaped(counts, total)
    weights = [sum(counts.get(a, 0) for a in b.addresses) for b in blocks]
    f = block_frequencies(blocks, outcomes, prior_weight, weights)
    if f is None:
        return Shaped(counts, total)
    keep = [bool(f[i] == 0 and weights[i] > 0) for i in range(len(blocks))]
    shaped = [i for i in range(len(blocks)) if not keep[i]]
    weight = sum(float(f[i]) * len(blocks[i].addresses) for i in shaped)
    calc_shaped = sum(weights[i] for i in shaped)
    if weight <= 0 or calc_shaped <= 0:
        return Shaped(counts, total)
    k = calc_shaped / weight
    out: dict[int, int] = {}
    for i, b in enumerate(blocks):
        if keep[i]:
            out.update((a, counts[a]) for a in b.addresses if a in counts)
            continue
        c = round(float(f[i]) * k)
        if c > 0:
            for a in b.addresses:
                out[a] = c
    return Shaped(out, total - calc_shaped)
