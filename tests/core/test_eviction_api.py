"""The eviction features through the public API: policies, pins, retention on a simulated
clock, tenant quotas and per-tenant statistics, and their bad input (docs/eviction.md).

The exact orders are checked differentially against the reference in
`test_eviction_model.py` and `test_eviction_features_model.py`; here each feature's contract
is worked by hand on small pools.
"""

from __future__ import annotations

import pytest

from pagedkv import BlockManager, KVCacheGroup
from pagedkv.config import EVICTIONS, BlockManagerConfig
from pagedkv.errors import InvalidArgumentError, UnknownSequenceError
from pagedkv.events import BlockRemoved

B = 4


def prompt(k: int, blocks: int = 2) -> list[int]:
    """`blocks` full blocks of content `k`, plus one token (so every full block can hit)."""
    return [*range(1000 * k, 1000 * k + blocks * B), 7]


def cache(m: BlockManager, sid: int, k: int, blocks: int = 2, **kw: object) -> None:
    assert m.allocate(sid, prompt(k, blocks), **kw) is not None  # type: ignore[arg-type]
    m.free(sid)


@pytest.mark.parametrize("eviction", EVICTIONS)
def test_every_policy_is_a_constructor_option(eviction: str) -> None:
    m = BlockManager(16, B, eviction=eviction)
    assert m.eviction == eviction
    config = BlockManagerConfig(num_blocks=4, eviction=eviction)  # type: ignore[arg-type]
    assert BlockManager.from_config(config).eviction == eviction
    cache(m, 1, 1)
    assert m.allocate(2, prompt(1)) == 2 * B
    m.check_invariants()


def test_unknown_policies_are_refused() -> None:
    with pytest.raises(InvalidArgumentError, match="eviction must be one of"):
        BlockManager(4, B, eviction="mru")  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match="eviction must be one of"):
        BlockManagerConfig(num_blocks=4, eviction="mru")  # type: ignore[arg-type]


@pytest.mark.parametrize("eviction", ["s3fifo", "arc", "slru"])
def test_scan_resistant_policies_keep_a_hot_prefix_lru_loses(eviction: str) -> None:
    """A hot prompt asked twice a round between scans of one-off prompts: LRU flushes it
    each round; S3-FIFO, ARC and SLRU keep it from the second round on."""

    def run(policy: str) -> int:
        m = BlockManager(12, B, eviction=policy)
        sid, hits = 0, 0
        for rnd in range(6):
            for _ in range(2):
                sid += 1
                hits += m.allocate(sid, prompt(0)) or 0
                m.free(sid)
            for k in range(8):
                sid += 1
                cache(m, sid, 100 + 10 * rnd + k)
        m.check_invariants()
        return hits

    assert run(eviction) > run("lru")


# ------------------------------------------------------------------------------------ pins


@pytest.mark.parametrize("eviction", EVICTIONS)
def test_a_pinned_prefix_is_never_evicted_and_admission_leaves_it(eviction: str) -> None:
    m = BlockManager(6, B, eviction=eviction, enable_kv_events=True)
    assert m.allocate(1, prompt(1)) == 0
    assert m.pin(1) == 3
    m.free(1)
    assert m.num_pinned_cached() == 2
    # Four blocks can be had; five cannot (the pinned two are not available).
    assert m.allocate(2, prompt(2, blocks=4)[: 4 * B + 1]) is None
    assert m.allocate(2, prompt(2, blocks=3)) is not None
    m.free(2)
    for sid in range(3, 12):
        cache(m, sid, sid)
    removed = [e for e in m.drain_events() if isinstance(e, BlockRemoved)]
    assert removed, "the churn evicted the other blocks"
    # Still whole, and hit without needing a unit: three blocks fit beside it.
    assert m.lookup(prompt(1)) == 2 * B
    assert m.allocate(20, prompt(1)) == 2 * B
    assert m.unpin(20) == 3
    m.free(20)
    assert m.num_pinned_cached() == 0
    m.check_invariants()


def test_pins_need_a_live_resident_sequence() -> None:
    m = BlockManager(8, B, num_cpu_blocks=8)
    with pytest.raises(UnknownSequenceError):
        m.pin(1)
    with pytest.raises(UnknownSequenceError):
        m.unpin(1)
    m.allocate(1, prompt(1))
    assert m.swap_out(1) is not None
    with pytest.raises(Exception, match="swapped"):
        m.pin(1)
    m.check_invariants()


def test_reset_and_evict_blocks_drop_pins() -> None:
    m = BlockManager(6, B)
    m.allocate(1, prompt(1))
    table = m.block_table(1)
    m.pin(1)
    m.free(1)
    assert m.evict_blocks(table[:1]) == 1
    assert m.num_pinned_cached() == 1
    assert m.reset_prefix_cache()
    assert m.num_pinned_cached() == 0 and m.stats().free_blocks == 6
    m.check_invariants()


