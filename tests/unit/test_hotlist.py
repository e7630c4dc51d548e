"""Hotlists (Gibbons-Matias, as the value-sampling paper uses them): accuracy and merging."""

from __future__ import annotations

import random

import numpy as np
import pytest

from cyclescope.db.hotlist import (
    N_DEFAULT,
    N_PER_CALL_SITE,
    VALUE_DTYPE,
    Hotlist,
    HotlistSet,
    RunningP,
    hotlist_size,
    hotlist_sizes,
    merge_sets,
    reduce_set,
)


def stream(n: int, seed: int) -> list[int]:
    """70% the value 7, 20% the value 42, 10% spread over 5000 others."""
    rng = np.random.default_rng(seed)
    u = rng.random(n)
    other = rng.integers(1000, 6000, n)
    return np.where(u < 0.7, 7, np.where(u < 0.9, 42, other)).tolist()


def test_the_hot_values_are_found_with_their_shares() -> None:
    h = Hotlist(rng=random.Random(1))
    h.extend(stream(50000, 1))
    top = h.top(3)
    assert [v for v, _, _ in top[:2]] == [7, 42]
    # The stated tolerance: three standard errors of the binomial count C[v]/p. With 5,000
    # distinct rare values in the stream, p falls to about 14/5000 and C[7] is about 100, so
    # the paper's hotlist knows the top share to about +-10% relative, not better.
    for (v, est, share), truth in zip(top[:2], (0.70, 0.20), strict=True):
        assert abs(est - truth * 50000) <= 3 * h.stderr(v)
        assert share == pytest.approx(truth, rel=0.35)
    assert len(h.counts) <= 16 and h.total == 50000 and h.p < 1


def test_counts_are_unbiased_over_many_runs() -> None:
    est = []
    for seed in range(40):
        h = Hotlist(rng=random.Random(seed))
        h.extend(stream(5000, seed))
        est.append(h.estimate(42) / 5000)
    assert np.mean(est) == pytest.approx(0.20, abs=0.01)


def test_a_short_stream_is_exact() -> None:
    h = Hotlist()
    h.extend([1, 2, 2, 3, 3, 3])
    assert h.p == 1.0 and h.counts == {1: 1, 2: 2, 3: 3} and h.estimate(3) == 3


def test_merging_matches_a_single_pass() -> None:
    data = stream(60000, 3)
    merged_shares = []
    single_shares = []
    for seed in range(40):
        parts = [Hotlist(rng=random.Random(seed * 10 + i)) for i in range(3)]
        for i, h in enumerate(parts):
            h.extend(data[i * 20000 : (i + 1) * 20000])
        m = parts[0].merge(parts[1]).merge(parts[2])
        one = Hotlist(rng=random.Random(seed))
        one.extend(data)
        assert m.total == one.total == 60000 and len(m.counts) <= 16
        merged_shares.append([m.estimate(7) / 60000, m.estimate(42) / 60000])
        single_shares.append([one.estimate(7) / 60000, one.estimate(42) / 60000])
    merged, single = np.array(merged_shares), np.array(single_shares)
    # Both estimators are unbiased: their means agree, and agree with the truth, within
    # three standard errors of the mean over the runs.
    se = np.sqrt(merged.var(axis=0, ddof=1) / len(merged) + single.var(axis=0, ddof=1) / len(single))
    assert np.all(np.abs(merged.mean(axis=0) - single.mean(axis=0)) <= 3 * se)
    se_m = merged.std(axis=0, ddof=1) / np.sqrt(len(merged))
    assert np.all(np.abs(merged.mean(axis=0) - [0.70, 0.20]) <= 3 * se_m + 0.005)
    # Merging thins to the lowest p but loses no more than a single pass does.
    assert merged.std(axis=0).max() <= 1.5 * single.std(axis=0).max() + 0.02


def test_rows_round_trip() -> None:
    h = Hotlist(rng=random.Random(2))
    h.extend(stream(3000, 2))
    back = Hotlist.from_rows(h.to_rows(), h.p, h.total)
    assert back.counts == h.counts and back.estimate(7) == h.estimate(7)


def _set_of(stream_values: list[int], key: int = 0) -> HotlistSet:
    keys = np.zeros(len(stream_values), dtype=[("k", "<i8")])
    keys["k"] = key
    vals = np.zeros(len(stream_values), dtype=VALUE_DTYPE)
    vals["v0"] = stream_values
    return HotlistSet.exact(keys, vals)


