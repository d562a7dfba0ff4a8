"""KV-cache groups (hybrid models): docs/semantics.md, "KV-cache groups".

Scenario tests written against the public API only, so that every one runs against each
manager in `IMPLS`: the pure-Python reference now, the Rust `pagedkv.BlockManager` as soon as
it accepts `groups=` (issue 10). The expectations follow the spec and, where it follows them,
vLLM's hybrid KV-cache manager tests (sliding-window release, the hybrid prefill hit).
Block 0 is the null block and the free stack pops 1, 2, 3, ..., so block ids are exact.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import pagedkv
from audited import audited
from pagedkv.alloc_status import AllocStatus
from pagedkv.errors import InvalidArgumentError, InvalidArgumentTypeError
from pagedkv.events import BlockRemoved, BlockStored
from pagedkv.groups import KVCacheGroup
from pagedkv_reference import ReferenceBlockManager
from pagedkv_reference.hybrid_hit import first_needed, hybrid_hit

Manager = Any  # ReferenceBlockManager or pagedkv.BlockManager

FULL = KVCacheGroup("full")
STATE = KVCacheGroup("state")


def sw(window: int) -> KVCacheGroup:
    return KVCacheGroup("sliding_window", window=window)


def chunked(chunk: int) -> KVCacheGroup:
    return KVCacheGroup("chunked_local", chunk=chunk)


def _rust_takes_groups() -> bool:
    """The Rust manager joins `IMPLS` once its constructor accepts `groups=`."""
    try:
        pagedkv.BlockManager(4, 16, groups=[pagedkv.KVCacheGroup("full")])
    except TypeError:
        return False
    return True


IMPLS: list[Callable[..., Manager]] = [ReferenceBlockManager]
if _rust_takes_groups():
    IMPLS.append(pagedkv.BlockManager)


@pytest.fixture(params=IMPLS, ids=lambda c: "reference" if c is ReferenceBlockManager else "rust")
def impl(request: pytest.FixtureRequest) -> Callable[..., Manager]:
    """The manager class under test."""
    cls: Callable[..., Manager] = request.param
    return cls


@pytest.fixture
def make(impl: Callable[..., Manager]) -> Iterator[Callable[..., Manager]]:
    """`make(num_blocks, block_size, **kw)`: a manager (events on, watermark 0 unless told),
    audited with `check_invariants` at the end of the test."""
    yield from audited(impl, enable_kv_events=True, watermark=0.0)


def toks(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


def tables(m: Manager, sid: int) -> list[list[int]]:
    """Every group's table of a sequence."""
    return [m.block_table(sid, group=g) for g in range(len(m.stats().groups))]


def stored(ev: list[Any], medium: str = "GPU") -> list[tuple[int, bytes]]:
    return [
        (e.group_idx, e.block_hashes[0])
        for e in ev
        if isinstance(e, BlockStored) and e.medium == medium
    ]


def removed(ev: list[Any], medium: str = "GPU") -> list[tuple[int, bytes]]:
    return [
        (e.group_idx, e.block_hashes[0])
        for e in ev
        if isinstance(e, BlockRemoved) and e.medium == medium
    ]


def snapshot(m: Manager, sids: list[int]) -> tuple[Any, ...]:
    """Everything a call that "changes nothing" must leave as it was."""
    return (
        m.stats(),
        m.num_free_blocks,
        m.num_cached_blocks,
        [tables(m, s) for s in sids if not m.is_swapped(s)],
        [(m.num_tokens(s), m.num_scheduled_tokens(s), m.block_hashes(s)) for s in sids],
    )


# ------------------------------------------------------------------ the pool and the null block


def test_null_block_is_never_handed_out(make):
    m = make(5, 4, groups=[FULL, sw(4)])
    st = m.stats()
    assert (st.free_blocks, st.used_blocks, st.cached_blocks) == (4, 0, 0)
    assert m.num_available_blocks == 4
    assert m.allocate(1, toks(0, 8)) == 0
    assert tables(m, 1) == [[1, 2], [3, 4]], "the free stack pops 1, 2, 3, ..."
    assert m.num_free_blocks == 0
    assert m.allocate(2, toks(100, 1)) is None, "block 0 is not available"
    assert m.can_allocate(1) == AllocStatus.LATER


def test_one_pool_serves_every_group(make):
    """No per-group quota: a group takes whatever the pool has left."""
    m = make(9, 4, groups=[FULL, sw(4)])
    assert m.allocate(1, toks(0, 12)) == 0  # 3 entries per group
    assert m.num_free_blocks == 2
    assert m.allocate(2, toks(100, 4)) == 0  # 1 entry per group: the last two blocks
    assert m.num_free_blocks == 0
    assert [g.used_blocks for g in m.stats().groups] == [4, 4]


# ------------------------------------------------------------------ skipped entries


def test_window_releases_blocks_as_the_sequence_grows(make):
    """vLLM's sliding-window example (window 4, block size 2): with `p` tokens scheduled, a
    step at `p = 4` releases nothing, at `p = 5` block 0, and at `p = 11` blocks 3 then 2
    (tail first, in one release: as for a freed table, the tail is reused first, so the next
    blocks taken are block 3's, then block 2's)."""
    m = make(16, 2, groups=[sw(4)], enable_prefix_caching=False)
    assert m.allocate(1, toks(0, 20), num_new_tokens=4) == 0
    assert m.block_table(1) == [1, 2]
    assert m.extend(1, 1) == []  # p = 4: tokens 1..4 are the window; token 0 still needed
    assert m.block_table(1) == [1, 2, 3]
    assert m.extend(1, 1) == []  # p = 5: tokens 0, 1 left the window: block 0 released
    assert m.block_table(1) == [0, 2, 3]
    assert m.extend(1, 1) == []  # p = 6: nothing more; the new entry reuses block 1 (LIFO)
    assert m.block_table(1) == [0, 2, 3, 1]
    assert m.extend(1, 4) == []  # p = 7: block 1 released; two new entries
    assert m.block_table(1) == [0, 0, 3, 1, 2, 4]
    assert m.extend(1, 1) == []  # p = 11: tokens 0..7 left: blocks 3 then 2 released
    assert m.block_table(1) == [0, 0, 0, 0, 2, 4]
    assert m.extend(1, 4) == []  # the next two entries pop block 3's, then block 2's
    assert m.block_table(1) == [0, 0, 0, 0, 2, 4, 1, 3]


