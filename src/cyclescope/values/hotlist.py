"""Hotlists: the most frequent values seen at one program point, in constant space.

The algorithm of the value-sampling paper (Burrows et al., ASPLOS 2000, section
2.2), from Gibbons and Matias' sampling summaries: a table C of at most N
values with counters and a probability p (initially 1). Each value seen adds
one to C[v] with probability p. When that makes more than N counters non-zero,
p becomes p/f and every recorded instance is kept with probability 1/f (each
C[v] becomes Binomial(C[v], 1/f)), until at most N remain. C[v]/p is then an
unbiased estimate of how many times v was seen. N = 16, f = N/(N-1), as in the
paper.

Hotlists merge across flushes, epochs and hosts: both are brought to the
lower p by binomial thinning, added, and reduced to N the same way.
"""

from __future__ import annotations

import random
from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field

N_DEFAULT = 16


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