def test_vectorized_merge_agrees_with_the_single_pass_hotlist() -> None:
    data = stream(60000, 5)
    rng = np.random.default_rng(7)
    est7, est42, single7 = [], [], []
    for seed in range(30):
        parts = [reduce_set(_set_of(data[i * 6000 : (i + 1) * 6000]), rng=rng) for i in range(10)]
        m = parts[0]
        for q in parts[1:]:  # flush after flush, as the daemon merges
            m = merge_sets([m, q], rng=rng)
        h = m.hotlist(0)
        assert m.total[0] == 60000 and len(h.counts) <= 16
        est7.append(h.estimate((7, 0, 0)) / 60000)
        est42.append(h.estimate((42, 0, 0)) / 60000)
        one = Hotlist(rng=random.Random(seed))
        one.extend(data)
        single7.append(one.estimate(7) / 60000)
    se = np.std(est7, ddof=1) / np.sqrt(len(est7))
    assert abs(np.mean(est7) - 0.70) <= 3 * se + 0.005
    assert abs(np.mean(est42) - 0.20) <= 3 * np.std(est42, ddof=1) / np.sqrt(len(est42)) + 0.005
    assert abs(np.mean(est7) - np.mean(single7)) <= 3 * np.sqrt(se**2 + np.var(single7, ddof=1) / 30) + 0.005


def test_merging_keeps_hotlists_apart_and_small_ones_exact() -> None:
    a = _set_of([1, 1, 2], key=1)
    b = _set_of([5] * 10, key=2)
    c = _set_of([1, 3], key=1)
    m = merge_sets([a, b, c])
    assert m.keys["k"].tolist() == [1, 2] and m.p.tolist() == [1.0, 1.0] and m.total.tolist() == [5, 10]
    h1, h2 = m.hotlist(0), m.hotlist(1)
    assert h1.counts == {(1, 0, 0): 3, (2, 0, 0): 1, (3, 0, 0): 1} and h2.counts == {(5, 0, 0): 10}


def test_reduction_in_one_pass_matches_the_papers_rounds_in_distribution() -> None:
    # One hotlist: a value seen 60 times and 200 values seen once each; another with 10 values
    # (under N: untouched). Reduced many times both ways, the rounds taken (p) and C[v]/p of the
    # heavy value agree, and C[v]/p is unbiased.
    keys = np.zeros(2, dtype=[("k", "<i8")])
    keys["k"] = [0, 1]
    vals = np.zeros(211, VALUE_DTYPE)
    vals["v0"] = np.arange(211)
    hot = np.array([0] * 201 + [1] * 10, np.int64)
    counts = np.array([60] + [1] * 200 + [3] * 10, np.int64)
    s = HotlistSet(keys, np.ones(2), np.array([260, 30], np.uint64), hot, vals, counts)
    rng = np.random.default_rng(5)
    res: dict[str, tuple[list[float], list[float]]] = {}
    for name, limit in (("one pass", 1 << 30), ("rounds", 0)):
        profile_set, est = [], []
        for _ in range(3000):
            r = reduce_set(s, 16, rng, per_instance_limit=limit)
            assert np.bincount(r.hot, minlength=2).max() <= 16
            assert r.p[1] == 1.0 and r.counts[r.hot == 1].tolist() == [3] * 10
            profile_set.append(float(np.log(r.p[0])))
            heavy = r.counts[(r.hot == 0) & (r.values["v0"] == 0)]
            est.append(float(heavy.sum()) / float(r.p[0]))
        res[name] = (profile_set, est)
    a, b = res["one pass"], res["rounds"]
    assert abs(np.mean(a[0]) - np.mean(b[0])) < 0.02 * abs(np.mean(b[0]))
    assert abs(np.std(a[0]) - np.std(b[0])) < 0.15 * np.std(b[0])
    for est in (a[1], b[1]):
        assert abs(np.mean(est) - 60) < 4 * np.std(est) / np.sqrt(len(est))


def test_call_site_kinds_get_a_larger_hotlist_and_stay_unbiased() -> None:
    # Two kinds at one instruction: in:rdi (N = 16) and in:rdi@ctx (N = 64), each offered the same
    # 40 distinct values (a heavy one and 39 once-seen). The plain hotlist is reduced to 16, the
    # per-call-site one keeps all 40 exactly; over 64 values the larger one is reduced too, its
    # f = 64/63 and estimate unbiased.
    kinds = ["in:rdi", "in:rdi@ctx"]
    sizes = hotlist_sizes(kinds)
    assert sizes.tolist() == [N_DEFAULT, N_PER_CALL_SITE] and hotlist_size("ctx") == N_DEFAULT
    kd = np.dtype([("offset", "<u8"), ("kind", "<i4")])

    def observations(distinct: int) -> tuple[np.ndarray, np.ndarray]:
        v = np.concatenate([np.zeros(100, np.uint64), np.arange(1, distinct, dtype=np.uint64)])
        keys = np.zeros(2 * len(v), kd)
        keys["kind"] = np.repeat([0, 1], len(v))
        vals = np.zeros(2 * len(v), VALUE_DTYPE)
        vals["v0"] = np.tile(v, 2)
        return keys, vals

    rng = np.random.default_rng(3)
    r = reduce_set(HotlistSet.exact(*observations(40)), sizes, rng)
    per = np.bincount(r.hot, minlength=2)
    assert per[0] <= N_DEFAULT and r.p[0] < 1.0
    assert per[1] == 40 and r.p[1] == 1.0
    est, profile_set = [], []
    for _ in range(2000):
        r = reduce_set(HotlistSet.exact(*observations(200)), sizes, rng)
        assert np.bincount(r.hot, minlength=2)[1] <= N_PER_CALL_SITE
        heavy = r.counts[(r.hot == 1) & (r.values["v0"] == 0)]
        est.append(float(heavy.sum()) / float(r.p[1]))
        profile_set.append(float(r.p[1]))
    assert max(profile_set) < 1.0
    assert abs(np.mean(est) - 100) < 4 * np.std(est) / np.sqrt(len(est))
    # Merging keeps each kind's N.
    m = merge_sets([HotlistSet.exact(*observations(40)), HotlistSet.exact(*observations(20))], sizes, rng)
    assert np.bincount(m.hot, minlength=2)[1] == 40 and m.p[1] == 1.0
    assert np.bincount(m.hot, minlength=2)[0] <= N_DEFAULT