def test_skipped_entries_are_released_group_by_group_tail_first(make):
    m = make(12, 2, groups=[sw(4), sw(4)], enable_prefix_caching=False)
    assert m.allocate(1, toks(0, 20), num_new_tokens=8) == 0
    assert tables(m, 1) == [[1, 2, 3, 4], [5, 6, 7, 8]]
    # p = 8: entries 0, 1 of both groups go, one release per group, each group's tail on
    # top (as a freed table's): the stack ends ... 1, 2, 5, 6; then each group takes 2.
    assert m.extend(1, 4) == []
    assert tables(m, 1) == [[0, 0, 3, 4, 6, 5], [0, 0, 7, 8, 2, 1]]


def test_window_blocks_are_released_before_any_block_is_taken(make):
    """The fit test counts what the call frees: with no block available, a step that
    releases a block out of the window gets it back for its new entry."""
    m = make(3, 16, groups=[sw(16)], enable_prefix_caching=False)
    assert m.allocate(1, toks(0, 32)) == 0
    assert m.block_table(1) == [1, 2]
    assert m.num_available_blocks == 0
    assert m.append(1, [7]) == []  # p = 32: block 0 (tokens 0..15) left the window
    assert m.block_table(1) == [0, 2, 1]


def test_refused_step_releases_nothing(make):
    """Unlike vLLM, a scheduling call that returns None releases no skipped block."""
    m = make(5, 16, groups=[FULL, sw(16)], enable_prefix_caching=False)
    assert m.allocate(1, toks(0, 32)) == 0
    assert tables(m, 1) == [[1, 2], [3, 4]]
    before = snapshot(m, [1])
    assert m.append(1, [7]) is None  # needs 2 new blocks; frees only the window's 1
    assert snapshot(m, [1]) == before


def test_steps_without_release_leave_skipped_entries_to_release_skipped(make):
    """`release=False`: a step writes and registers but keeps the skipped entries, and its
    fit test does not count them; `release_skipped(seq, n)` releases those skipped at
    `min(n, s)` (tail first), never refused, whenever the caller chooses, even before a step
    that then does not fit (vLLM's `remove_skipped_blocks`)."""
    m = make(7, 4, groups=[FULL, sw(4)], enable_prefix_caching=False)
    assert m.allocate(1, toks(0, 8)) == 0
    assert tables(m, 1) == [[1, 2], [3, 4]]
    assert m.append(1, [8], release=False) == []  # p = 8: entry 0 skipped, kept
    assert tables(m, 1) == [[1, 2, 5], [3, 4, 6]]
    assert m.num_available_blocks == 0
    assert m.append(1, [9, 10, 11, 12], release=False) is None  # would need 2 of 0
    assert m.release_skipped(1, 6) == 0  # at p = 6 the window still covers entry 0
    assert m.release_skipped(1, 100) == 1  # at p = min(100, 9): entry 0 released
    assert tables(m, 1) == [[1, 2, 5], [0, 4, 6]]
    assert m.num_available_blocks == 1
    assert m.release_skipped(1, 9) == 0
    assert m.append(1, [9, 10, 11, 12], release=False) is None  # still 2 of 1
    assert m.num_available_blocks == 1, "the refused step gave nothing back or took any"
    assert m.append(1, [9, 10], release=False) == []  # p = 9, no new block; entry 1 kept
    assert tables(m, 1) == [[1, 2, 5], [0, 4, 6]]
    assert m.append(1, [11, 12]) == []  # p = 11: entry 1 released first; then 2 new blocks
    assert tables(m, 1) == [[1, 2, 5, 4], [0, 0, 6, 3]]  # the last released is reused first


def test_release_skipped_arguments(make, impl):
    m = make(8, 4, groups=[FULL, sw(4)])
    assert m.allocate(1, toks(0, 9)) == 0
    with pytest.raises(InvalidArgumentError):
        m.release_skipped(1, -1)
    with pytest.raises(InvalidArgumentTypeError):
        m.release_skipped(1, "3")
    with pytest.raises(InvalidArgumentTypeError):
        m.append(1, [1], release=1)
    with pytest.raises(InvalidArgumentTypeError):
        m.extend(1, 1, release=None)
    with pytest.raises(pagedkv.errors.UnknownSequenceError):
        m.release_skipped(2, 3)
    plain = impl(8, 4, watermark=0.0)
    assert plain.allocate(1, toks(0, 9)) == 0
    assert plain.release_skipped(1, 9) == 0  # nothing skips without groups
    assert plain.append(1, [1], release=False) == []


def test_state_group_keeps_only_the_latest_state(make):
    m = make(16, 4, groups=[STATE], enable_prefix_caching=False)
    assert m.allocate(1, toks(0, 9)) == 0
    assert m.block_table(1) == [1, 2, 3]
    assert m.append(1, [9]) == []  # p = 9: the state is read from entry (9-1)//4 = 2
    assert m.block_table(1) == [0, 0, 3]
    for t in range(10, 30):
        assert m.append(1, [t]) == []
        nonnull = [b for b in m.block_table(1) if b != 0]
        assert 1 <= len(nonnull) <= 2, "the latest state, plus the block being written"


def test_chunked_local_releases_whole_chunks(make):
    m = make(16, 4, groups=[chunked(8)], enable_prefix_caching=False)
    assert m.allocate(1, toks(0, 7)) == 0
    assert m.block_table(1) == [1, 2]
    assert m.append(1, [7]) == []  # p = 7: still the first chunk
    assert m.block_table(1) == [1, 2]
    assert m.append(1, [8]) == []  # p = 8: a new chunk: both blocks of the first released
    assert m.block_table(1) == [0, 0, 2], "released tail first: the tail, block 2, is on top"


@pytest.mark.parametrize("window", [48, 40, 16])
def test_sliding_window_memory_is_bounded(make, window):
    """Decoding ten windows holds at most ceil(window / B) + 1 blocks of the window group,
    and never releases an entry the window still covers."""
    b = 16
    m = make(200, b, groups=[FULL, sw(window)], enable_prefix_caching=False)
    assert m.allocate(1, toks(0, 20)) == 0
    bound = math.ceil(window / b) + 1
    for t in range(20, 10 * window):
        assert m.append(1, [t]) == []
        full, win = tables(m, 1)
        held = [e for e in win if e != 0]
        assert len(held) <= bound
        s = m.num_scheduled_tokens(1)
        first_needed_entry = max(0, s - window) // b  # the last token attends back to here
        assert 0 not in win[first_needed_entry:], "an entry the window covers was released"
        assert 0 not in full
    assert m.stats().groups[1].used_blocks <= bound


