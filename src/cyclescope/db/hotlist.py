"""Hotlists: the most frequent values seen at one program point, in constant space.

The algorithm of the value-sampling paper (Burrows et al., ASPLOS 2000, section
2.2), from Gibbons and Matias' sampling summaries: a table C of at most N
values with counters and a probability p (initially 1). Each value seen adds
one to C[v] with probability p. When that makes more than N counters non-zero,
p becomes p/f and every recorded instance is kept with probability 1/f (each
C[v] becomes Binomial(C[v], 1/f)), until at most N remain. C[v]/p is then an
unbiased estimate of how many times v was seen. N = 16, f = N/(N-1), as in the
paper; hotlists of (value, call site) pairs get N = 64, room for 16 per site for
four call sites.

Hotlists merge across flushes, epochs and hosts: both are brought to the
lower p by binomial thinning, added, and reduced to N the same way.
"""

from __future__ import annotations

import random
from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field

import numpy as np

from cyclescope.arrays import group

N_DEFAULT = 16
# Kinds of (value, call site) pairs keep every site's values in the instruction's one hotlist, so
# they get room for several sites: N = 64 holds the paper's 16 for each of 4 call sites.
PER_CALL_SITE = "@ctx"
N_PER_CALL_SITE = 64
# Branch outcomes (the edges module): a jump table's targets. A bytecode interpreter's dispatch
# has a hundred or more (SQLite's sqlite3VdbeExec: about 190 opcodes), and the export of sampled
# paths (analysis/paths.py) wants each one's share; conditional branches have two values, so only
# indirect jumps and calls ever use the room.
EDGE_KIND = "edge"
N_EDGE = 256
# Every execution of a probed goal candidate (values/probes.py): room for the values of a
# semi-invariant's uncommon cases, so that its top value's share is counted rather than estimated.
EXACT_PREFIX = "exact:"
N_EXACT = 256


def hotlist_size(kind: str) -> int:
    """N for a hotlist of this value kind."""
    if kind == EDGE_KIND:
        return N_EDGE
    if kind.startswith(EXACT_PREFIX):
        return N_EXACT
    return N_PER_CALL_SITE if kind.endswith(PER_CALL_SITE) else N_DEFAULT


def hotlist_sizes(kinds: Iterable[str]) -> np.ndarray:
    """N per kind code (for :func:`reduce_set` and :func:`merge_sets` over keys with a ``kind`` field)."""
    return np.array([hotlist_size(k) for k in kinds] or [N_DEFAULT], np.int64)


def _sizes_of(keys: np.ndarray, n: int | np.ndarray) -> np.ndarray:
    """N per hotlist: ``n`` itself, or ``n[kind]`` when ``n`` is an array indexed by kind code."""
    if isinstance(n, np.ndarray):
        out: np.ndarray = np.asarray(n, np.int64)[keys["kind"]]
        return out
    return np.full(len(keys), int(n), np.int64)


def _binomial(rng: random.Random, n: int, q: float) -> int:
    """Binomial(n, q) for the small n of hotlist counters (exact, by coin flips or by inversion)."""
    if n <= 0 or q <= 0:
        return 0
    if q >= 1:
        return n
    if n <= 64:
        return sum(1 for _ in range(n) if rng.random() < q)
    # Larger counts (merged hotlists): normal approximation, clipped, rounded.
    mean = n * q
    sd = (n * q * (1 - q)) ** 0.5
    return max(0, min(n, round(rng.gauss(mean, sd))))