# ------------------------------------------------------------------------------- retention


def test_retention_expires_exactly_on_the_simulated_clock() -> None:
    """Prompt 1 cached at t=0 with priority 80 for `duration` s; prompt 2 (default) cached at
    t=12, when one block must go. At its deadline (inclusive) prompt 1 is a default block
    released at the deadline, so ahead of prompt 2 released at that same instant; one tick
    before, it is still protected and prompt 2 goes."""

    def victim(duration: float) -> int:
        m = BlockManager(5, B, eviction="priority")
        m.set_time(0.0)
        cache(m, 1, 1, retention=[(0, None, 80, duration)])
        m.set_time(12.0)
        cache(m, 2, 2)
        # One block more than the free one: one cached block must go.
        assert m.allocate(3, [5] * (B + 1)) is not None
        m.check_invariants()
        gone = [k for k in (1, 2) if m.lookup(prompt(k)) < 2 * B]
        assert len(gone) == 1
        return gone[0]

    assert victim(12.0) == 1
    assert victim(11.0) == 1
    assert victim(12.001) == 2
    assert victim(100.0) == 2


def test_higher_priority_goes_after_every_lower_one() -> None:
    m = BlockManager(7, B, eviction="priority")
    m.set_time(0.0)
    cache(m, 1, 1, retention=[(0, None, 90, None)])
    cache(m, 2, 2, retention=[(0, None, 10, None)])
    cache(m, 3, 3)
    # 1 free block + 2 evictions: priority 10 first (newer than nothing else at 10).
    assert m.allocate(4, [5] * (2 * B + 1)) is not None
    assert m.lookup(prompt(2)) == 0
    assert m.lookup(prompt(1)) == 2 * B and m.lookup(prompt(3)) == 2 * B
    m.free(4)
    assert m.allocate(5, [6] * (5 * B + 1)) is not None  # 4 more: default ones, then some
    assert m.lookup(prompt(3)) == 0
    m.check_invariants()


def test_decode_retention_covers_the_blocks_past_the_prompt() -> None:
    def evicted(decode: tuple[int, float | None] | None) -> tuple[int, list[int]]:
        m = BlockManager(8, B, eviction="priority", record_evictions=True)
        m.set_time(0.0)
        assert m.allocate(1, [1] * B, decode_retention=decode) == 0
        assert m.append(1, [2] * B) is not None  # the second block is decode's
        decode_block = m.block_table(1)[1]
        m.free(1)
        cache(m, 2, 2)
        out: list[tuple[int, int, bytes]] = []
        # 4 free blocks + 2 evictions of the 4 cached.
        assert m.allocate(3, [9] * (5 * B + 1), evicted=out) is not None
        return decode_block, [b for b, _, _ in out]

    block, gone = evicted((90, None))
    assert len(gone) == 2 and block not in gone
    block, gone = evicted(None)
    assert block in gone, "without decode retention the oldest release goes"


def test_retention_is_refused_where_it_cannot_act() -> None:
    m = BlockManager(8, B)
    with pytest.raises(InvalidArgumentError, match="eviction='priority'"):
        m.allocate(1, prompt(1), retention=[(0, None, 50, None)])
    p = BlockManager(8, B, eviction="priority")
    bad: list[object] = [
        [(0, 4, 101, None)],
        [(0, 4, 50, -1.0)],
        [(4, 4, 50, None)],
        [(0, 8, 50, None), (4, None, 50, None)],
        [(0, 4, 50)],
        "x",
    ]
    for ranges in bad:
        with pytest.raises((InvalidArgumentError, TypeError)):
            p.allocate(1, prompt(1), retention=ranges)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError):
        p.allocate(1, prompt(1), decode_retention=(50, float("nan")))
    # With `groups=`, even one full-attention group (which runs the plain paths): refused,
    # one rule for every `groups=`, and nothing allocated.
    g = BlockManager(8, B, eviction="priority", groups=[KVCacheGroup("full")])
    with pytest.raises(InvalidArgumentError, match="groups="):
        g.allocate(1, prompt(1), retention=[(0, None, 50, None)])
    assert 1 not in g and g.num_free_blocks == 8
    assert p.stats().num_sequences == 0
    p.set_time(5.0)
    with pytest.raises(InvalidArgumentError, match="not go back"):
        p.set_time(4.0)
    assert p.now() == 5.0


# --------------------------------------------------------------------------------- tenants