# ------------------------------------------------------------------ the hybrid prefix hit


def _filler(m: Manager, sid: int, num_tokens: int) -> None:
    """A sequence of fresh tokens (no hit) that takes `ceil(num_tokens / B)` blocks per
    group: what it takes beyond the free stack it evicts, oldest first."""
    assert m.allocate(sid, toks(10_000 + 1000 * sid, num_tokens)) == 0


def test_vllm_hybrid_prefill_example_hits_past_evicted_window_blocks(make):
    """vLLM's hybrid example: a full group and two sliding-window groups (window 32, block
    16). A prompt whose first 3 blocks are cached hits 48 tokens with tables
    full=[a, b, c, .], sw=[0, x, y, .]; the window groups' first blocks, released and then
    evicted, are not needed."""
    m = make(29, 16, groups=[FULL, sw(32), sw(32)])
    p = toks(0, 48)
    assert m.allocate(1, [*p, 1000]) == 0
    full, w1, w2 = tables(m, 1)
    assert m.append(1, [1001]) == []  # p = 49: tokens 0..17 left both windows
    assert tables(m, 1) == [full, [0, *w1[1:]], [0, *w2[1:]]]
    assert m.num_cached_blocks == 2, "the released window blocks are cached"
    assert m.num_free_blocks == 16
    _filler(m, 9, 96)  # 18 blocks: the 16 free ones, then the 2 cached window blocks
    st = m.stats()
    assert [g.evictions for g in st.groups] == [0, 1, 1]
    m.free(9)
    assert m.lookup([*p, 7]) == 48
    assert m.allocate(2, [*p, 7]) == 48
    t = tables(m, 2)
    assert t[0][:3] == full[:3]
    assert t[1][:3] == [0, w1[1], w1[2]]
    assert t[2][:3] == [0, w2[1], w2[2]]
    assert [g.hit_blocks for g in m.stats().groups] == [3, 2, 2]


def test_vllm_hybrid_prefill_example_no_hit_without_the_full_groups_first_block(make):
    """Same groups: blocks 1 and 2 of the prompt are cached in every group (held by a
    sequence whose own block 0 is an unregistered duplicate), block 0 only by a finished
    sequence. Evicting the full group's block 0 leaves no hit, although both window groups
    could still serve 48 tokens."""
    m = make(30, 16, groups=[FULL, sw(32), sw(32)])
    p = toks(0, 48)
    assert m.allocate(1, [*p, 1000], num_new_tokens=1) == 0  # nothing registered yet
    assert m.allocate(2, [*p[:16], 2000]) == 0  # registers block 0 of the prompt
    assert m.extend(1, 48) == []  # its block 0 duplicates seq 2's; blocks 1, 2 register
    assert m.lookup([*p, 7]) == 48
    m.free(2)  # its block-0 copies are cached, the full group's the oldest
    assert (m.num_free_blocks, m.num_cached_blocks) == (14, 3)
    _filler(m, 9, 80)  # 15 blocks: the 14 free ones and the oldest cached block
    assert [g.evictions for g in m.stats().groups] == [1, 0, 0]
    assert m.lookup([*p, 7]) == 0


def test_sliding_window_hit_needs_only_the_window(make):
    m = make(16, 16, groups=[sw(32)])
    p = toks(0, 64)
    assert m.allocate(1, [*p, 1000]) == 0
    assert m.append(1, [1001]) == []  # p = 65: entries 0, 1 released (1 first)
    assert m.block_table(1)[:2] == [0, 0]
    assert (m.num_free_blocks, m.num_cached_blocks) == (10, 2)
    _filler(m, 9, 192)  # 12 blocks: evicts both released blocks
    assert m.num_cached_blocks == 0
    assert m.lookup([*p, 7]) == 64, "a hit at 64 needs blocks 2 and 3 only"
    m.free(9)  # room for the new entry
    assert m.allocate(2, [*p, 7]) == 64
    assert m.block_table(2)[:4] == [0, 0, *m.block_table(1)[2:4]]


@pytest.mark.parametrize("group", [sw(8), chunked(8)], ids=["window", "chunked"])
def test_local_groups_admit_a_prompt_longer_than_the_pool_past_its_hit(make, group):
    """With only local-attention groups a hit holds only the blocks its window or chunk
    still needs: a cached 48-token prompt plus one token and 4 lookahead slots spans 14
    blocks (more than the 13 usable besides the null block) but takes 2 fresh ones, and
    `allocate` takes them as `allocation_cost` and `can_allocate` say (it refused before)."""
    m = make(14, 4, groups=[group])
    p = toks(0, 48)
    assert m.allocate(1, p) is not None  # chunked: a boundary hit with nothing cached
    m.free(1)
    assert m.num_available_blocks == 13
    prompt = [*p, 99]
    assert m.allocation_cost(prompt, lookahead=4)[:2] == (48, 2)
    assert m.can_allocate(prompt) == AllocStatus.OK
    assert m.allocate(2, prompt, lookahead=4) == 48
    table = m.block_table(2)
    assert len(table) == 14  # 49 tokens and 4 slots, the skipped entries null
    assert len([b for b in table if b != 0]) <= 4
    assert m.append(2, [100]) == []


def test_hit_blocked_inside_the_window_falls_back_to_a_shorter_hit(make):
    m = make(16, 16, groups=[sw(32)])
    p = toks(0, 64)
    assert m.allocate(1, [*p, 1000]) == 0
    assert m.append(1, [1001]) == []  # entries 1 then 0 released: block 1 is the oldest
    _filler(m, 9, 176)  # 11 blocks: evicts block 1 only
    assert m.num_cached_blocks == 1
    # 48 tokens need blocks 1, 2; 32 need 0, 1; 16 need block 0 (still cached).
    assert m.lookup([*p[:48], 7]) == 16
    assert m.lookup([*p, 7]) == 64, "the longer prompt's window is intact"
    _filler(m, 10, 16)  # evicts block 0 too
    assert m.lookup([*p[:48], 7]) == 0
    assert m.lookup([*p, 7]) == 64


