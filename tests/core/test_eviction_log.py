"""`record_evictions=True`: the log of evicted cached blocks that tiers copy out
(docs/tiers.md), for both implementations, with and without KV-cache groups."""

from __future__ import annotations

import functools
import random
from typing import Any

import pytest

from pagedkv import BlockManager, BlockRemoved, KVCacheGroup
from pagedkv_reference import ReferenceBlockManager

GROUPS = [KVCacheGroup("full"), KVCacheGroup("sliding_window", window=8)]
IMPLS = {
    "rust": BlockManager,
    "reference": ReferenceBlockManager,
    "rust-groups": functools.partial(BlockManager, groups=GROUPS),
    "reference-groups": functools.partial(ReferenceBlockManager, groups=GROUPS),
}


@pytest.mark.parametrize("impl", list(IMPLS))
def test_each_eviction_is_logged_with_its_block_and_digest(impl: str) -> None:
    # Exactly room for the second prompt once every cached block is evicted.
    grouped = impl.endswith("groups")
    num_blocks, second = (15, 28) if grouped else (8, 32)
    m = IMPLS[impl](num_blocks, 4, record_evictions=True, enable_kv_events=True)
    m.allocate(0, list(range(9)))  # full blocks cached at free
    cached = {g: m.block_table(0, group=g)[:2] for g in range(len(m.stats().groups) or 1)}
    digests = m.block_hashes(0)
    m.free(0)
    assert m.drain_evictions() == []
    m.drain_events()
    taken = m.allocate(1, list(range(100, 100 + second)))  # evicts every cached block
    assert taken == 0
    log = m.drain_evictions()
    removed = [e for e in m.drain_events() if isinstance(e, BlockRemoved)]
    assert [(g, d) for _, g, d in log] == [(e.group_idx, e.block_hashes[0]) for e in removed]
    assert {(g, b) for b, g, _ in log} == {(g, b) for g, t in cached.items() for b in t}
    assert all(d in digests for _, _, d in log)
    held = {b for g in cached for b in m.block_table(1, group=g)}
    assert {b for b, _, _ in log} <= held, "each evicted block has its new owner already"
    assert m.drain_evictions() == [], "draining empties the log"


@pytest.mark.parametrize("impl", list(IMPLS))
def test_no_log_unless_asked(impl: str) -> None:
    grouped = impl.endswith("groups")
    num_blocks, second = (15, 28) if grouped else (8, 32)
    m = IMPLS[impl](num_blocks, 4)
    m.allocate(0, list(range(9)))
    m.free(0)
    assert m.allocate(1, list(range(100, 100 + second))) == 0
    assert m.stats().evictions > 0 and m.drain_evictions() == []


@pytest.mark.parametrize("groups", [False, True])
def test_rust_and_reference_log_the_same_evictions(groups: bool) -> None:
    rng = random.Random(7)
    kw: dict[str, Any] = {"record_evictions": True}
    if groups:
        kw["groups"] = GROUPS
    rust, ref = BlockManager(24, 4, **kw), ReferenceBlockManager(24, 4, **kw)
    live: list[int] = []
    for i in range(400):
        prompt = [rng.randrange(3) for _ in range(rng.randint(1, 20))]
        got = rust.allocate(i, prompt)
        assert got == ref.allocate(i, prompt)
        if got is not None:
            live.append(i)
        while len(live) > 2:
            sid = live.pop(0)
            rust.free(sid)
            ref.free(sid)
        assert rust.drain_evictions() == ref.drain_evictions()
    assert rust.stats().evictions > 50
