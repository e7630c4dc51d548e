"""Aggregation of mapped samples into counts per (image, offset, event, process)."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from cyclescope.collect.aggregate import Aggregator, pack_key, reduce_keys


def test_counts_equal_a_plain_counter_over_many_batches() -> None:
    rng = np.random.default_rng(1)
    agg = Aggregator(reduce_at=5000)
    truth: Counter[tuple[int, int, int, int]] = Counter()
    for _ in range(30):
        n = 2000
        image = rng.integers(0, 5, n)
        offset = rng.integers(0, 300, n).astype(np.uint64)
        event = rng.integers(0, 3, n)
        comm = rng.integers(0, 4, n)
        agg.add(image, offset, event, comm)
        truth.update(zip(image.tolist(), offset.tolist(), event.tolist(), comm.tolist(), strict=True))
    # Reduced along the way: at most twice the distinct keys plus one batch, not all 60000 rows.
    distinct = 5 * 300 * 3 * 4
    assert len(agg) <= 2 * distinct + 2000 < 60000
    c = agg.take()
    got = Counter({k: v for k, v in zip(zip(c.image.tolist(), c.offset.tolist(), c.event.tolist(), c.comm.tolist(),
                                                strict=True), c.count.tolist(), strict=True)})
    assert got == truth
    assert c.total == 60000
    assert len(agg) == 0 and agg.take().total == 0


def test_explicit_counts_are_added() -> None:
    agg = Aggregator()
    one = np.array([1])
    agg.add(one, np.array([5], np.uint64), one * 0, one * 0, np.array([7]))
    agg.add(one, np.array([5], np.uint64), one * 0, one * 0, np.array([3]))
    c = agg.take()
    assert c.count.tolist() == [10] and c.offset.tolist() == [5]


def test_reduce_keys_sorts_and_sums() -> None:
    k1, k2, c = reduce_keys(np.array([2, 1, 2, 1], np.uint64), np.array([1, 9, 1, 3], np.uint64),
                            np.array([1, 2, 3, 4], np.uint64))
    assert list(zip(k1.tolist(), k2.tolist(), c.tolist(), strict=True)) == [(1, 3, 4), (1, 9, 2), (2, 1, 4)]


def test_keys_that_do_not_fit_are_refused() -> None:
    with pytest.raises(OverflowError):
        pack_key(np.array([1]), np.array([300]), np.array([0]))