def test_chunked_local_hits_at_chunk_boundaries(make):
    """A chunked-local group needs only the current chunk's blocks: at a chunk boundary,
    none. With a full group: chunk 32, block 16."""
    m = make(21, 16, groups=[FULL, chunked(32)])
    p = toks(0, 48)
    assert m.allocate(1, [*p, 1000]) == 0
    for t in range(1001, 1017):  # p = 49 releases chunk entries 1, 0; p = 64: 3, 2
        assert m.append(1, [t]) == []
    assert m.num_scheduled_tokens(1) == 65
    assert m.block_table(1, group=1) == [0, 0, 0, 0, m.block_table(1, group=1)[4]]
    assert (m.num_free_blocks, m.num_cached_blocks) == (10, 4)
    assert m.lookup([*p, 7]) == 48
    _filler(m, 9, 96)  # 12 blocks: evicts chunk entries 1 and 0
    assert m.lookup([*p, 7]) == 48, "48 is mid-chunk: it needs block 2 only"
    _filler(m, 10, 16)  # evicts chunk entries 3 and 2
    assert m.lookup([*p, 7]) == 32, "no block 2: back to the chunk boundary at 32"
    a_first_64 = [*p, *range(1000, 1016)]
    assert m.lookup([*a_first_64, 7]) == 64, "64 is a boundary: the chunk group needs nothing"


def test_chunked_local_alone_hits_a_boundary_with_nothing_cached(make):
    """Tokens past a chunk boundary attend only within their chunk: no earlier KV is needed
    (vLLM returns null blocks for them too)."""
    m = make(8, 16, groups=[chunked(32)])
    assert m.lookup(toks(0, 49)) == 32
    assert m.allocate(1, toks(0, 49)) == 32
    assert m.block_table(1) == [0, 0, 1, 2]
    st = m.stats()
    assert (st.prefix_hits, st.groups[0].hit_blocks) == (32, 0)
    assert m.lookup(toks(0, 32)) == 0, "cap 1 block: block 0 was never computed"
    off = make(8, 16, groups=[chunked(32)], enable_prefix_caching=False)
    assert off.lookup(toks(0, 49)) == 0


def test_state_group_hits_at_block_boundaries_only(make):
    m = make(16, 16, groups=[STATE])
    assert m.allocate(1, toks(0, 40)) == 0  # states at 16 and 32 registered
    assert m.lookup(toks(0, 41)) == 32, "the state at 40 is mid-block: not a hit"
    q = [*toks(0, 40), *toks(500, 20)]  # diverges inside block 2
    assert m.lookup(q) == 32
    assert m.allocate(2, q) == 32
    assert m.block_table(2)[:2] == [0, m.block_table(1)[1]], "only the block ending the hit"
    # The cap leaves one token to compute: 32 tokens hit 16 though block 1 is cached.
    assert m.lookup(toks(0, 32)) == 16
    assert m.lookup(toks(0, 33)) == 32


def test_full_and_state_hit_needs_the_states_last_block(make):
    """A Jamba-like model: full attention plus a recurrent state (block 16). A hit needs
    only the state at its end; without it, the hit falls back to an earlier cached state."""
    m = make(14, 16, groups=[FULL, STATE])
    p = toks(0, 48)
    assert m.allocate(1, [*p, 1000]) == 0
    assert m.append(1, [1001]) == []  # p = 49: the state is read from entry 3 from now on
    assert m.block_table(1, group=1)[:3] == [0, 0, 0]
    assert (m.num_free_blocks, m.num_cached_blocks) == (5, 3)
    assert m.lookup([*p, 7]) == 48, "the cached state at 48 (block 2) is all it needs"
    _filler(m, 9, 48)  # 6 blocks: 5 free, then the oldest cached one: the state at 48
    assert m.lookup([*p, 7]) == 32, "no state at 48: back to the state at 32"
    _filler(m, 10, 16)  # 2 blocks: the states at 32 and 16
    assert m.lookup([*p, 7]) == 0


@pytest.mark.parametrize("caching", [True, False])
def test_single_full_group_hits_as_without_groups(impl, caching):
    """`groups=[KVCacheGroup("full")]` is the manager without groups (no null block: block 0
    is the null block only beside a group that is not full attention): the same block ids,
    hits, copies, statuses, counters and events, call by call; only `stats().groups` is
    added."""
    kw: dict[str, Any] = {"num_cpu_blocks": 8, "watermark": 0.0, "enable_kv_events": True}
    kw["enable_prefix_caching"] = caching
    plain = impl(24, 4, **kw)
    grouped = impl(24, 4, groups=[FULL], **kw)
    rng = random.Random(10)
    prefixes = [toks(0, 12), toks(100, 9), toks(200, 16)]
    live: list[int] = []
    next_id = 0

    def call(name: str, *args: Any, **kw: Any) -> Any:
        """Both managers' answers, which must be equal."""
        outs = []
        for m in (plain, grouped):
            try:
                outs.append(getattr(m, name)(*args, **kw))
            except pagedkv.PagedKVError as e:
                outs.append(type(e))
        ev = [list(map(repr, m.drain_events())) for m in (plain, grouped)]
        assert ev[0] == ev[1], f"{name}{args}: events differ"
        a, b = outs
        if name == "append_batch" and a is not None and not isinstance(a, type):
            a, b = a.tolist(), b.tolist()
        assert a == b, f"{name}{args}: {a} != {b}"
        return a

    for _ in range(800):
        op = rng.random()
        if op < 0.3 or not live:
            if len(live) > 6:
                sid = live.pop(rng.randrange(len(live)))
                call("free", sid, num_computed_tokens=rng.choice([None, None, 0]))
                continue
            prompt = rng.choice(prefixes)[: rng.randint(1, 16)] + toks(rng.randint(0, 999), 5)
            call("lookup", prompt)
            call("can_allocate", prompt)
            k = rng.choice([None, 1, 3])
            la = rng.choice([0, 0, 3])
            if call("allocate", next_id, prompt, num_new_tokens=k, lookahead=la) is not None:
                live.append(next_id)
            next_id += 1
            continue
        sid = rng.choice(live)
        s, n = plain.num_scheduled_tokens(sid), plain.num_tokens(sid)
        if plain.is_swapped(sid):
            call("can_swap_in", sid)
            call("swap_in", sid)
        elif s < n:
            call("extend", sid, rng.randint(1, n - s), lookahead=rng.choice([0, 2]))
        elif op < 0.55:
            call("append", sid, toks(rng.randint(0, 50), rng.randint(1, 6)))
        elif op < 0.62:
            batch = rng.sample(live, min(len(live), 3))
            call("append_batch", batch, toks(rng.randint(0, 50), len(batch)))
        elif op < 0.7:
            call("truncate", sid, rng.randint(1, n))
        elif op < 0.8:
            if call("fork", sid, next_id) is None:
                live.append(next_id)
            next_id += 1
        elif op < 0.87:
            call("swap_out", sid)
        else:
            live.remove(sid)
            call("free", sid, num_computed_tokens=rng.choice([None, 0, rng.randint(0, n)]))
        for x in live:
            if not plain.is_swapped(x):
                assert plain.block_table(x) == grouped.block_table(x)
        ignore = {"groups": []}  # the group figures only the grouped manager has
        assert plain.stats().as_dict() | ignore == grouped.stats().as_dict() | ignore
    st = plain.stats()
    assert min(st.cow_copies, st.swapped_in_blocks, st.truncated_blocks) > 0
    assert min(st.prefix_hits, st.evictions, st.unregistered_blocks) > 0 or not caching
    plain.check_invariants()
    grouped.check_invariants()