@dataclass
class Hotlist:
    """At most ``n`` values with counts; ``count(v) / p`` estimates how often v was seen."""

    n: int = N_DEFAULT
    p: float = 1.0
    total: int = 0  # values offered (vtot): exact
    counts: dict[Hashable, int] = field(default_factory=dict)
    rng: random.Random = field(default_factory=random.Random, repr=False, compare=False)

    @property
    def f(self) -> float:
        return self.n / (self.n - 1)

    def add(self, v: Hashable) -> None:
        self.total += 1
        if self.p < 1.0 and self.rng.random() >= self.p:
            return
        self.counts[v] = self.counts.get(v, 0) + 1
        if len(self.counts) > self.n:
            self._reduce()

    def extend(self, values: Iterable[Hashable]) -> None:
        for v in values:
            self.add(v)

    def _reduce(self) -> None:
        while len(self.counts) > self.n:
            self.p /= self.f
            q = 1.0 / self.f
            kept = {}
            for v, c in self.counts.items():
                k = _binomial(self.rng, c, q)
                if k:
                    kept[v] = k
            self.counts = kept

    def estimate(self, v: Hashable) -> float:
        return self.counts.get(v, 0) / self.p if self.p > 0 else 0.0

    def stderr(self, v: Hashable) -> float:
        """Standard error of ``estimate(v)``: C[v] ~ Binomial(true count, p), so sqrt(C[v](1-p))/p."""
        if self.p <= 0:
            return 0.0
        return float((self.counts.get(v, 0) * (1.0 - self.p)) ** 0.5 / self.p)

    def top(self, k: int | None = None) -> list[tuple[Hashable, float, float]]:
        """(value, estimated count, estimated share of all values seen), most frequent first."""
        items = sorted(self.counts.items(), key=lambda kv: (-kv[1], str(kv[0])))
        if k is not None:
            items = items[:k]
        return [(v, c / self.p, (c / self.p) / self.total if self.total else 0.0) for v, c in items]

    def merge(self, other: Hotlist) -> Hotlist:
        """A hotlist of both streams (neither input is changed)."""
        n = min(self.n, other.n)
        lo = min(self.p, other.p)
        rng = self.rng
        out = Hotlist(n, lo, self.total + other.total, {}, rng)
        for h in (self, other):
            q = lo / h.p if h.p > 0 else 0.0
            for v, c in h.counts.items():
                k = _binomial(rng, c, q) if q < 1 else c
                if k:
                    out.counts[v] = out.counts.get(v, 0) + k
        out._reduce()
        return out

    def to_rows(self) -> list[tuple[Hashable, int]]:
        return sorted(self.counts.items(), key=lambda kv: (-kv[1], str(kv[0])))

    @staticmethod
    def from_rows(rows: Iterable[tuple[Hashable, int]], p: float, total: int, n: int = N_DEFAULT,
                  rng: random.Random | None = None) -> Hotlist:
        return Hotlist(n, p, total, {v: int(c) for v, c in rows}, rng or random.Random())


# --- many hotlists at once ---------------------------------------------------------------


def _columns(arr: np.ndarray) -> list[np.ndarray]:
    """The plain columns of a structured array, nested fields flattened, in field order."""
    cols: list[np.ndarray] = []
    for name in arr.dtype.names or ():
        sub = arr[name]
        if sub.dtype.names:  # nested (e.g. a value inside a pair)
            cols.extend(sub[f] for f in sub.dtype.names)
        else:
            cols.append(sub)
    return cols


def _changes(sorted_cols: list[np.ndarray], n: int, into: np.ndarray | None = None) -> np.ndarray:
    """Where a row of the sorted columns differs from the one before it (row 0 always does);
    ``into``: marks to extend (a copy is made) with these columns' changes."""
    change = np.zeros(n, bool) if into is None else into.copy()
    change[0] = True
    for c in sorted_cols:
        change[1:] |= c[1:] != c[:-1]
    return change


