"""arrays.py against np.unique, whose results it must give, on random and edge-case inputs."""

from __future__ import annotations

import numpy as np
import pytest

from cyclescope.arrays import counts, distinct, group


@pytest.mark.parametrize("n", [0, 1, 2, 7, 300])
@pytest.mark.parametrize("kind", ["small", "small_u64", "wide", "negative", "uint64", "object"])
def test_the_helpers_give_what_np_unique_gives(n: int, kind: str) -> None:
    rng = np.random.default_rng(n)
    x = {"small": rng.integers(0, 5, n), "small_u64": rng.integers(0, 5, n).astype(np.uint64),
         "wide": rng.integers(0, 1 << 40, n) // (1 << 38) << 38,
         "negative": rng.integers(-3, 3, n), "uint64": rng.integers(0, 4, n).astype(np.uint64) << np.uint64(63),
         "object": np.array([f"p{k}" for k in rng.integers(0, 4, n)], dtype=object)}[kind]
    u = np.unique(x)
    assert distinct(x).tolist() == u.tolist() and distinct(x).dtype == u.dtype
    v, inv = group(x)
    uu, uinv = np.unique(x, return_inverse=True)
    assert v.tolist() == uu.tolist() and inv.tolist() == uinv.reshape(-1).tolist()
    if kind != "object":
        v, c = counts(x)
        uu, uc = np.unique(x, return_counts=True)
        assert v.tolist() == uu.tolist() and c.tolist() == uc.tolist() and v.dtype == uu.dtype