# ------------------------------------------------------------------ lookup and can_allocate


def test_lookup_equals_allocates_hit_and_changes_nothing(make):
    m = make(40, 16, groups=[FULL, sw(32), STATE])
    p = toks(0, 80)
    assert m.allocate(1, [*p, 1000]) == 0
    for t in range(1001, 1010):
        assert m.append(1, [t]) == []
    m.drain_events()
    prompts = [[*p, 7], [*p[:48], 7], p[:33], toks(0, 17), toks(5000, 40)]
    for sid, q in enumerate(prompts, start=10):
        before = snapshot(m, [1])
        hit = m.lookup(q)
        assert snapshot(m, [1]) == before
        assert m.drain_events() == []
        assert m.lookup_many([q, q]) == [hit, hit]
        assert m.allocate(sid, q) == hit
    assert [m.lookup(q) for q in prompts[:2]] == [80, 48]


def test_lookup_leaves_the_lru_order_alone(make):
    """Eviction order after lookups is the order of release (a lookup touches nothing)."""
    m = make(7, 16, groups=[FULL, sw(16)])
    assert m.allocate(1, toks(0, 17)) == 0  # block 0 registered in both groups
    m.free(1)  # cached: the full group's first, then the window group's
    m.drain_events()
    assert m.lookup(toks(0, 17)) == 16
    assert m.lookup(toks(0, 17)) == 16
    assert m.num_free_blocks == 4
    _filler(m, 9, 48)  # 6 blocks: 4 free, then the two cached ones, oldest first
    ev = m.drain_events()
    assert [g for g, _ in removed(ev)] == [0, 1]


def test_can_allocate_credits_the_hybrid_hit(make):
    m = make(11, 16, groups=[FULL, sw(32)])
    p = toks(0, 48)
    assert m.allocate(1, [*p, 1000]) == 0  # 4 entries per group
    assert m.append(1, [1001]) == []  # the window's entry 0 is cached now
    assert (m.num_free_blocks, m.num_cached_blocks) == (2, 1)
    q = [*p, 7]
    # A hit of 3 blocks: total 2*4 - 1 null, need 2 new blocks (both hit sets are held).
    assert m.can_allocate(q) == AllocStatus.OK
    assert m.can_allocate(len(q)) == AllocStatus.LATER, "8 new blocks > 3 available"
    assert m.can_allocate(16 * 6) == AllocStatus.NEVER, "12 blocks > 10 usable"
    assert m.allocate(2, q) == 48


def test_can_allocate_watermark_counts_usable_blocks(make):
    m = make(11, 16, groups=[FULL, sw(32)], watermark=0.1)  # 1 watermark block, 10 usable
    assert m.can_allocate(16 * 4) == AllocStatus.OK
    assert m.can_allocate(16 * 5) == AllocStatus.NEVER, "10 usable - 10 < 1"
    assert m.allocate(1, toks(0, 64)) == 0
    m.free(1)  # 8 cached
    # A hit of 4 blocks: full pins 4, the window 2 (2 nulls): total 10 - 2, need 2 + 6.
    assert m.can_allocate(toks(0, 65)) == AllocStatus.OK
    assert m.allocate(3, toks(300, 16)) == 0
    assert m.num_free_blocks == 0
    # 6 cached hits + 2 new of 8 available leave less than the watermark.
    assert m.can_allocate(toks(0, 65)) == AllocStatus.LATER
    assert m.allocate(1, toks(0, 65)) == 64, "allocate itself ignores the watermark"


def test_can_swap_in_counts_only_held_entries(make):
    m = make(12, 16, groups=[FULL, sw(16)], num_cpu_blocks=16)
    assert m.allocate(1, toks(0, 64)) == 0
    assert m.append(1, [1]) == []  # p = 64: window entries 0..2 released
    pairs = m.swap_out(1)
    assert pairs is not None and len(pairs) == 5 + 2, "the 3 null entries move nothing"
    assert m.num_free_cpu_blocks == 16 - 7
    _filler(m, 2, 32)  # 4 blocks
    assert m.num_available_blocks == 7
    assert m.can_swap_in(1) == AllocStatus.OK, "7 held entries; the nulls need no block"
    _filler(m, 3, 16)  # 2 more
    assert m.can_swap_in(1) == AllocStatus.LATER
    assert m.swap_in(1) is None
    m.free(3)
    back = m.swap_in(1)
    assert back is not None and len(back) == 7
    assert m.block_table(1, group=1)[:3] == [0, 0, 0]


# ------------------------------------------------------------------ truncate


def test_truncate_refuses_a_rollback_past_the_window(make):
    m = make(30, 16, groups=[FULL, sw(32)])
    assert m.allocate(1, toks(0, 100)) == 0
    assert m.append(1, [100]) == []  # p = 100: tokens before 69 left the window
    assert m.block_table(1, group=1)[:5] == [0, 0, 0, 0, m.block_table(1, group=1)[4]]
    m.drain_events()
    before = snapshot(m, [1])
    for bad in (64, 80, 94):
        with pytest.raises(InvalidArgumentError):
            m.truncate(1, bad)
        assert snapshot(m, [1]) == before, "a refused truncate changes nothing"
    assert m.drain_events() == []
    assert m.truncate(1, 95) == []  # the window at 95 starts at token 64: entry 4 on
    assert m.num_tokens(1) == 95
    assert [len(t) for t in tables(m, 1)] == [6, 6]
    # The last block (80..95) is left partial and was hashed: it leaves both indexes.
    assert [g for g, _ in removed(m.drain_events())] == [0, 1]