def _obs(stream_values: list[int], key: int) -> tuple[np.ndarray, np.ndarray]:
    keys = np.zeros(len(stream_values), dtype=[("uid", "<i4"), ("k", "<i8")])
    keys["k"] = key
    vals = np.zeros(len(stream_values), dtype=VALUE_DTYPE)
    vals["v0"] = stream_values
    return keys, vals


def test_batches_thinned_by_the_running_p_stay_unbiased_and_count_every_value() -> None:
    # Ten batches of one stream (5,000 distinct rare values: p falls far below 1 in the first), and
    # a small hotlist of three values beside it (p stays 1). Each batch's observations of the first
    # hotlist are kept with its p so far, as the paper's online rule does; merged, the estimates
    # agree with batches counted exactly before thinning, and vtot counts every value offered.
    data = stream(60000, 5)
    rng = np.random.default_rng(3)
    thinned7, thinned42, exact7 = [], [], []
    for _ in range(30):
        run, parts, plain = RunningP(np.dtype([("uid", "<i4"), ("k", "<i8")])), [], []
        kept = 0
        for i in range(10):
            k1, v1 = _obs(data[i * 6000 : (i + 1) * 6000], key=1)
            k2, v2 = _obs([5, 6, 6], key=2)
            keys, vals = np.concatenate([k1, k2]), np.concatenate([v1, v2])
            s = run.exact(keys, vals, rng)
            kept += int(s.counts.sum())
            s = reduce_set(s, rng=rng)
            run.update(s)
            parts.append(s)
            plain.append(reduce_set(HotlistSet.exact(keys, vals), rng=rng))
        m = merge_sets(parts, rng=rng)
        assert m.keys["k"].tolist() == [1, 2] and m.total.tolist() == [60000, 30]
        assert m.p[1] == 1.0 and m.hotlist(1).counts == {(5, 0, 0): 10, (6, 0, 0): 20}
        assert kept < 20000  # most observations never reached the sort
        h = m.hotlist(0)
        thinned7.append(h.estimate((7, 0, 0)) / 60000)
        thinned42.append(h.estimate((42, 0, 0)) / 60000)
        exact7.append(merge_sets(plain, rng=rng).hotlist(0).estimate((7, 0, 0)) / 60000)
    se = np.std(thinned7, ddof=1) / np.sqrt(len(thinned7))
    assert abs(np.mean(thinned7) - 0.70) <= 3 * se + 0.005
    assert abs(np.mean(thinned42) - 0.20) <= 3 * np.std(thinned42, ddof=1) / np.sqrt(len(thinned42)) + 0.005
    assert abs(np.mean(thinned7) - np.mean(exact7)) <= 3 * np.sqrt(se**2 + np.var(exact7, ddof=1) / 30) + 0.005


def test_a_hotlist_thinned_to_nothing_keeps_its_total_and_a_hash_collision_thins_nothing(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import cyclescope.db.hotlist as lists

    dt = np.dtype([("uid", "<i4"), ("k", "<i8")])
    run = RunningP(dt)
    run.update(HotlistSet(np.array([(0, 1)], dt), np.array([1e-9]), np.array([5], np.uint64),
                          np.zeros(0, np.int64), np.zeros(0, VALUE_DTYPE), np.zeros(0, np.int64)))
    s = run.exact(*_obs([1, 2, 3], key=1), np.random.default_rng(0))
    assert s.keys["k"].tolist() == [1] and s.total.tolist() == [3] and s.p.tolist() == [1e-9] and not s.rows
    # Every key hashing alike: key 2 is not the known key 1, so none of its values is dropped.
    monkeypatch.setattr(lists, "_key_hash", lambda words: np.zeros(len(words), np.uint64))
    run = RunningP(dt)
    run.update(HotlistSet(np.array([(0, 1)], dt), np.array([1e-9]), np.array([5], np.uint64),
                          np.zeros(0, np.int64), np.zeros(0, VALUE_DTYPE), np.zeros(0, np.int64)))
    s = run.exact(*_obs([1, 2, 3], key=2), np.random.default_rng(0))
    assert s.keys["k"].tolist() == [2] and s.p.tolist() == [1.0] and s.counts.sum() == 3
