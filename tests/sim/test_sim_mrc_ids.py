"""`mrc._dense_ids`: equal keys get equal numbers, different keys different ones, numbered
`0 .. distinct - 1`, including keys that share their high bits (the sort packs only those, so
different keys there can interleave and must be grouped again)."""

from __future__ import annotations

import numpy as np
import pytest

from pagedkv.sim.mrc import _dense_ids


def _check(keys: np.ndarray) -> None:
    ids, distinct = _dense_ids(keys)
    assert distinct == len(np.unique(keys))
    assert len(ids) == len(keys)
    if len(keys):
        assert ids.min() == 0 and ids.max() == distinct - 1
    # The same partition as the keys: each key one number, each number one key.
    pairs = {(int(k), int(i)) for k, i in zip(keys, ids, strict=True)}
    assert len({k for k, _ in pairs}) == len(pairs) == len({i for _, i in pairs})


@pytest.mark.parametrize("seed", range(6))
def test_random_keys_with_repeats(seed: int) -> None:
    rng = np.random.default_rng(seed)
    base = rng.integers(0, 2**63, size=400, dtype=np.int64).astype(np.uint64) << np.uint64(1)
    _check(base[rng.integers(0, len(base), size=2000)])


@pytest.mark.parametrize("seed", range(6))
def test_keys_sharing_high_bits_interleave(seed: int) -> None:
    # Small keys: all share the high bits the sort packs, so only the regrouping separates them.
    rng = np.random.default_rng(seed)
    small = rng.integers(0, 40, size=1500).astype(np.uint64)
    top = (rng.integers(0, 3, size=1500).astype(np.uint64)) << np.uint64(62)
    _check(small | top)


def test_edge_values_and_sizes() -> None:
    _check(np.zeros(0, dtype=np.uint64))
    _check(np.array([7], dtype=np.uint64))
    _check(np.array([2**64 - 1, 0, 2**63, 2**64 - 1, 0], dtype=np.uint64))