def test_truncate_state_group_only_to_a_block_boundary(make):
    m = make(30, 16, groups=[FULL, STATE])
    assert m.allocate(1, toks(0, 50)) == 0
    before = snapshot(m, [1])
    with pytest.raises(InvalidArgumentError):
        m.truncate(1, 40)  # no state at 40
    assert snapshot(m, [1]) == before
    assert m.truncate(1, 32) == []
    assert tables(m, 1) == [before[3][0][0][:2], before[3][0][1][:2]]
    assert m.num_scheduled_tokens(1) == 32
    # Tokens not yet scheduled carry no state: dropping them is fine anywhere.
    assert m.allocate(2, toks(500, 50), num_new_tokens=20) == 0
    assert m.truncate(2, 45) == []
    assert m.num_tokens(2) == 45
    # After a step the state of 16 is gone: a roll-back to it is refused.
    assert m.append(1, [7]) == []  # p = 32: state entry 0 released
    with pytest.raises(InvalidArgumentError):
        m.truncate(1, 16)


def test_truncate_copies_shared_partial_blocks_in_group_order(make):
    m = make(9, 16, groups=[FULL, sw(32)])
    assert m.allocate(1, toks(0, 33)) == 0  # entries 0, 1 registered in both groups
    m.fork(1, 2)
    assert m.allocate(3, toks(500, 5)) == 0  # holds the last 2 free blocks
    full, win = tables(m, 1)
    before = snapshot(m, [1, 2, 3])
    assert m.truncate(1, 20) is None, "two copies, no block available"
    assert snapshot(m, [1, 2, 3]) == before
    m.free(3)
    pairs = m.truncate(1, 20)
    assert pairs is not None
    assert [src for src, _ in pairs] == [full[1], win[1]]
    assert tables(m, 1) == [[full[0], pairs[0][1]], [win[0], pairs[1][1]]]
    assert tables(m, 2) == [full, win], "the fork keeps the originals"
    assert m.stats().cow_copies == 2


def test_truncate_releases_every_group_before_it_copies(make):
    # One order for the Rust manager and the reference: withdraw, release every group's
    # dropped entries (group by group, tail first), then copy in group order, so the copies
    # reuse the blocks the releases freed (the last one freed first).
    m = make(20, 4, groups=[FULL, FULL])
    assert m.allocate(1, toks(0, 9)) == 0  # entries 0 and 1 registered, entry 2 partial
    m.fork(1, 2)
    assert m.append(1, [9]) is not None  # entry 2 copied in both groups: sequence 1's own
    full, other = tables(m, 1)
    pairs = m.truncate(1, 6)
    assert pairs == [(full[1], other[2]), (other[1], full[2])]
    assert tables(m, 1) == [[full[0], other[2]], [other[0], full[2]]]


def test_truncate_gives_back_lookahead_blocks_in_every_group(make):
    m = make(30, 4, groups=[FULL, sw(8), STATE])
    assert m.allocate(1, toks(0, 8), lookahead=5) == 0
    assert [len(t) for t in tables(m, 1)] == [4, 4, 4]
    used = m.stats().used_blocks
    assert m.truncate(1, 8) == []
    assert [len(t) for t in tables(m, 1)] == [2, 2, 2]
    assert m.stats().used_blocks == used - 6
    assert m.stats().truncated_blocks == 6


# ------------------------------------------------------------------ fork, free, swap


def test_fork_free_and_swap_keep_nulls(make):
    m = make(20, 16, groups=[FULL, sw(32)], num_cpu_blocks=16)
    assert m.allocate(1, toks(0, 60)) == 0
    assert m.append(1, [60]) == []  # p = 60: window entry 0 released
    full, win = tables(m, 1)
    assert win[0] == 0 and 0 not in full
    m.fork(1, 2)
    assert tables(m, 2) == [full, win]
    used = m.stats().used_blocks
    assert used == 4 + 3, "a fork shares: no new block, the null block not counted"
    m.drain_events()
    pairs = m.swap_out(2)
    assert pairs is not None
    assert [g for g, _ in pairs] == full + win[1:], "non-null entries, group by group"
    ev = m.drain_events()
    digests = m.block_hashes(2)
    assert stored(ev, "CPU") == [(0, d) for d in digests[:3]] + [(1, d) for d in digests[1:3]]
    m.free(1)  # the swapped fork's blocks were released: these go now
    assert m.stats().used_blocks == 0
    assert m.reset_prefix_cache() is True  # so that swap-in registers every block afresh
    back = m.swap_in(2)
    assert back is not None
    assert [c for c, _ in back] == [c for _, c in pairs]
    full2, win2 = tables(m, 2)
    assert win2[0] == 0 and 0 not in win2[1:]
    assert [g for _, g in back] == full2 + win2[1:]
    ev = m.drain_events()
    want = [(0, d) for d in digests[:3]] + [(1, d) for d in digests[1:3]]
    assert removed(ev, "CPU") == want, "the CPU copies go, group by group"
    assert stored(ev, "GPU") == want, "and every block registers again"
    m.free(2)
    assert m.num_free_blocks + m.num_cached_blocks == 19


def test_free_swapped_sequence_removes_cpu_copies_per_group(make):
    m = make(20, 16, groups=[FULL, sw(16)], num_cpu_blocks=16)
    assert m.allocate(1, toks(0, 40)) == 0
    assert m.append(1, [40]) == []  # p = 40: window entry 0 released (25.. still needed)
    assert m.swap_out(1) is not None
    d = m.block_hashes(1)
    m.drain_events()
    m.free(1)
    assert removed(m.drain_events(), "CPU") == [(0, d[0]), (0, d[1]), (1, d[1])]
    assert m.num_free_cpu_blocks == 16


def test_free_withdraws_uncomputed_blocks_per_group(make):
    m = make(30, 16, groups=[FULL, sw(32)])
    assert m.allocate(1, toks(0, 65)) == 0  # entries 0..3 registered in both groups
    assert m.append(1, [65]) == []  # p = 65: window entries 0, 1 released (still cached)
    d = m.block_hashes(1)
    m.drain_events()
    m.free(1, num_computed_tokens=20)  # only block 0 was really computed
    ev = m.drain_events()
    assert removed(ev) == [(0, d[3]), (0, d[2]), (0, d[1]), (1, d[3]), (1, d[2])]
    assert m.stats().unregistered_blocks == 5
    assert m.lookup([*toks(0, 64), 9]) == 16


# ------------------------------------------------------------------ outputs


