"""Benchmarks of KV-cache groups: the same decode step and prefix-hit allocation without
groups, with two groups (full + sliding window) and with a Gemma-like seven, side by side in
one run (pytest-benchmark groups them; the reference model does the same work beside each).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from pagedkv import KVCacheGroup

B = 16
FULL = KVCacheGroup("full")
SW = KVCacheGroup("sliding_window", window=128)
LAYOUTS: dict[str, list[KVCacheGroup] | None] = {
    "no groups": None,
    "full+window": [FULL, SW],
    "6 windows+full": [SW] * 6 + [FULL],
}


def _kw(layout: str) -> dict[str, Any]:
    groups = LAYOUTS[layout]
    return {} if groups is None else {"groups": groups}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_grouped_decode_step_256(
    benchmark: Any, impl: str, layout: str, new_manager: Any, record: Any
) -> None:
    """One append_batch of one token for each of 256 sequences of 100..355 tokens (the
    windows release a block every 16 steps per sequence)."""
    group = f"groups decode-step 256 seqs: {layout}"
    benchmark.group = group
    n = 256
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, 2**31, size=100 + i).tolist() for i in range(n)]
    m = new_manager(impl, 50_000, B, **_kw(layout))
    ids = np.arange(n, dtype=np.int64)
    toks = np.full(n, 7, dtype=np.int64)
    state = {"rounds": 64}

    def setup() -> None:
        if state["rounds"] == 64:
            if len(m):
                m.free_batch(ids)
            for i in range(n):
                m.allocate(i, prompts[i])
            state["rounds"] = 0
        state["rounds"] += 1

    def run() -> None:
        m.append_batch(ids, toks)

    rounds = 1000 if impl == "rust" else 30
    benchmark.pedantic(run, setup=setup, rounds=rounds, warmup_rounds=2)
    assert m.append_batch(ids, toks) is not None
    record(benchmark, group, impl)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_grouped_allocate_hit(
    benchmark: Any, impl: str, layout: str, new_manager: Any, record: Any
) -> None:
    """32 allocations of a 1,041-token prompt whose first 65 blocks are cached."""
    group = f"groups allocate-hit 32 x 1041 tokens: {layout}"
    benchmark.group = group
    rng = np.random.default_rng(1)
    shared = rng.integers(0, 2**31, size=64 * B).tolist()
    prompts = [shared + rng.integers(0, 2**31, size=B + 1).tolist() for _ in range(32)]
    m = new_manager(impl, 20_000, B, **_kw(layout))
    ids = list(range(32))
    for i in ids:
        m.allocate(i, prompts[i])
    m.free_batch(ids)

    def setup() -> None:
        if len(m):
            m.free_batch(ids)

    def run() -> None:
        for i in ids:
            m.allocate(i, prompts[i])

    rounds = 200 if impl == "rust" else 5
    benchmark.pedantic(run, setup=setup, rounds=rounds, warmup_rounds=1)
    assert m.allocate(99, prompts[0]) == 65 * B
    record(benchmark, group, impl)
