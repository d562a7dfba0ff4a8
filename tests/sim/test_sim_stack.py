"""`sim.stack.StackDistances` against the definition: an LRU list, searched and moved."""

from __future__ import annotations

import random

import numpy as np
import pytest

from pagedkv.sim.stack import BUCKET, StackDistances


class NaiveLRU:
    """The stack itself: most recent first."""

    def __init__(self) -> None:
        self.stack: list[int] = []

    def lookup(self, keys: list[int]) -> list[int]:
        return [self.stack.index(k) + 1 if k in self.stack else 0 for k in keys]

    def touch(self, keys: list[int]) -> None:
        for k in keys:
            if k in self.stack:
                self.stack.remove(k)
            self.stack.insert(0, k)


@pytest.mark.parametrize("seed", range(6))
def test_matches_the_lru_list(seed: int) -> None:
    rng = random.Random(seed)
    num_keys = rng.choice([5, 40, 3 * BUCKET])
    batches = [
        [rng.randrange(num_keys) for _ in range(rng.randrange(1, 2 * BUCKET))] for _ in range(60)
    ]
    capacity = sum(len(b) for b in batches)
    fast, slow = StackDistances(num_keys, capacity), NaiveLRU()
    for batch in batches:
        ids = np.asarray(batch, dtype=np.int64)
        # Looked up together, against one snapshot, then touched in order (repeats included).
        assert fast.lookup(ids).tolist() == slow.lookup(batch)
        fast.touch(ids)
        slow.touch(batch)
        assert fast.distinct == len(slow.stack)
    everything = np.arange(num_keys, dtype=np.int64)
    assert fast.lookup(everything).tolist() == slow.lookup(list(range(num_keys)))


def test_a_repeat_in_a_batch_lands_where_its_last_touch_puts_it() -> None:
    s = StackDistances(4, 16)
    s.touch(np.asarray([0, 1, 2, 0, 3], dtype=np.int64))
    # Most recent first: 3, 0, 2, 1.
    assert s.lookup(np.asarray([3, 0, 2, 1], dtype=np.int64)).tolist() == [1, 2, 3, 4]
    assert s.time == 4  # the repeat took one slot of time, not two


def test_capacity_is_enforced() -> None:
    s = StackDistances(3, 2)
    s.touch(np.asarray([0, 1], dtype=np.int64))
    with pytest.raises(ValueError, match="capacity"):
        s.touch(np.asarray([2], dtype=np.int64))