def test_outputs_take_the_group(make):
    m = make(20, 4, groups=[FULL, sw(4)])
    assert m.allocate(1, toks(0, 10)) == 0
    assert m.append(1, [10]) == []  # p = 10: the window is tokens 7..10: entry 0 released
    full, win = tables(m, 1)
    assert win[0] == 0 and 0 not in win[1:]
    assert m.block_tables([1], group=1).tolist() == [win]
    assert m.block_tables([1], pad=-7).tolist() == [full]
    assert m.slot_mapping([1], 1, group=1).tolist() == [win[2] * 4 + 2]
    assert m.slot_mapping([1], 1).tolist() == [full[2] * 4 + 2]
    indptr, indices, last = m.flashinfer_page_table([1], group=1)
    assert (indptr.tolist(), indices.tolist(), last.tolist()) == ([0, 3], win, [3])


def test_table_digest_covers_every_group(make):
    m = make(20, 4, groups=[FULL, sw(4)])
    assert m.allocate(1, toks(0, 9)) == 0
    m.fork(1, 2)
    assert m.table_digest(1) == m.table_digest(2), "equal tables, equal digests"
    m.free(2)
    full, win = tables(m, 1)
    before = m.table_digest(1)
    assert m.append(1, [9]) == []  # p = 9: the window's entry 0 goes; nothing else moves
    assert tables(m, 1) == [full, [0, *win[1:]]]
    assert m.table_digest(1) != before


@pytest.mark.parametrize("call", ["block_table", "block_tables", "slot", "flashinfer"])
def test_group_index_out_of_range_is_refused(make, call):
    m = make(20, 4, groups=[FULL, sw(4)])
    assert m.allocate(1, toks(0, 8)) == 0
    before = snapshot(m, [1])
    fn = {
        "block_table": lambda g: m.block_table(1, group=g),
        "block_tables": lambda g: m.block_tables([1], group=g),
        "slot": lambda g: m.slot_mapping([1], 1, group=g),
        "flashinfer": lambda g: m.flashinfer_page_table([1], group=g),
    }[call]
    for bad in (2, -1, 64):
        with pytest.raises(InvalidArgumentError):
            fn(bad)
    with pytest.raises(InvalidArgumentTypeError):
        fn(1.0)
    with pytest.raises(InvalidArgumentError):  # the argument error comes before the state's
        m.block_tables([99], group=5)
    assert snapshot(m, [1]) == before


def test_group_argument_without_groups(impl):
    m = impl(8, 4)
    assert m.allocate(1, toks(0, 5)) == 0
    assert m.block_table(1, group=0) == m.block_table(1) == [0, 1]
    with pytest.raises(InvalidArgumentError):
        m.block_table(1, group=1)
    assert m.stats().groups == ()


@pytest.mark.parametrize(
    "groups",
    [
        [sw(8)],  # window smaller than a block of 16
        [KVCacheGroup("full", block_size=32)],  # mixed block sizes
        [FULL, KVCacheGroup("full", block_size=8)],
        [chunked(24)],  # chunk not a multiple of the block
        [],
        [FULL] * 65,
    ],
)
def test_bad_groups_are_refused(impl, groups):
    with pytest.raises(InvalidArgumentError):
        impl(8, 16, groups=groups)


# ------------------------------------------------------------------ append_batch


def test_append_batch_counts_a_shared_skipped_block_once(make):
    """Two forks drop the same out-of-window block: freed once, when both have dropped it."""
    m = make(3, 16, groups=[sw(16)], enable_prefix_caching=False)
    assert m.allocate(1, toks(0, 32)) == 0
    m.fork(1, 2)
    before = snapshot(m, [1, 2])
    assert m.append_batch([1, 2], [7, 8]) is None, "2 new blocks, 0 free + 1 freed"
    assert snapshot(m, [1, 2]) == before
    m2 = make(4, 16, groups=[sw(16)], enable_prefix_caching=False)
    assert m2.allocate(1, toks(0, 32)) == 0
    m2.fork(1, 2)
    out = m2.append_batch([1, 2], [7, 8])
    assert out is not None and out.shape == (0, 2)
    assert m2.block_table(1) == [0, 2, 1], "the freed block is popped first"
    assert m2.block_table(2) == [0, 2, 3]


def test_append_batch_registers_every_group(make):
    m = make(40, 4, groups=[FULL, sw(4), STATE])
    assert m.allocate(1, toks(0, 3)) == 0
    assert m.allocate(2, toks(100, 3)) == 0
    m.drain_events()
    assert m.append_batch([1, 2], [3, 103]) is not None
    d1, d2 = m.block_hashes(1)[0], m.block_hashes(2)[0]
    assert Counter(stored(m.drain_events())) == Counter(
        [(g, d) for g in range(3) for d in (d1, d2)]
    )
    assert [g.registered_blocks for g in m.stats().groups] == [2, 2, 2]


# ------------------------------------------------------------------ events and stats


def test_events_carry_the_group_one_per_group_per_block(make, impl):
    groups = [FULL, sw(32), STATE]
    m = make(40, 16, groups=groups)
    assert m.allocate(1, toks(0, 33)) == 0
    ev = m.drain_events()
    d = m.block_hashes(1)
    assert stored(ev) == [(g, x) for g in range(3) for x in d[:2]], "group order, then index"
    plain = impl(40, 16, enable_kv_events=True)
    plain.allocate(1, toks(0, 33))
    first = [e for e in ev if e.group_idx == 0]
    assert [(e.parent_block_hash, e.token_ids) for e in first] == [
        (e.parent_block_hash, e.token_ids) for e in plain.drain_events()
    ], "the same digests, parents and tokens as without groups"
    m.free(1)
    _filler(m, 9, 16 * 13)  # 39 blocks: the 33 free, then the 6 cached
    assert sorted(removed(m.drain_events())) == sorted((g, x) for g in range(3) for x in d[:2])


def test_group_stats(make):
    m = make(21, 16, groups=[FULL, sw(16)])
    assert m.allocate(1, toks(0, 48)) == 0  # 3 + 3 blocks, 3 + 3 registered
    assert m.append(1, [48]) == []  # p = 48: window entries 1, 0 released; 1 new each
    st = m.stats()
    full, win = st.groups
    assert (full.kind, win.kind) == ("full", "sliding_window")
    assert (full.used_blocks, full.cached_blocks) == (4, 0)
    assert (win.used_blocks, win.cached_blocks) == (2, 2)
    assert full.usage == pytest.approx(4 / 20) and win.usage == pytest.approx(2 / 20)
    assert (full.registered_blocks, win.registered_blocks) == (3, 3)
    assert st.used_blocks == 6 and st.cached_blocks == 2 and st.free_blocks == 12
    assert st.usage == pytest.approx(6 / 20)
    assert m.allocate(2, [*toks(0, 48), 9]) == 48
    st = m.stats()
    assert [g.hit_blocks for g in st.groups] == [3, 1], "the window hit pins block 2 only"
    assert [g.cached_blocks for g in st.groups] == [0, 2]
    _filler(m, 9, 16 * 6)  # 12 blocks: 10 free, then the 2 cached window blocks
    assert [g.evictions for g in m.stats().groups] == [0, 2]
    assert m.stats().evictions == 2
    st = m.stats()
    assert st.reserved_slots == 16 * (4 + 2 + 4 + 2 + 12)
    assert st.used_slots == (49 + 49 - 32) + (49 + 49 - 32) + 96 * 2


