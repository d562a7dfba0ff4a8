"""Engine-fit semantics (issue 9, docs/semantics.md): registration follows scheduling.

Chunked prefill (`allocate(num_new_tokens=...)`, `extend`), speculative-decoding lookahead
and `truncate`, `free(num_computed_tokens=...)` retraction, `lookup`, hit-aware
`can_allocate`, the CPU medium of the events and the new counters. Every test runs against
both implementations; the expectations follow the spec (and vLLM's prefix-caching tests
where the two meet: only full computed blocks are cached, a block is hit-able from the step
that schedules it, a request's salt keeps it apart).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

import pagedkv
from audited import audited
from pagedkv.alloc_status import AllocStatus
from pagedkv.errors import InvalidArgumentError
from pagedkv.events import AllBlocksCleared, BlockRemoved, BlockStored
from pagedkv_reference import ReferenceBlockManager

Manager = Any  # ReferenceBlockManager or pagedkv.BlockManager
B = 4


@pytest.fixture(params=["reference", "rust"])
def make(request: pytest.FixtureRequest) -> Iterator[Callable[..., Manager]]:
    """Build managers (block_size 4, events on unless told); audit each at the end."""
    impl = pagedkv.BlockManager if request.param == "rust" else ReferenceBlockManager
    yield from audited(impl, num_blocks=32, block_size=B, enable_kv_events=True, watermark=0.0)


def toks(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


def stored(ev: list[Any], medium: str = "GPU") -> list[bytes]:
    return [e.block_hashes[0] for e in ev if isinstance(e, BlockStored) and e.medium == medium]


def removed(ev: list[Any], medium: str = "GPU") -> list[bytes]:
    return [e.block_hashes[0] for e in ev if isinstance(e, BlockRemoved) and e.medium == medium]


def view(m: Manager, sid: int) -> tuple[Any, ...]:
    """What a sequence looks like from outside, block ids aside."""
    return (
        m.num_tokens(sid),
        m.num_scheduled_tokens(sid),
        m.block_hashes(sid),
        len(m.block_table(sid)),
    )


# ------------------------------------------------------------------ chunked prefill


def test_chunked_prefill_registers_only_scheduled_full_blocks(make):
    m = make()
    p = toks(0, 14)
    assert m.allocate(0, p, num_new_tokens=6) == 0
    d = m.block_hashes(0)
    assert len(d) == 3, "digests of every full prompt block are known from the start"
    assert (m.num_tokens(0), m.num_scheduled_tokens(0), len(m.block_table(0))) == (14, 6, 2)
    assert stored(m.drain_events()) == d[:1]
    assert m.stats().registered_blocks == 1
    assert m.stats().used_slots == 6
    assert m.lookup(p) == 4, "only the scheduled full block is findable"

    assert m.extend(0, 5) == []  # s = 11: block 1 becomes full, block 2 is partial
    assert (m.num_scheduled_tokens(0), len(m.block_table(0))) == (11, 3)
    assert stored(m.drain_events()) == d[1:2]
    assert m.lookup(p) == 8
    assert m.extend(0, 3) == []  # s = 14: block 2 full, block 3 holds 2 tokens
    assert stored(m.drain_events()) == d[2:]
    assert m.stats().registered_blocks == 3
    assert m.lookup([*p, 99]) == 12
    # Nothing is left to schedule.
    with pytest.raises(InvalidArgumentError):
        m.extend(0, 1)


def test_a_second_prompt_does_not_hit_unscheduled_blocks(make):
    m = make()
    p = toks(0, 16)
    assert m.allocate(0, p, num_new_tokens=4) == 0
    assert m.allocate(1, [*p, 7]) == 4, "blocks 1..3 of sequence 0 are not scheduled yet"
    # Sequence 1 scheduled its whole prompt: its own blocks 1..3 are the registered ones.
    assert m.extend(0, 12) == []
    assert m.block_table(0)[0] == m.block_table(1)[0]
    assert m.block_table(0)[1:] != m.block_table(1)[1:4]
    assert m.allocate(2, [*p, 8]) == 16
    assert m.block_table(2)[:4] == m.block_table(1)[:4]


def test_allocate_schedules_the_hit_plus_num_new_tokens(make):
    m = make()
    p = toks(0, 20)
    m.allocate(0, p)
    assert m.allocate(1, [*p[:10], 90, 91, 92], num_new_tokens=3) == 8
    # The hit (8) plus 3 new tokens are scheduled: 11, in ceil(11 / 4) = 3 blocks.
    assert (m.num_scheduled_tokens(1), len(m.block_table(1))) == (11, 3)
    assert m.stats().prefix_queries == 20 + 13 and m.stats().prefix_hits == 8
    # More new tokens than the prompt has left: the whole prompt.
    assert m.allocate(2, [*p[:10], 93], num_new_tokens=10) == 8
    assert m.num_scheduled_tokens(2) == 11
    # A whole-prompt hit still leaves one token to compute.
    assert m.allocate(3, p[:8], num_new_tokens=1) == 4
    assert m.num_scheduled_tokens(3) == 5


def test_lookahead_blocks_cover_unscheduled_prompt_positions(make):
    m = make(8)
    assert m.allocate(0, toks(0, 10), num_new_tokens=2, lookahead=3) == 0
    assert len(m.block_table(0)) == 2  # ceil((2 + 3) / 4)
    assert m.slot_mapping([0], 2, lookahead=3).tolist() == [
        m.block_table(0)[p // B] * B + p % B for p in range(5)
    ]
    free = m.num_free_blocks
    assert m.extend(0, 3) == []  # positions 2..4 are in the table already
    assert m.num_free_blocks == free
    t = m.block_table(0)
    assert m.slot_mapping([0], 3).tolist() == [t[0] * B + 2, t[0] * B + 3, t[1] * B]


def test_extend_copies_a_block_a_fork_shares(make):
    m = make()
    m.allocate(0, toks(0, 10), num_new_tokens=6)
    m.fork(0, 1)
    t0 = m.block_table(0)
    pairs = m.extend(1, 4)  # writes positions 6..9: block 1 is shared, block 2 is new
    assert pairs == [(t0[1], m.block_table(1)[1])]
    assert m.block_table(0) == t0
    assert m.stats().cow_copies == 1
    assert (m.num_scheduled_tokens(0), m.num_scheduled_tokens(1)) == (6, 10)


def test_extend_out_of_blocks_returns_none_and_changes_nothing(make):
    m = make(3)
    m.allocate(0, toks(0, 16), num_new_tokens=4)
    m.allocate(1, toks(100, 8))
    m.drain_events()
    before = (view(m, 0), m.block_table(0), m.stats())
    assert m.extend(0, 12) is None  # 3 more blocks, 0 available
    assert (view(m, 0), m.block_table(0), m.stats()) == before
    assert m.drain_events() == []


def test_flashinfer_and_slot_mapping_cover_scheduled_tokens_only(make):
    m = make()
    m.allocate(0, toks(0, 13), num_new_tokens=5)
    indptr, indices, last = m.flashinfer_page_table([0])
    assert (indptr.tolist(), indices.tolist(), last.tolist()) == ([0, 2], m.block_table(0), [1])
    t = m.block_table(0)
    assert m.slot_mapping([0], 2).tolist() == [t[0] * B + 3, t[1] * B]
    with pytest.raises(InvalidArgumentError):
        m.slot_mapping([0], 6)  # only 5 are scheduled
    with pytest.raises(InvalidArgumentError):
        m.slot_mapping([0], 1, lookahead=4)  # 5 + 4 > 2 blocks


def test_append_needs_the_whole_prompt_scheduled(make):
    m = make()
    m.allocate(0, toks(0, 9), num_new_tokens=4)
    with pytest.raises(InvalidArgumentError):
        m.append(0, [1])
    with pytest.raises(InvalidArgumentError):
        m.append_batch([0], [1])
    m.extend(0, 5)
    assert m.append(0, [1]) == []
    assert (m.num_tokens(0), m.num_scheduled_tokens(0)) == (10, 10)


# ------------------------------------------------------------------ decode, drafts, truncate


def test_a_block_filled_by_decode_is_registered_with_its_parent(make):
    m = make()
    m.allocate(0, toks(0, 6))
    d0 = m.block_hashes(0)[0]
    m.drain_events()
    m.append(0, [6])
    assert m.drain_events() == []
    m.append(0, [7, 8])  # block 1 fills (tokens 4..7), block 2 starts
    d1 = m.block_hashes(0)[1]
    assert m.drain_events() == [BlockStored([d1], d0, toks(4, 4), B, None, "GPU")]
    assert m.lookup(toks(0, 9)) == 8


def test_drafts_in_lookahead_slots_are_never_registered(make):
    m = make()
    m.allocate(0, toks(0, 4), lookahead=6)  # block 0 full; 6 draft slots: 2 more blocks
    assert len(m.block_table(0)) == 3
    m.drain_events()
    slots = m.slot_mapping([0], 1, lookahead=6).tolist()
    t = m.block_table(0)
    assert slots == [t[0] * B + 3, *(t[1 + p // B] * B + p % B for p in range(6))]
    assert m.stats().registered_blocks == 1
    # Two drafts accepted: appended; the rejected ones' blocks go with truncate.
    assert m.append(0, [4, 5], lookahead=0) == []
    assert m.drain_events() == []
    assert len(m.block_table(0)) == 3, "a smaller lookahead does not give blocks back"
    assert m.truncate(0, 6) == []
    assert len(m.block_table(0)) == 2
    assert m.stats().truncated_blocks == 1


def test_truncate_leaves_the_sequence_as_if_never_appended(make):
    m = make()
    p = toks(0, 10)
    m.allocate(0, p)
    m.allocate(1, p)  # the twin that never gets the drafts
    m.append(0, [50, 51, 52, 53, 54, 55, 56], lookahead=3)  # 17 tokens + 3 slots: 5 blocks
    assert m.lookup([*p, 50, 51, 52, 53, 54, 55, 56, 1]) == 16
    m.drain_events()
    assert m.truncate(0, 10) == []
    assert view(m, 0) == view(m, 1)
    assert m.stats().truncated_blocks == 2  # blocks 3 and 4 (a draft block)
    # Block 2 (tokens 8..11) was full and registered by 0 alone: it leaves the index.
    ev = m.drain_events()
    assert len(removed(ev)) == 1 and stored(ev) == []
    assert m.lookup([*p, 50, 51, 1]) == 8
    # Block 3 (tokens 12..15) stays cached: its KV was computed.
    assert m.num_cached_blocks == 1
    # Same next token, same digests: the kept tokens are exactly the prompt.
    m.append(0, [50, 51])
    m.append(1, [50, 51])
    assert view(m, 0) == view(m, 1)
    assert m.block_hashes(0)[-1] == m.block_hashes(1)[-1]


def test_truncate_copies_a_shared_hashed_block_it_leaves_partial(make):
    m = make()
    m.allocate(0, toks(0, 8))
    m.fork(0, 1)
    d = m.block_hashes(0)
    src = m.block_table(0)[1]
    m.drain_events()
    pairs = m.truncate(0, 6)  # block 1 would be written next, but sequence 1 holds it hashed
    assert pairs == [(src, m.block_table(0)[1])] and m.block_table(0)[1] != src
    assert m.block_table(1)[1] == src and m.block_hashes(1) == d
    assert m.stats().cow_copies == 1 and m.stats().truncated_blocks == 0
    assert m.drain_events() == []
    assert m.lookup(toks(0, 9)) == 8, "the fork's block still serves its content"
    assert m.append(0, [60]) == [], "the copy is the sequence's own"
    m.allocate(2, toks(0, 6))
    m.truncate(0, 6)
    assert view(m, 0) == view(m, 2)


def test_truncate_needing_a_copy_with_no_block_available_changes_nothing(make):
    m = make(3)
    m.allocate(0, toks(0, 8), lookahead=1)  # 3 blocks: the third only for the draft slot
    m.fork(0, 1)
    m.drain_events()
    before = (view(m, 0), m.block_table(0), m.stats())
    # Nothing is available before the releases: refused, even though the draft block would
    # come back.
    assert m.truncate(0, 6) is None
    assert (view(m, 0), m.block_table(0), m.stats()) == before
    assert m.drain_events() == []
    assert m.truncate(0, 4) == [], "a cut at a block boundary needs no copy"
    assert len(m.block_table(0)) == 1 and m.stats().truncated_blocks == 2


def test_truncate_of_an_unshared_full_block_then_append_writes_in_place(make):
    m = make()
    m.allocate(0, toks(0, 8))
    d = m.block_hashes(0)
    t = m.block_table(0)
    m.drain_events()
    assert m.truncate(0, 7) == []  # block 1 is partial again, held by 0 alone: withdrawn
    assert m.drain_events() == [BlockRemoved([d[1]], "GPU")]
    assert m.stats().truncated_blocks == 0
    assert m.block_table(0) == t
    assert m.append(0, [99]) == [], "the un-indexed block is written in place"
    assert m.block_table(0) == t


# ------------------------------------------------------------------ free(num_computed_tokens)


def test_free_with_num_computed_tokens_withdraws_the_blocks_never_computed(make):
    m = make(8)
    p = toks(0, 12)
    m.allocate(0, p)
    d = m.block_hashes(0)
    m.drain_events()
    m.free(0, num_computed_tokens=5)  # blocks 1 and 2 were never computed
    ev = m.drain_events()
    assert ev == [BlockRemoved([d[2]], "GPU"), BlockRemoved([d[1]], "GPU")]  # tail first
    assert m.stats().unregistered_blocks == 2
    assert (m.num_cached_blocks, m.num_free_blocks) == (1, 7)
    assert m.lookup([*p, 1]) == 4


def test_free_with_num_computed_tokens_withdraws_blocks_others_hold_too(make):
    m = make()
    p = toks(0, 12)
    m.allocate(0, p)
    m.allocate(1, [*p[:9], 70])  # hits blocks 0 and 1 in the same step: read nothing valid
    m.fork(0, 2)
    d = m.block_hashes(0)
    m.drain_events()
    m.free(0, num_computed_tokens=0)
    assert m.drain_events() == [BlockRemoved([x], "GPU") for x in reversed(d)]
    assert m.stats().unregistered_blocks == 3
    assert m.lookup([*p, 1]) == 0
    # The other holders keep the blocks, unhashed: FREE after the last release.
    assert m.block_table(2) == m.block_table(1)[:2] + m.block_table(2)[2:]
    m.free(2, num_computed_tokens=0)
    m.free(1, num_computed_tokens=0)
    assert m.drain_events() == [] and m.stats().unregistered_blocks == 3
    assert m.num_cached_blocks == 0


def test_free_with_num_computed_tokens_keeps_its_own_hits(make):
    m = make()
    p = toks(0, 12)
    m.allocate(0, p)
    m.free(0)
    assert m.allocate(1, [*p[:9], 70]) == 8
    m.drain_events()
    m.free(1, num_computed_tokens=0)  # its hits came from the cache: their KV exists
    assert m.drain_events() == [] and m.stats().unregistered_blocks == 0
    assert m.lookup([*p, 1]) == 12


def test_free_defaults_to_every_scheduled_token(make):
    m = make()
    p = toks(0, 12)
    m.allocate(0, p, num_new_tokens=9)
    m.free(0)
    assert m.stats().unregistered_blocks == 0
    assert m.num_cached_blocks == 2
    m.allocate(1, p)
    m.free(1, num_computed_tokens=12)
    assert m.stats().unregistered_blocks == 0


def test_free_of_a_swapped_sequence_retracts_nothing_and_drops_the_cpu_copies(make):
    m = make(num_cpu_blocks=4)
    m.allocate(0, toks(0, 9))
    d = m.block_hashes(0)
    m.swap_out(0)
    m.drain_events()
    m.free(0, num_computed_tokens=0)
    assert m.drain_events() == [BlockRemoved([d[0]], "CPU"), BlockRemoved([d[1]], "CPU")]
    assert m.stats().unregistered_blocks == 0
    assert m.num_free_cpu_blocks == 4


# ------------------------------------------------------------------ swap events


def test_swap_out_stores_the_scheduled_full_blocks_on_the_cpu(make):
    m = make(num_cpu_blocks=8)
    m.allocate(0, toks(0, 13), num_new_tokens=9, lora_id=3)
    d = m.block_hashes(0)
    m.drain_events()
    assert m.swap_out(0) is not None
    assert m.drain_events() == [
        BlockStored([d[0]], None, toks(0, 4), B, 3, "CPU"),
        BlockStored([d[1]], d[0], toks(4, 4), B, 3, "CPU"),
    ]
    assert m.swap_in(0) is not None
    ev = m.drain_events()
    assert removed(ev, "CPU") == d[:2]
    assert stored(ev, "GPU") == [], "the cached GPU copies still hold the digests"
    assert m.num_scheduled_tokens(0) == 9
    assert m.extend(0, 4) == []
    assert stored(m.drain_events()) == d[2:]


# ------------------------------------------------------------------ lookup, can_allocate


def test_lookup_touches_no_lru_order_stats_or_events(make):
    m = make(4)
    a, b = toks(0, 5), toks(100, 5)
    m.allocate(0, a)
    m.allocate(1, b)
    da, db = m.block_hashes(0), m.block_hashes(1)
    m.free(0)
    m.free(1)  # cached, oldest first: a's block, then b's
    m.drain_events()
    before = m.stats()
    # Looking `a` up must not refresh it (a hit would make it the newest).
    assert m.lookup(a) == 4
    assert m.lookup_many([a, toks(200, 5)]) == [4, 0]
    assert m.can_allocate(a) == AllocStatus.OK
    assert m.stats() == before and m.drain_events() == []
    # Four new blocks: the two free ones, then evictions oldest first: a's block first.
    m.allocate(2, toks(300, 13))
    assert removed(m.drain_events()) == [da[0], db[0]]


def test_lookup_keeps_salts_and_loras_apart_and_is_zero_without_caching(make):
    m = make()
    p = toks(0, 9)
    m.allocate(0, p, cache_salt="u1", lora_id=2)
    assert m.lookup(p, cache_salt="u1", lora_id=2) == 8
    assert m.lookup(p, cache_salt="u2", lora_id=2) == 0
    assert m.lookup(p, cache_salt="u1") == 0
    assert m.lookup_many([p, p[:5]], cache_salt="u1", lora_id=2) == [8, 4]
    assert m.lookup_many((q for q in [p[:5], p]), cache_salt="u1", lora_id=2) == [4, 8]
    assert m.lookup_many([]) == []
    assert m.lookup(p[:8], cache_salt="u1", lora_id=2) == 4, "one token left to compute"
    off = make(enable_prefix_caching=False)
    off.allocate(0, p)
    assert off.lookup(p) == 0
    assert off.stats().registered_blocks == 0 and off.stats().recent_prefix_queries == 0


def test_hit_aware_can_allocate_is_ok_where_the_count_alone_says_later(make):
    m = make(8)
    p = toks(0, 20)
    m.allocate(0, p)  # 5 blocks held: 3 available
    q = [*p, 99]
    assert m.can_allocate(len(q)) == AllocStatus.LATER  # 6 blocks
    assert m.can_allocate(q) == AllocStatus.OK  # 5 hit (owned) + 1 new
    assert m.can_allocate(q, cache_salt="x") == AllocStatus.LATER
    assert m.can_allocate(len(q), num_new_tokens=12) == AllocStatus.OK  # 3 blocks
    assert m.can_allocate(toks(50, 21), num_new_tokens=12) == AllocStatus.OK
    assert m.can_allocate(toks(50, 21), num_new_tokens=13) == AllocStatus.LATER
    assert m.allocate(1, q) == 20
    # Cached hits are taken from the available blocks: counted in `need`.
    m.free(1)
    m.free(0)
    assert m.can_allocate(q) == AllocStatus.OK  # 5 cached hits + 1 new of 8 available
    assert m.can_allocate(toks(0, 33)) == AllocStatus.NEVER  # 9 blocks
    with pytest.raises(InvalidArgumentError):
        m.can_allocate(q, num_new_tokens=22)
    with pytest.raises(InvalidArgumentError):
        m.can_allocate(5, num_new_tokens=6)


def test_hit_aware_can_allocate_applies_the_watermark_to_the_need(make):
    m = make(10, watermark=0.2)  # 2 blocks kept back
    p = toks(0, 24)
    m.allocate(0, p)  # 6 held, 4 available
    assert m.can_allocate([*p[:20], 1]) == AllocStatus.OK  # need 1: 4 - 1 >= 2
    assert m.can_allocate(toks(50, 9)) == AllocStatus.LATER  # need 3: 4 - 3 < 2
    assert m.can_allocate(toks(50, 33)) == AllocStatus.NEVER  # 9 > 10 - 2


# ------------------------------------------------------------------ counters


def test_recent_window_counts_the_last_thousand_allocations(make):
    m = make(4)
    p = toks(0, 5)
    for _ in range(1001):
        assert m.allocate(0, p) is not None
        m.free(0)
    s = m.stats()
    assert (s.prefix_queries, s.prefix_hits) == (5005, 4000)
    assert (s.recent_prefix_queries, s.recent_prefix_hits) == (5000, 4000)
    assert s.recent_hit_rate == 0.8
    assert s.as_dict()["recent_hit_rate"] == 0.8
    m.allocate(1, toks(10, 17))  # 5 blocks of 4: refused, not counted
    assert m.stats().recent_prefix_queries == 5000
    assert m.reset_prefix_cache()
    assert m.drain_events()[-1] == AllBlocksCleared()
    s = m.stats()
    assert (s.recent_prefix_queries, s.recent_prefix_hits, s.recent_hit_rate) == (0, 0, 0.0)
    assert s.registered_blocks == 1, "registrations are not a hit-rate counter"


def test_used_slots_count_scheduled_tokens(make):
    m = make()
    m.allocate(0, toks(0, 10), num_new_tokens=3, lookahead=2)
    m.allocate(1, toks(100, 6))
    s = m.stats()
    assert (s.used_slots, s.reserved_slots) == (3 + 6, (2 + 2) * B)
    assert "registered" in str(s) and "truncated" in str(s)


def test_num_scheduled_tokens_of_a_swapped_sequence(make):
    m = make(num_cpu_blocks=4)
    m.allocate(0, toks(0, 10), num_new_tokens=7)
    m.swap_out(0)
    assert m.num_scheduled_tokens(0) == 7
    assert m.stats().used_slots == 0
    with pytest.raises(pagedkv.SequenceSwappedError):
        m.extend(0, 1)
    with pytest.raises(pagedkv.SequenceSwappedError):
        m.truncate(0, 5)


def test_slot_mapping_of_arrays_with_lookahead(make):
    m = make()
    m.allocate(0, toks(0, 3), lookahead=2)
    m.allocate(1, toks(10, 4), lookahead=4)
    out = m.slot_mapping(np.array([0, 1]), np.array([1, 2]), lookahead=1)
    t0, t1 = m.block_table(0), m.block_table(1)
    assert out.dtype == np.int64
    assert out.tolist() == [t0[0] * B + 2, t0[0] * B + 3, t1[0] * B + 2, t1[0] * B + 3, t1[1] * B]