def test_a_tenant_over_its_cap_evicts_its_own_blocks_at_once() -> None:
    m = BlockManager(16, B, tenants=True, enable_kv_events=True)
    m.set_tenant_quota(b"a", max_cached=3)
    cache(m, 1, 1, cache_salt=b"b")
    for sid in range(2, 5):
        cache(m, sid, sid, cache_salt=b"a")
    stats = {t.cache_salt: t for t in m.tenant_stats()}
    assert stats[b"a"].cached_blocks == 3 and stats[b"b"].cached_blocks == 2
    assert m.stats().evictions == 3
    assert len([e for e in m.drain_events() if isinstance(e, BlockRemoved)]) == 3
    # The cap lowered: trimmed at once.
    m.set_tenant_quota(b"a", max_cached=1)
    assert {t.cache_salt: t.cached_blocks for t in m.tenant_stats()}[b"a"] == 1
    m.check_invariants()


def test_a_reserve_is_taken_last() -> None:
    m = BlockManager(8, B, tenants=True)
    m.set_tenant_quota(b"a", reserved=2)
    cache(m, 1, 1, cache_salt=b"a")  # oldest: LRU alone would evict it first
    cache(m, 2, 2, cache_salt=b"b")
    cache(m, 3, 3, cache_salt=b"b")
    assert m.allocate(4, [9] * (4 * B + 1)) is not None  # 2 free + 3 evictions
    stats = {t.cache_salt: t for t in m.tenant_stats()}
    assert stats[b"a"].cached_blocks == 2 and stats[b"b"].cached_blocks == 1
    assert stats[None].held_blocks == 5 and stats[None].prefix_queries == 4 * B + 1


def test_tenant_stats_count_hits_per_salt() -> None:
    m = BlockManager(16, B, tenants=True)
    cache(m, 1, 1, cache_salt="x")
    assert m.allocate(2, prompt(1), cache_salt="x") == 2 * B
    assert m.allocate(3, prompt(1)) == 0  # another tenant: no hit
    stats = {t.cache_salt: t for t in m.tenant_stats()}
    assert stats[b"x"].prefix_hits == 2 * B and stats[b"x"].held_blocks == 3
    assert stats[b"x"].hit_rate == pytest.approx(2 * B / (2 * len(prompt(1))))
    assert stats[None].prefix_hits == 0


def test_tenants_with_nothing_left_leave_the_registry() -> None:
    """Issue 32, item 10: every salt ever seen stayed (about 175 bytes each, and
    `tenant_stats()` listed them all). A tenant leaves once it has no live sequence, no
    CACHED block and no quota; used again, it starts afresh (counts and place)."""
    m = BlockManager(32, B, tenants=True)
    for sid in range(2000):
        cache(m, sid, sid, cache_salt=f"salt-{sid}")  # 2 CACHED blocks each
    salts = [t.cache_salt for t in m.tenant_stats()]
    # 32 blocks hold the CACHED blocks of the last 16 salts; the others were evicted.
    assert salts == [None] + [f"salt-{sid}".encode() for sid in range(1984, 2000)]
    assert m.allocate(9000, prompt(5000), cache_salt="salt-0") == 0  # back: no hit, afresh
    assert [t.cache_salt for t in m.tenant_stats()][-1] == b"salt-0"
    assert m.tenant_stats()[-1].prefix_queries == len(prompt(5000))
    # A quota keeps a tenant with nothing else; removing it lets the tenant go.
    m.set_tenant_quota(b"q", max_cached=4)
    assert m.tenant_stats()[-1].cache_salt == b"q"
    m.set_tenant_quota(b"q")
    assert b"q" not in [t.cache_salt for t in m.tenant_stats()]
    # A refused call leaves no entry either.
    with pytest.raises(InvalidArgumentError):
        m.set_tenant_quota(b"r", max_cached=1, reserved=2)
    m.free(9000)
    assert m.reset_prefix_cache()
    assert [t.cache_salt for t in m.tenant_stats()] == [None]
    m.check_invariants()


def test_tenant_calls_need_tenants_and_sane_quotas() -> None:
    m = BlockManager(8, B)
    with pytest.raises(InvalidArgumentError, match="tenants=True"):
        m.tenant_stats()
    with pytest.raises(InvalidArgumentError, match="tenants=True"):
        m.set_tenant_quota(b"a", max_cached=1)
    t = BlockManager(8, B, tenants=True)
    with pytest.raises(InvalidArgumentError, match="above max_cached"):
        t.set_tenant_quota(b"a", max_cached=1, reserved=2)
    with pytest.raises(InvalidArgumentError):
        t.set_tenant_quota(b"a", max_cached=-1)
    assert [s.cache_salt for s in t.tenant_stats()] == [None]