def test_reset_prefix_cache_with_groups(make):
    m = make(20, 16, groups=[FULL, sw(16)])
    assert m.allocate(1, toks(0, 33)) == 0
    assert m.reset_prefix_cache() is False
    m.free(1)
    assert m.num_cached_blocks == 4
    assert m.reset_prefix_cache() is True
    assert (m.num_free_blocks, m.num_cached_blocks) == (19, 0)
    assert m.lookup(toks(0, 33)) == 0


# ------------------------------------------------------------------ a random workload

MIXES = {
    "full+window+state": [FULL, sw(6), STATE],
    "window": [sw(4)],
    "chunk+full": [chunked(8), FULL],
    "state": [STATE],
    "five": [FULL, sw(9), sw(4), chunked(4), STATE],
}


def _check_shapes(m: Manager, groups: list[KVCacheGroup], sid: int) -> None:
    """Every table as long as the others; nulls a leading run the group may skip."""
    ts = tables(m, sid)
    assert len({len(t) for t in ts}) == 1
    s = m.num_scheduled_tokens(sid)
    for group, t in zip(groups, ts, strict=True):
        nulls = next((i for i, b in enumerate(t) if b != 0), len(t))
        assert 0 not in t[nulls:]
        assert nulls * 4 <= group.skipped_tokens(s)


@pytest.mark.parametrize("mix", list(MIXES))
@pytest.mark.parametrize("caching", [True, False])
def test_random_workload_keeps_the_contract(make, mix, caching):
    """Every call of a mixed workload: invariants audited, `allocate` hits what `lookup`
    said, tables shaped as the spec says, group figures adding up to the pool's."""
    groups = MIXES[mix]
    rng = random.Random(f"{mix}{caching}")
    num_blocks = 30
    m = make(num_blocks, 4, num_cpu_blocks=12, groups=groups, enable_prefix_caching=caching)
    prompts = [toks(0, 20), toks(100, 30)]
    live: list[int] = []
    next_id = 0
    for _ in range(250):
        op = rng.random()
        try:
            if op < 0.25 or not live:
                p = rng.choice(prompts)[: rng.randint(1, 20)] + [rng.randint(0, 9)] * 3
                hit = m.lookup(p)
                k = rng.choice([None, 2])
                r = m.allocate(next_id, p, num_new_tokens=k, lookahead=rng.choice([0, 0, 2]))
                if r is not None:
                    assert r == hit
                    live.append(next_id)
                next_id += 1
                continue
            sid = rng.choice(live)
            if m.is_swapped(sid):
                m.swap_in(sid)
                continue
            s, n = m.num_scheduled_tokens(sid), m.num_tokens(sid)
            if s < n:
                m.extend(sid, rng.randint(1, n - s), lookahead=rng.choice([0, 3]))
            elif op < 0.5:
                m.append(sid, [rng.randint(0, 9)] * rng.randint(1, 5))
            elif op < 0.6:
                batch = rng.sample(live, min(3, len(live)))
                m.append_batch(batch, [1] * len(batch))
            elif op < 0.7:
                m.truncate(sid, rng.randint(1, n))
            elif op < 0.78:
                m.fork(sid, next_id)
                live.append(next_id)
                next_id += 1
            elif op < 0.86:
                m.swap_out(sid)
            elif op < 0.88:
                m.reset_prefix_cache()
            else:
                live.remove(sid)
                m.free(sid, num_computed_tokens=rng.choice([None, rng.randint(0, n)]))
        except (InvalidArgumentError, pagedkv.SequenceSwappedError):
            pass  # a truncate the window refuses; a batch with a swapped member
        m.check_invariants()
        for x in live:
            if not m.is_swapped(x):
                _check_shapes(m, groups, x)
        st = m.stats()
        assert st.free_blocks + st.used_blocks + st.cached_blocks == num_blocks - 1
        assert sum(g.used_blocks for g in st.groups) == st.used_blocks
        assert sum(g.cached_blocks for g in st.groups) == st.cached_blocks
        assert sum(g.registered_blocks for g in st.groups) == st.registered_blocks
        assert sum(g.evictions for g in st.groups) == st.evictions
        m.drain_events()
    assert len(live) > 0


# ------------------------------------------------------------------ the hit, as a function


@settings(max_examples=300, deadline=None)
@given(
    kinds=st.lists(
        st.sampled_from(["full", "sw20", "sw32", "chunk32", "state"]), min_size=1, max_size=4
    ),
    cap=st.integers(0, 12),
    data=st.data(),
)
def test_fixed_point_is_the_largest_common_servable_length(kinds, cap, data):
    """vLLM's iteration (each group lowers L in turn, until none does) finds the largest
    length every group can serve, whatever is cached."""
    b = 16
    make_group = {
        "full": FULL,
        "sw20": sw(20),
        "sw32": sw(32),
        "chunk32": chunked(32),
        "state": STATE,
    }
    groups = [make_group[k] for k in kinds]
    cached = [data.draw(st.lists(st.booleans(), min_size=cap, max_size=cap)) for _ in groups]

    def servable(g: int, length: int) -> bool:
        return all(cached[g][i] for i in range(first_needed(groups[g], length, b), length))

    want = max(L for L in range(cap + 1) if all(servable(g, L) for g in range(len(groups))))
    assert hybrid_hit(groups, b, cap, lambda g, i: cached[g][i]) == want


def test_fixed_point_takes_several_rounds():
    """A state group and a window group that each lower the other's answer."""
    b = 16
    cached = {0: [False, True, False, True], 1: [True, True, True, False]}
    # L=4: state ok (block 3); window needs 2,3: no -> 3; state needs 2: no -> 2; window
    # needs 0,1: ok; state needs 1: ok.
    assert hybrid_hit([STATE, sw(32)], b, 4, lambda g, i: cached[g][i]) == 2