def unique_struct(arr: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """np.unique for a structured array (unique rows, inverse, counts), by lexsort over its fields:
    numpy's own unique sorts structured rows with a generic comparison, 20-50x slower."""
    n = len(arr)
    if not n:
        return arr[:0], np.zeros(0, np.int64), np.zeros(0, np.int64)
    cols = _columns(arr)
    order = np.lexsort(cols[::-1])
    change = _changes([c[order] for c in cols], n)
    starts = np.flatnonzero(change)
    inverse = np.empty(n, np.int64)
    inverse[order] = np.cumsum(change) - 1
    counts = np.diff(np.append(starts, n))
    return np.take(arr, order[starts]), inverse, counts


def cat_struct(parts: list[np.ndarray]) -> np.ndarray:
    """np.concatenate for structured arrays of one dtype, as bytes: numpy promotes the dtypes of
    structured inputs field by field, which costs more than the copy for a drain's small parts."""
    if len(parts) == 1:
        return parts[0]
    dt = parts[0].dtype
    return np.concatenate([np.ascontiguousarray(p).view(np.uint8) for p in parts]).view(dt)


VALUE_DTYPE = np.dtype([("v0", "<u8"), ("v1", "<u8"), ("vimg", "<i8")])


@dataclass
class HotlistSet:
    """Many hotlists as arrays, for the daemon and the database: one entry per hotlist in ``keys``
    (a structured array; unique), one row per (hotlist, value) in ``hot``/``values``/``counts``."""

    keys: np.ndarray  # structured, one per hotlist
    p: np.ndarray  # float64 per hotlist
    total: np.ndarray  # uint64 per hotlist: values offered (vtot)
    hot: np.ndarray  # int64 per row: index into keys
    values: np.ndarray  # VALUE_DTYPE per row
    counts: np.ndarray  # int64 per row: C[v]

    def __len__(self) -> int:
        return len(self.keys)

    @property
    def rows(self) -> int:
        return len(self.counts)

    @staticmethod
    def empty(key_dtype: np.dtype) -> HotlistSet:
        return HotlistSet(np.zeros(0, key_dtype), np.zeros(0), np.zeros(0, np.uint64), np.zeros(0, np.int64),
                          np.zeros(0, VALUE_DTYPE), np.zeros(0, np.int64))

    @staticmethod
    def exact(keys: np.ndarray, values: np.ndarray) -> HotlistSet:
        """Hotlists (p = 1, not yet reduced) of the observations ``(keys[i], values[i])``: one sort
        by key and value gives both the hotlists (runs of equal keys) and their counters (runs of
        equal pairs)."""
        n = len(keys)
        if not n:
            return HotlistSet.empty(keys.dtype)
        kcols, vcols = _columns(keys), _columns(values)
        order = np.lexsort((kcols + vcols)[::-1])
        key_change = _changes([c[order] for c in kcols], n)
        pair_change = _changes([c[order] for c in vcols], n, into=key_change)
        kstarts = np.flatnonzero(key_change)
        pstarts = np.flatnonzero(pair_change)
        hot = (np.cumsum(key_change) - 1)[pstarts]
        total = np.diff(np.append(kstarts, n)).astype(np.uint64)
        counts = np.diff(np.append(pstarts, n)).astype(np.int64)
        # (np.take: numpy's fancy indexing copies structured rows field by field, several times slower.)
        return HotlistSet(np.take(keys, order[kstarts]), np.ones(len(kstarts)), total, hot.astype(np.int64),
                          np.take(values, order[pstarts]), counts)

    def hotlist(self, i: int, n: int = N_DEFAULT) -> Hotlist:
        """Hotlist ``i`` as a :class:`Hotlist` of size ``n`` (values as (v0, v1, vimg) tuples)."""
        rows = np.flatnonzero(self.hot == i)
        counts = {(int(v["v0"]), int(v["v1"]), int(v["vimg"])): int(c)
                  for v, c in zip(self.values[rows], self.counts[rows], strict=True)}
        return Hotlist(n, float(self.p[i]), int(self.total[i]), counts)  # type: ignore[arg-type]


def merge_sets(sets: list[HotlistSet], n: int | np.ndarray = N_DEFAULT,
               rng: np.random.Generator | None = None) -> HotlistSet:
    """Hotlists of all the streams: per key, every input is thinned to the lowest p (each C[v]
    becomes Binomial(C[v], p_low / p)), the counts are added, and the result is reduced to at most
    ``n`` values the paper's way (p /= f and binomial thinning by 1/f until at most n remain).
    ``n`` is one N for all, or N per kind code (:func:`hotlist_sizes`)."""
    nonempty = [s for s in sets if len(s)]
    if not nonempty:
        return sets[0] if sets else HotlistSet.empty(np.dtype([("k", "<i8")]))
    sets = nonempty
    rng = rng or np.random.default_rng()
    keys = cat_struct([s.keys for s in sets])
    uk, kinv, _ = unique_struct(keys)
    g = len(uk)
    p = np.full(g, np.inf)
    np.minimum.at(p, kinv, np.concatenate([s.p for s in sets]))
    total = np.zeros(g, np.uint64)
    np.add.at(total, kinv, np.concatenate([s.total for s in sets]))
    base = 0
    hot_parts, val_parts, cnt_parts = [], [], []
    for s in sets:
        h = kinv[base + s.hot]  # the merged hotlist of each row
        q = p[h] / s.p[s.hot]
        c = s.counts
        thin = q < 1.0
        if thin.any():
            c = c.copy()
            c[thin] = rng.binomial(c[thin], q[thin])
        hot_parts.append(h)
        val_parts.append(s.values)
        cnt_parts.append(c)
        base += len(s.keys)
    hot = np.concatenate(hot_parts)
    values = cat_struct(val_parts)
    counts = np.concatenate(cnt_parts).astype(np.int64)
    # Add the counts of equal (hotlist, value) rows.
    pair = np.empty(len(hot), dtype=[("h", "<i8"), ("v", VALUE_DTYPE)])
    pair["h"] = hot
    pair["v"] = values
    up, inv, _ = unique_struct(pair)
    summed = np.bincount(inv, weights=counts, minlength=len(up)).astype(np.int64)
    out = HotlistSet(uk, p, total, up["h"].astype(np.int64), up["v"], summed)
    return reduce_set(out, n, rng)


def reduce_set(s: HotlistSet, n: int | np.ndarray = N_DEFAULT, rng: np.random.Generator | None = None,
               per_instance_limit: int = 4_000_000) -> HotlistSet:
    """Bring every hotlist of ``s`` to at most ``n`` non-zero counters (in place of a copy); ``n``
    is one N for all, or N per kind code (:func:`hotlist_sizes`), and f = N/(N-1) per hotlist.

    The paper's rounds (p /= f, every instance kept with probability 1/f, until at most ``n``
    counters remain) are run in one pass, exactly in distribution: each recorded instance
    survives a Geometric number G of rounds (P(G >= j) = f^-j), a counter is alive after j rounds
    while one of its instances has G >= j, so a hotlist stops after J rounds, J = 1 + the
    (n+1)-th largest of its counters' max G, and keeps the instances with G >= J. A drain has a
    few hotlists with hundreds of distinct values, which take dozens of rounds one by one. When
    the counts are too large to draw per instance, the rounds run one by one over those rows."""
    rng = rng or np.random.default_rng()
    size = _sizes_of(s.keys, n)
    hot, counts, p = s.hot, s.counts.copy(), s.p.copy()
    nz = counts > 0
    over = np.bincount(hot[nz], minlength=len(s.keys)) > size
    if not over.any():
        keep = np.flatnonzero(nz)
        return HotlistSet(s.keys, p, s.total, hot[keep], np.take(s.values, keep), counts[keep])
    sub = np.flatnonzero(over[hot] & nz)
    ids, local = group(hot[sub])  # the hotlists over n, numbered densely
    nl = size[ids]
    f = nl / (nl - 1.0)
    c = counts[sub]
    if int(c.sum()) <= per_instance_limit:
        rows_of = np.repeat(np.arange(len(sub)), c)
        q = 1.0 - 1.0 / (f[local[rows_of]] if (nl != nl[0]).any() else f[0])  # (a scalar draws faster)
        g = rng.geometric(q, size=len(rows_of)) - 1  # rounds each instance survives
        starts = np.concatenate(([0], np.cumsum(c)[:-1]))
        tmax = np.maximum.reduceat(g, starts)
        # Per hotlist, counters by max G, largest first: one sort of hotlist * span - G (G < span).
        span = int(tmax.max()) + 1
        order = np.argsort(local * span + (span - 1 - tmax), kind="stable")
        first = np.searchsorted(local[order], np.arange(len(ids)))
        rounds = tmax[order[first + nl]] + 1  # every hotlist here has more than n counters
        c = np.bincount(rows_of, weights=g >= rounds[local[rows_of]], minlength=len(sub)).astype(np.int64)
    else:
        live = np.ones(len(ids), bool)
        rounds = np.zeros(len(ids), np.int64)
        while live.any():
            rows = live[local] & (c > 0)
            c[rows] = rng.binomial(c[rows], 1.0 / f[local[rows]])
            rounds[live] += 1
            live &= np.bincount(local[c > 0], minlength=len(ids)) > nl
    counts[sub] = c
    p[ids] /= f ** rounds.astype(np.float64)
    keep = np.flatnonzero(counts > 0)
    return HotlistSet(s.keys, p, s.total, hot[keep], np.take(s.values, keep), counts[keep])


def _rows_as_words(keys: np.ndarray) -> np.ndarray:
    """Each structured row's bytes as 64-bit words (the last one zero-padded), for hashing and
    comparing rows as wholes."""
    keys = np.ascontiguousarray(keys)
    n, size = len(keys), keys.dtype.itemsize
    raw = keys.view(np.uint8).reshape(n, size)
    if size % 8:
        raw = np.concatenate([raw, np.zeros((n, 8 - size % 8), np.uint8)], axis=1)
    return raw.view("<u8")


_HASH_MULTIPLIERS = np.array([0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9, 0x27D4EB2F165667C5],
                             np.uint64)


def _key_hash(words: np.ndarray) -> np.ndarray:
    """A 64-bit hash of each row of words, for finding rows among a few known ones by
    searchsorted; callers compare the bytes of every match, so a collision costs nothing but a
    missed match."""
    h = np.zeros(len(words), np.uint64)
    for i in range(words.shape[1]):
        h += words[:, i] * _HASH_MULTIPLIERS[i % len(_HASH_MULTIPLIERS)]
    return h ^ (h >> np.uint64(29))


class RunningP:
    """The paper's online rule for a stream of batches: a value seen adds one to C[v] with the
    hotlist's current probability p. Batches are counted exactly and reduced (HotlistSet.exact,
    reduce_set); this keeps, per hotlist, the lowest p any batch since :meth:`reset` brought it to,
    and :meth:`exact` drops each observation of such a hotlist with probability 1 - p before
    counting (its totals still count every observation). That is what merging would do to the
    batch's counters anyway (binomial thinning by p is keeping each instance with probability p),
    done first: a hotlist of many distinct values (addresses, loaded data) has p far below 1 after
    its first batch, and most of a batch's observations are of such hotlists (about 3 in 4 on the
    bench's workload), so sorting and reducing them is most of the cost of counting."""

    def __init__(self, key_dtype: np.dtype) -> None:
        self.keys = np.zeros(0, key_dtype)
        self.hash = np.zeros(0, np.uint64)  # sorted; keys and p in the same order
        self.p = np.zeros(0)

    def reset(self) -> None:
        self.keys, self.hash, self.p = self.keys[:0], self.hash[:0], self.p[:0]

    def _find(self, keys: np.ndarray) -> np.ndarray:
        """Index of each row of ``keys`` among the known hotlists, -1 where it is not one."""
        n = len(keys)
        if not len(self.hash) or not n:
            return np.full(n, -1, np.int64)
        words = _rows_as_words(keys)
        h = _key_hash(words)
        pos = np.minimum(np.searchsorted(self.hash, h), len(self.hash) - 1)
        hit = np.flatnonzero(self.hash[pos] == h)
        at = pos[hit]
        known = _rows_as_words(self.keys)
        same = np.ones(len(hit), bool)
        for i in range(words.shape[1]):
            same &= known[:, i][at] == words[:, i][hit]
        hit = hit[same]
        out = np.full(n, -1, np.int64)
        out[hit] = pos[hit]
        return out

    def exact(self, keys: np.ndarray, values: np.ndarray, rng: np.random.Generator) -> HotlistSet:
        """HotlistSet.exact of the observations each kept with its hotlist's p (1 if unknown); the
        known hotlists carry that p and the total of all their observations."""
        at = self._find(keys)
        known = np.flatnonzero(at >= 0)
        if not len(known):
            return HotlistSet.exact(keys, values)
        keep = np.ones(len(keys), bool)
        keep[known] = rng.random(len(known)) < self.p[at[known]]
        sel = np.flatnonzero(keep)
        s = HotlistSet.exact(np.take(keys, sel), np.take(values, sel))
        totals = np.bincount(at[known], minlength=len(self.keys)).astype(np.uint64)
        mine = self._find(s.keys)
        k = np.flatnonzero(mine >= 0)
        s.p[k] = self.p[mine[k]]
        s.total[k] = totals[mine[k]]
        # Known hotlists whose observations were all left out still saw them.
        seen = totals > 0
        seen[mine[k]] = False
        gone = np.flatnonzero(seen)
        if len(gone):
            s = HotlistSet(cat_struct([s.keys, np.take(self.keys, gone)]), np.concatenate([s.p, self.p[gone]]),
                           np.concatenate([s.total, totals[gone]]), s.hot, s.values, s.counts)
        return s

    def update(self, s: HotlistSet) -> None:
        """Remember the p of every hotlist of ``s`` below 1 (the lowest, with what was known)."""
        low = np.flatnonzero(s.p < 1.0)
        if not len(low):
            return
        keys = cat_struct([self.keys, np.take(s.keys, low)]) if len(self.keys) else np.take(s.keys, low)
        p = np.concatenate([self.p, s.p[low]])
        h = _key_hash(_rows_as_words(keys))
        order = np.lexsort((p, h))  # by hash, lowest p first
        h = h[order]
        first = np.ones(len(h), bool)
        first[1:] = h[1:] != h[:-1]  # two keys of one hash: the first is known, the other never thinned
        keep = order[first]
        self.keys, self.hash, self.p = np.take(keys, keep), h[first], p[keep]
