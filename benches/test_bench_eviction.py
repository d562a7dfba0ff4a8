"""The manager's operations under each eviction policy, side by side in one run (issue 25).

Every benchmark runs once per policy of `EVICTIONS` in the same pytest-benchmark group, so
one run gives each policy's cost next to LRU's (the session summary prints the ratios; LRU
keeps the lock-free hot path, the other policies take the policy's lock on every CACHED
transition: docs/eviction.md):

- `revive`: 32 prompts of 16 blocks, every block CACHED, allocated (each block a revival) and
  freed again (each block back to CACHED): the hit path and the release path;
- `evict`: 32 prompts of 16 new blocks on a pool full of CACHED blocks: every block an
  eviction (and, for S3-FIFO and ARC, a ghost), then freed;
- `churn`: one fixed stream of allocate, append_batch and free calls (shared prefixes of Zipf
  popularity, 16 sequences live, more prefixes than the pool caches) replayed on a fresh
  manager: hits, misses, evictions and decode appends in a serving-like mix. The stream is
  the same for every policy (every allocate fits whatever the cache kept), so the policies
  differ only in their own work and in what hit (`extra_info` keeps the hit tokens).

SHA-256 block hashes, as by default: the hashing is the same for every policy, so the
ratios understate the policy's share of a call; the `evict` and `revive` groups show it
plainly enough.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from pagedkv import BlockManager
from pagedkv.config import EVICTIONS, Eviction
from pagedkv.sim.calls import BoundCall, Call, bind_trace, replay_trace

B = 16
PROMPTS = 32
PROMPT_BLOCKS = 16
POLICIES = pytest.mark.parametrize("policy", EVICTIONS)


def _prompts(rng: np.random.Generator) -> list[Any]:
    return [rng.integers(0, 2**31, PROMPT_BLOCKS * B, dtype=np.uint32) for _ in range(PROMPTS)]


@POLICIES
def test_revive(benchmark: Any, policy: Eviction, record: Any) -> None:
    """Allocate 32 x 16 CACHED blocks (revivals) and free them (back to CACHED)."""
    group = f"eviction revive: {PROMPTS} x {PROMPT_BLOCKS} cached blocks allocated and freed"
    benchmark.group = group
    m = BlockManager(1024, B, eviction=policy)
    prompts = _prompts(np.random.default_rng(25))
    ids = list(range(PROMPTS))
    for i in ids:  # warm: every full block of every prompt is now CACHED
        m.allocate(i, prompts[i])
    m.free_batch(ids)
    hit = (PROMPT_BLOCKS - 1) * B  # the last block holds the token left to compute

    def run() -> None:
        for i in ids:
            assert m.allocate(i, prompts[i]) == hit
        m.free_batch(ids)

    benchmark.pedantic(run, rounds=200, warmup_rounds=2)
    assert m.stats().evictions == 0
    record(benchmark, group, policy)


@POLICIES
def test_evict(benchmark: Any, policy: Eviction, record: Any) -> None:
    """Allocate 32 prompts of 16 new blocks on a full cache (each block evicts), free them."""
    group = f"eviction evict: {PROMPTS} x {PROMPT_BLOCKS} new blocks on a full cache"
    benchmark.group = group
    num_blocks = 1024
    m = BlockManager(num_blocks, B, eviction=policy)
    rng = np.random.default_rng(26)
    m.allocate(10**9, np.arange(num_blocks * B, dtype=np.uint32))
    m.free(10**9)
    assert m.num_free_blocks == 0
    ids = list(range(PROMPTS))
    prompts = [_prompts(rng)]
    evictions = [m.stats().evictions]

    def setup() -> None:
        prompts[0] = _prompts(rng)  # new tokens each round: every block a miss
        evictions[0] = m.stats().evictions

    def run() -> None:
        for i in ids:
            m.allocate(i, prompts[0][i])
        m.free_batch(ids)

    benchmark.pedantic(run, setup=setup, rounds=100, warmup_rounds=2)
    assert m.stats().evictions - evictions[0] == PROMPTS * PROMPT_BLOCKS
    record(benchmark, group, policy)


def _churn_calls() -> list[Call]:
    """A serving-like stream of calls that every policy can replay as it is: prompts of one of
    64 shared prefixes (8 blocks, Zipf popularity) plus 2 blocks of their own, 16 sequences
    live at most (176 blocks of the 384: every allocate fits, whatever the cache kept), each
    decoding 1..3 steps before it is freed; the cached prefixes exceed the pool, so it hits,
    misses and evicts."""
    rng = np.random.default_rng(27)
    prefixes = [rng.integers(0, 2**31, 8 * B, dtype=np.uint32) for _ in range(64)]
    weights = 1.0 / np.arange(1, 65)
    weights /= weights.sum()
    calls: list[Call] = []
    live: list[int] = []
    for seq in range(CHURN_SEQUENCES):
        prefix = prefixes[int(rng.choice(64, p=weights))]
        prompt = np.concatenate([prefix, rng.integers(0, 2**31, 2 * B, dtype=np.uint32)])
        calls.append(("allocate", (seq, prompt), {}))
        live.append(seq)
        for _ in range(int(rng.integers(1, 4))):
            ids = np.asarray(live, dtype=np.int64)
            calls.append(("append_batch", (ids, np.full(len(ids), 7, dtype=np.int64)), {}))
        if len(live) == 16:
            calls.append(("free", (live.pop(0),), {}))
    return calls


CHURN_SEQUENCES = 2000
CHURN = _churn_calls()


@pytest.mark.parametrize("tenants", [False, True], ids=["", "tenants"])
@POLICIES
def test_churn(benchmark: Any, policy: Eviction, tenants: bool, record: Any) -> None:
    """The same 2,000-sequence stream of allocate, append_batch and free on a fresh pool;
    `tenants`: the manager groups by salt (the policy per tenant group, in locked mode even
    for LRU; the stream is unsalted, so this is the quota layer's own cost)."""
    group = f"eviction churn: {CHURN_SEQUENCES} sequences of shared prefixes on 384 blocks"
    if tenants:
        group += ", tenants=True"
    benchmark.group = group
    bound: list[BoundCall] = []
    managers: list[BlockManager] = []

    def setup() -> None:
        managers[:] = [BlockManager(384, B, eviction=policy, tenants=tenants)]
        bound[:] = bind_trace(managers[0], CHURN)

    def run() -> None:
        replay_trace(bound)

    benchmark.pedantic(run, setup=setup, rounds=10, warmup_rounds=1)
    st = managers[0].stats()
    assert st.evictions > 0 and st.prefix_hits > 0
    benchmark.extra_info["calls"] = len(CHURN)
    benchmark.extra_info["hit_tokens"] = st.prefix_hits
    record(benchmark, group, policy)
