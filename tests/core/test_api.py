"""Unit tests of every operation and every error in docs/semantics.md.

Each test runs against both implementations: the pure-Python reference model and the Rust
`pagedkv.BlockManager`. Block ids are fully determined by the contract (LIFO free stack that
pops 0, 1, 2, ... at first; LRU eviction of the least recently released cached block), so the
tests spell out exact tables, pairs and counters.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

import pagedkv
from audited import audited
from pagedkv.alloc_status import AllocStatus
from pagedkv.errors import (
    DuplicateSequenceError,
    InvalidArgumentError,
    InvariantError,
    PagedKVError,
    SequenceNotSwappedError,
    SequenceSwappedError,
    UnknownSequenceError,
)
from pagedkv.events import AllBlocksCleared, BlockRemoved, BlockStored
from pagedkv.stats import Stats
from pagedkv_reference import ReferenceBlockManager
from pagedkv_reference import hash_blocks as ref_hash_blocks

Manager = Any  # ReferenceBlockManager or pagedkv.BlockManager
Factory = Callable[..., Manager]


# ------------------------------------------------------------------ fixtures and helpers


@pytest.fixture(params=["reference", "rust"])
def impl(request: pytest.FixtureRequest) -> type:
    return pagedkv.BlockManager if request.param == "rust" else ReferenceBlockManager


@pytest.fixture
def make(impl: type) -> Iterator[Factory]:
    """Build managers (block_size 4 unless told); audit every one at the end of the test."""
    yield from audited(impl, block_size=4)


def toks(start: int, n: int) -> list[int]:
    """n distinct token ids from `start` on."""
    return list(range(start, start + n))


def snapshot(m: Manager, ids: range = range(16)) -> dict[str, Any]:
    """Everything observable without changing state."""
    seqs: dict[int, Any] = {}
    for s in ids:
        if s not in m:
            continue
        d: dict[str, Any] = {
            "n": m.num_tokens(s),
            "swapped": m.is_swapped(s),
            "hashes": m.block_hashes(s),
        }
        if not d["swapped"]:
            d["table"] = m.block_table(s)
            d["digest"] = m.table_digest(s)
        seqs[s] = d
    return {
        "len": len(m),
        "seqs": seqs,
        "stats": m.stats().as_dict(),
        "free": m.num_free_blocks,
        "cached": m.num_cached_blocks,
        "available": m.num_available_blocks,
        "free_cpu": m.num_free_cpu_blocks,
    }


def probe(m: Manager) -> list[Any]:
    """Take every available block, one by one, recording which block comes next.

    This exposes the order of the free stack and of the LRU queue, which a snapshot cannot.
    """
    out = []
    i = 0
    while True:
        r = m.allocate(10_000 + i, [900_000 + i])
        if r is None:
            break
        out.append(m.block_table(10_000 + i))
        i += 1
    out.append(m.drain_events())
    return out


def assert_rejected(
    impl_cls: type,
    setup: Callable[[Manager], None],
    call: str | Callable[[Manager], Any],
    exc: type[BaseException],
    match: str | None = None,
    **kw: Any,
) -> BaseException:
    """`call` raises `exc` and changes nothing: compared with a twin that never made the call.

    `call` is a function of the manager, or an expression in `m` (and `np`): the parametrized
    error tables give the call as text, which also names the test case."""
    kw.setdefault("num_blocks", 8)
    kw.setdefault("block_size", 4)
    kw.setdefault("num_cpu_blocks", 4)
    kw.setdefault("enable_kv_events", True)
    nb, bs = kw.pop("num_blocks"), kw.pop("block_size")
    m, twin = impl_cls(nb, bs, **kw), impl_cls(nb, bs, **kw)
    setup(m)
    setup(twin)
    m.drain_events()
    twin.drain_events()
    before = snapshot(m)
    with pytest.raises(exc, match=match) as info:
        if isinstance(call, str):
            eval(call, {"np": np, "m": m})
        else:
            call(m)
    assert snapshot(m) == before
    assert m.drain_events() == []
    m.check_invariants()
    assert snapshot(m) == snapshot(twin)
    assert probe(m) == probe(twin)
    return info.value


def assert_refused(m: Manager, call: Callable[[Manager], Any]) -> None:
    """`call` returns None and changes nothing."""
    m.drain_events()
    before = snapshot(m)
    assert call(m) is None
    assert snapshot(m) == before
    assert m.drain_events() == []


# ------------------------------------------------------------------ construction


def test_construction_and_properties(make):
    m = make(10, 4, num_cpu_blocks=3)
    assert (m.num_blocks, m.block_size) == (10, 4)
    assert (m.num_free_blocks, m.num_cached_blocks, m.num_available_blocks) == (10, 0, 10)
    assert m.num_free_cpu_blocks == 3
    assert len(m) == 0
    assert 0 not in m
    assert m.drain_events() == []
    assert make(5).block_size == 4
    assert isinstance(m.stats(), Stats)


def test_default_block_size_is_16(impl):
    assert impl(4).block_size == 16


@pytest.mark.parametrize(
    "kw",
    [
        {"num_blocks": 0},
        {"num_blocks": -1},
        {"block_size": 0},
        {"num_cpu_blocks": -1},
        {"hash_algo": "md5"},
        {"watermark": -0.1},
        {"watermark": 1.5},
        {"watermark": 1.0},
        {"hash_seed": -1},
        {"hash_seed": 2**64},
    ],
    ids=lambda kw: ",".join(f"{k}={v!r}" for k, v in kw.items()),
)
def test_bad_construction(impl, kw):
    args: dict[str, Any] = {"num_blocks": 8, "block_size": 4, **kw}
    with pytest.raises(InvalidArgumentError):
        impl(args.pop("num_blocks"), args.pop("block_size"), **args)


# ------------------------------------------------------------------ allocate


def test_allocate_takes_fresh_blocks_in_order(make):
    m = make(8)
    assert m.allocate(0, toks(0, 10)) == 0
    assert m.block_table(0) == [0, 1, 2]
    assert m.num_tokens(0) == 10
    assert m.allocate(1, toks(100, 3)) == 0
    assert m.block_table(1) == [3]
    assert (m.num_free_blocks, m.num_cached_blocks) == (4, 0)
    assert len(m) == 2
    assert 0 in m and 1 in m and 2 not in m
    assert not m.is_swapped(0)


def test_allocate_accepts_numpy_and_boundary_values(make):
    m = make(8)
    assert m.allocate(2**64 - 1, np.array([0, 2**32 - 1], dtype=np.uint32)) == 0
    assert m.allocate(1, np.array([1, 2, 3], dtype=np.int64)) == 0
    assert m.allocate(np.uint64(3), [7]) == 0
    assert m.num_tokens(2**64 - 1) == 2
    assert m.num_tokens(3) == 1
    assert m.block_table(1) == [1]
    assert m.allocate(4, [1], lookahead=2**32) is None  # no upper bound but the pool


@pytest.mark.parametrize(
    "dtype",
    ["int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64", ">i8", "<u4"],
)
def test_allocate_accepts_every_integer_dtype(make, dtype):
    m = make(8)
    assert m.allocate(0, np.array([1, 2, 3, 4, 5], dtype=dtype)) == 0
    assert m.block_hashes(0) == ref_hash_blocks([1, 2, 3, 4], 4)
    strided = np.array([1, 9, 2, 9, 3, 9, 4, 9, 5], dtype=dtype)[::2]
    assert m.allocate(1, strided) == 4
    ids = np.array([0, 1], dtype=dtype)
    assert m.block_tables(ids).tolist() == [[0, 1], [0, 2]]


def test_numpy_integer_scalars_are_integers(make):
    m = make(8)
    assert m.allocate(0, [np.int32(7), np.uint64(8), 9]) == 0
    assert m.num_tokens(0) == 3
    assert m.slot_mapping([0], np.int64(2)).tolist() == [1, 2]
    assert m.allocate(1, [1], lookahead=np.int64(4)) == 0
    assert m.block_table(1) == [1, 2]


def test_allocate_prefix_hit(make):
    m = make(8)
    assert m.allocate(0, toks(0, 9)) == 0
    assert m.block_table(0) == [0, 1, 2]
    assert m.allocate(1, toks(0, 9)) == 8
    assert m.block_table(1) == [0, 1, 3]
    assert m.block_hashes(1) == m.block_hashes(0)
    s = m.stats()
    assert (s.prefix_queries, s.prefix_hits) == (18, 8)
    assert s.hit_rate == 8 / 18
    assert s.used_blocks == 4


def test_allocate_hit_is_capped_below_the_prompt(make):
    m = make(8)
    m.allocate(0, toks(0, 8))
    assert m.block_table(0) == [0, 1]
    # Both blocks are cached, but at least one token must be computed: only 1 block hits.
    assert m.allocate(1, toks(0, 8)) == 4
    assert m.block_table(1) == [0, 2]
    # A prompt of one block (or less) never hits.
    assert m.allocate(2, toks(0, 4)) == 0
    assert m.block_table(2) == [3]
    assert m.allocate(3, [0]) == 0
    assert m.block_table(3) == [4]
    # Blocks 2 and 3 duplicate registered content: they stay unhashed and are freed, not cached.
    m.free(1)
    m.free(2)
    assert (m.num_cached_blocks, m.num_free_blocks) == (0, 5)
    m.free(0)
    assert (m.num_cached_blocks, m.num_free_blocks) == (2, 5)  # sequence 3 holds block 4


def test_allocate_hits_cached_blocks_after_free(make):
    m = make(8, enable_kv_events=True)
    m.allocate(0, toks(0, 9))
    m.free(0)
    assert (m.num_cached_blocks, m.num_free_blocks) == (2, 6)
    m.drain_events()
    assert m.allocate(1, toks(0, 9)) == 8
    assert m.block_table(1) == [0, 1, 2]  # hits 0, 1; block 2 was pushed last on the free stack
    assert (m.num_cached_blocks, m.num_free_blocks) == (0, 5)
    assert m.drain_events() == []  # nothing new registered, nothing evicted


def test_allocate_hits_stop_at_first_miss(make):
    m = make(8)
    m.allocate(0, toks(0, 12))
    assert m.allocate(1, [*toks(0, 4), 99, *toks(5, 7)]) == 4
    assert m.block_table(1) == [0, 3, 4]


def test_allocate_need_counts_cached_hits(make):
    m = make(5)
    m.allocate(0, toks(0, 9))  # [0, 1, 2]
    m.allocate(9, toks(100, 4))  # [3]
    m.free(0)  # 2 -> free; 1, 0 -> cached
    assert (m.num_available_blocks, m.num_cached_blocks) == (4, 2)
    # 5 blocks, 2 hits, both cached: need = 3 + 2 = 5 > 4 (3 new blocks alone would fit).
    assert_refused(m, lambda m: m.allocate(1, [*toks(0, 8), *toks(50, 9)]))
    assert 1 not in m
    # 4 blocks, 2 cached hits: need = 2 + 2 = 4: fits exactly.
    assert m.allocate(1, [*toks(0, 8), *toks(50, 8)]) == 8
    assert m.block_table(1) == [0, 1, 2, 4]
    assert m.num_available_blocks == 0


def test_allocate_hits_on_owned_blocks_need_no_extra(make):
    m = make(3)
    m.allocate(0, toks(0, 8))  # [0, 1]
    # 2 blocks, 1 hit that is OWNED: need = 1 <= 1 available.
    assert m.allocate(1, toks(0, 8)) == 4
    assert m.block_table(1) == [0, 2]
    assert m.num_available_blocks == 0


def test_allocate_none_when_full_changes_nothing(make):
    m = make(4, enable_kv_events=True)
    m.allocate(0, toks(0, 8))
    assert_refused(m, lambda m: m.allocate(1, toks(100, 9)))
    s = m.stats()
    assert (s.prefix_queries, s.prefix_hits) == (8, 0)  # a refused call counts nothing
    assert m.allocate(1, toks(100, 8)) == 0
    assert m.block_table(1) == [2, 3]


def test_allocate_lookahead(make):
    m = make(8)
    assert m.allocate(0, toks(0, 5), lookahead=3) == 0
    assert m.block_table(0) == [0, 1]
    assert m.allocate(1, toks(100, 5), lookahead=4) == 0
    assert m.block_table(1) == [2, 3, 4]
    assert m.num_tokens(1) == 5
    # Lookahead blocks are used by later appends without taking new blocks.
    assert m.append(1, toks(105, 7)) == []
    assert m.block_table(1) == [2, 3, 4]
    assert m.num_free_blocks == 3
    s = m.stats()
    assert (s.reserved_slots, s.used_slots) == (5 * 4, 5 + 12)


def test_allocate_salt_isolation(make):
    m = make(16)
    m.allocate(0, toks(0, 9), cache_salt="a")
    assert m.allocate(1, toks(0, 9), cache_salt="b") == 0
    assert m.allocate(2, toks(0, 9)) == 0
    assert m.allocate(3, toks(0, 9), cache_salt=b"a") == 8  # str salts are their UTF-8 bytes
    assert m.block_table(3)[:2] == m.block_table(0)[:2]
    assert m.allocate(4, toks(0, 9), cache_salt="a") == 8
    assert m.block_hashes(0) != m.block_hashes(1)
    assert m.block_hashes(0) != m.block_hashes(2)
    assert m.block_hashes(0) == ref_hash_blocks(toks(0, 9), 4, cache_salt="a")


def test_allocate_lora_isolation(make):
    m = make(16)
    m.allocate(0, toks(0, 9), lora_id=1)
    assert m.allocate(1, toks(0, 9), lora_id=2) == 0
    assert m.allocate(2, toks(0, 9)) == 0
    assert m.allocate(3, toks(0, 9), lora_id=0) == 0
    assert m.allocate(4, toks(0, 9), lora_id=1) == 8
    assert m.allocate(5, toks(0, 9), lora_id=1, cache_salt="x") == 0
    assert m.block_hashes(0) == ref_hash_blocks(toks(0, 9), 4, lora_id=1)


def test_allocate_uses_hash_algo_and_seed(make):
    m = make(8, hash_algo="xxh3_128", hash_seed=5)
    m.allocate(0, toks(0, 8))
    assert m.block_hashes(0) == ref_hash_blocks(toks(0, 8), 4, hash_algo="xxh3_128", seed=5)
    assert all(len(d) == 16 for d in m.block_hashes(0))


def test_allocate_without_prefix_caching(make):
    m = make(8, enable_prefix_caching=False, enable_kv_events=True)
    assert m.allocate(0, toks(0, 9)) == 0
    assert m.allocate(1, toks(0, 9)) == 0
    assert m.block_table(1) == [3, 4, 5]
    assert m.block_hashes(0) == []  # "no digest is computed"
    m.free(0)
    m.free(1)
    assert (m.num_cached_blocks, m.num_free_blocks) == (0, 8)
    s = m.stats()
    assert (s.prefix_queries, s.prefix_hits) == (0, 0)
    assert m.drain_events() == []
    # As in vLLM: the last call's blocks come first (LIFO), each call's tail first.
    m.allocate(2, toks(0, 12))
    assert m.block_table(2) == [5, 4, 3]
    m.allocate(3, toks(0, 16))
    assert m.block_table(3) == [2, 1, 0, 6]


def _one_seq(m: Manager) -> None:
    m.allocate(0, toks(0, 6))


@pytest.mark.parametrize(
    ("call", "exc"),
    [
        ("m.allocate(0, [1])", DuplicateSequenceError),
        ("m.allocate(1, [])", InvalidArgumentError),
        ("m.allocate(1, np.array([], dtype=np.int64))", InvalidArgumentError),
        ("m.allocate(1, [1.0, 2.0])", InvalidArgumentError),
        ("m.allocate(1, np.array([1.0, 2.0]))", InvalidArgumentError),
        ("m.allocate(1, np.array([True, False]))", InvalidArgumentError),
        ("m.allocate(1, [True])", InvalidArgumentError),
        ("m.allocate(1, np.array([[1, 2]], dtype=np.int64))", InvalidArgumentError),
        ("m.allocate(1, [1, -1])", InvalidArgumentError),
        ("m.allocate(1, np.array([1, -1], dtype=np.int64))", InvalidArgumentError),
        ("m.allocate(1, [2**32])", InvalidArgumentError),
        ("m.allocate(1, np.array([2**32], dtype=np.int64))", InvalidArgumentError),
        ("m.allocate(1, [1], lookahead=-1)", InvalidArgumentError),
        ("m.allocate(1, [1], lookahead=1.0)", InvalidArgumentError),
        ("m.allocate(1, [1], lookahead=2**64)", InvalidArgumentError),
        ("m.allocate(-1, [1])", InvalidArgumentError),
        ("m.allocate(2**64, [1])", InvalidArgumentError),
        ("m.allocate(1, [1], cache_salt=3)", InvalidArgumentError),
        ("m.allocate(1, [1], cache_salt=bytearray(b'x'))", InvalidArgumentError),
        ("m.allocate(1, [1], cache_salt='\\udc80')", InvalidArgumentError),
        ("m.allocate(1, [1], lora_id=-1)", InvalidArgumentError),
    ],
)
def test_allocate_errors(impl, call, exc):
    assert_rejected(impl, _one_seq, call, exc)


def test_allocate_duplicate_message(impl):
    e = assert_rejected(impl, _one_seq, lambda m: m.allocate(0, [1]), DuplicateSequenceError)
    assert isinstance(e, ValueError) and isinstance(e, PagedKVError)
    assert "0" in str(e)


# ------------------------------------------------------------------ append


def test_append_fills_and_registers_blocks(make):
    m = make(8, enable_kv_events=True)
    m.allocate(0, [1, 2, 3])
    assert m.block_hashes(0) == []
    assert m.drain_events() == []
    assert m.append(0, [4]) == []
    assert m.block_table(0) == [0]
    d = ref_hash_blocks([1, 2, 3, 4], 4)
    assert m.block_hashes(0) == d
    assert m.drain_events() == [
        BlockStored(
            block_hashes=[d[0]],
            parent_block_hash=None,
            token_ids=[1, 2, 3, 4],
            block_size=4,
            lora_id=None,
            medium="GPU",
        )
    ]
    assert m.append(0, [5]) == []
    assert m.block_table(0) == [0, 1]
    assert m.num_tokens(0) == 5
    assert m.drain_events() == []
    # The registered block is found by a later prompt.
    assert m.allocate(1, [1, 2, 3, 4, 9]) == 4


def test_append_many_tokens_registers_each_full_block_in_order(make):
    m = make(8, enable_kv_events=True)
    m.allocate(0, [1, 2], lora_id=3)
    assert m.append(0, np.array(toks(3, 9), dtype=np.int32)) == []  # 11 tokens
    assert m.block_table(0) == [0, 1, 2]
    d = ref_hash_blocks(toks(1, 11), 4, lora_id=3)
    assert m.block_hashes(0) == d
    ev = m.drain_events()
    assert ev == [
        BlockStored([d[0]], None, [1, 2, 3, 4], 4, 3, "GPU"),
        BlockStored([d[1]], d[0], [5, 6, 7, 8], 4, 3, "GPU"),
    ]


def test_append_copy_on_write_after_fork(make):
    m = make(8)
    m.allocate(0, toks(0, 6))  # [0, 1], block 1 half full
    m.fork(0, 1)
    assert m.append(1, [60]) == [(1, 2)]
    assert m.block_table(1) == [0, 2]
    assert m.block_table(0) == [0, 1]
    assert m.stats().cow_copies == 1
    # Block 1 is no longer shared: the parent appends in place.
    assert m.append(0, [61]) == []
    assert m.block_table(0) == [0, 1]
    assert m.stats().cow_copies == 1
    assert m.num_tokens(0) == m.num_tokens(1) == 7


def test_append_copy_on_write_then_new_blocks(make):
    m = make(8)
    m.allocate(0, toks(0, 6))
    m.fork(0, 1)
    assert m.append(1, toks(6, 7)) == [(1, 2)]  # 13 tokens: write blocks 1..3
    assert m.block_table(1) == [0, 2, 3, 4]
    assert m.block_hashes(1) == ref_hash_blocks(toks(0, 13), 4)


def test_append_copy_on_write_of_an_empty_lookahead_block(make):
    m = make(8)
    m.allocate(0, toks(0, 4), lookahead=1)  # [0, 1]: block 1 is empty
    m.fork(0, 1)
    assert m.append(1, [4]) == [(1, 2)]
    assert m.block_table(1) == [0, 2]


def test_append_after_fork_at_block_boundary_needs_no_copy(make):
    m = make(8)
    m.allocate(0, toks(0, 8))
    m.fork(0, 1)
    assert m.append(1, [8]) == []
    assert m.block_table(1) == [0, 1, 2]
    assert m.block_table(0) == [0, 1]
    assert m.stats().cow_copies == 0


def test_append_none_when_full(make):
    m = make(2)
    m.allocate(0, toks(0, 8))
    assert_refused(m, lambda m: m.append(0, [8]))
    assert m.num_tokens(0) == 8


def test_append_none_when_copy_does_not_fit(make):
    m = make(3)
    m.allocate(0, toks(0, 6))
    m.fork(0, 1)
    m.allocate(2, [99])
    assert m.num_available_blocks == 0
    assert_refused(m, lambda m: m.append(1, [6]))
    assert m.stats().cow_copies == 0


def test_append_evicts_least_recently_released_first(make):
    m = make(4, enable_kv_events=True)
    m.allocate(0, toks(0, 8))  # [0, 1]
    m.allocate(1, toks(100, 8))  # [2, 3]
    da, db = m.block_hashes(0), m.block_hashes(1)
    m.free(0)  # LRU: 1, 0
    m.free(1)  # LRU: 1, 0, 3, 2
    m.drain_events()
    m.allocate(2, [7])
    assert m.block_table(2) == [1]  # the tail of the chain released first
    assert m.append(2, toks(8, 4)) == []
    assert m.block_table(2) == [1, 0]
    ev = m.drain_events()
    assert ev[:2] == [BlockRemoved([da[1]], "GPU"), BlockRemoved([da[0]], "GPU")]
    assert len(ev) == 3 and isinstance(ev[2], BlockStored)  # sequence 2's first block filled
    assert m.stats().evictions == 2
    # B's chain is still cached, head and tail.
    assert m.num_cached_blocks == 2
    assert m.allocate(3, toks(100, 5)) == 4
    assert m.block_table(3) == [2, 3]  # hit on 2; 3 (B's tail, now the oldest) is evicted
    assert m.drain_events() == [BlockRemoved([db[1]], "GPU")]


@pytest.mark.parametrize(
    ("call", "exc"),
    [
        ("m.append(7, [1])", UnknownSequenceError),
        ("m.append(1, [1])", SequenceSwappedError),
        ("m.append(0, [])", InvalidArgumentError),
        ("m.append(0, [-1])", InvalidArgumentError),
        ("m.append(0, [2**32])", InvalidArgumentError),
        ("m.append(0, [0.5])", InvalidArgumentError),
        ("m.append(0, np.zeros((1, 1), dtype=np.int64))", InvalidArgumentError),
    ],
)
def test_append_errors(impl, call, exc):
    def setup(m: Manager) -> None:
        m.allocate(0, toks(0, 6))
        m.allocate(1, toks(0, 3))
        m.swap_out(1)

    assert_rejected(impl, setup, call, exc)


def test_unknown_sequence_error_message(impl):
    e = assert_rejected(impl, _one_seq, lambda m: m.append(7, [1]), UnknownSequenceError)
    assert isinstance(e, KeyError)
    assert isinstance(e, PagedKVError)
    assert "unknown" in str(e).lower() and "7" in str(e)


# ------------------------------------------------------------------ fork


def test_fork_shares_every_block(make):
    m = make(8, enable_kv_events=True)
    m.allocate(0, toks(0, 6), cache_salt="s", lora_id=2)
    m.drain_events()
    m.fork(0, 1)
    assert m.block_table(1) == m.block_table(0) == [0, 1]
    assert m.table_digest(1) == m.table_digest(0)
    assert m.num_tokens(1) == 6
    assert m.block_hashes(1) == m.block_hashes(0)
    s = m.stats()
    assert (s.used_blocks, s.free_blocks, s.num_sequences) == (2, 6, 2)
    assert (s.reserved_slots, s.used_slots) == (16, 12)
    assert m.drain_events() == []
    # The child keeps the salt and the LoRA id: its next full block chains the same way.
    m.append(1, [6, 7])
    assert m.block_hashes(1) == ref_hash_blocks(toks(0, 8), 4, cache_salt="s", lora_id=2)
    # Freeing the parent keeps the shared blocks owned by the child.
    m.free(0)
    assert m.block_table(1) == [0, 2]
    assert m.num_free_blocks == 6
    assert m.num_cached_blocks == 0


def test_fork_never_runs_out_of_blocks(make):
    m = make(2)
    m.allocate(0, toks(0, 8))
    assert m.num_available_blocks == 0
    for child in range(1, 6):
        assert m.fork(0, child) is None
    assert m.block_table(5) == [0, 1]
    assert m.stats().used_blocks == 2


@pytest.mark.parametrize(
    ("call", "exc"),
    [
        ("m.fork(7, 2)", UnknownSequenceError),
        ("m.fork(1, 2)", SequenceSwappedError),
        ("m.fork(0, 1)", DuplicateSequenceError),
        ("m.fork(0, 0)", DuplicateSequenceError),
        ("m.fork(0, -1)", InvalidArgumentError),
    ],
)
def test_fork_errors(impl, call, exc):
    def setup(m: Manager) -> None:
        m.allocate(0, toks(0, 6))
        m.allocate(1, toks(0, 3))
        m.swap_out(1)

    assert_rejected(impl, setup, call, exc)


# ------------------------------------------------------------------ free


def test_free_stack_is_lifo(make):
    m = make(8)
    for s in range(3):
        m.allocate(s, toks(10 * s, 3))  # partial blocks: never hashed
    assert [m.block_table(s) for s in range(3)] == [[0], [1], [2]]
    m.free(0)
    m.free(2)
    assert len(m) == 1 and 0 not in m
    m.allocate(3, toks(100, 8))
    assert m.block_table(3) == [2, 0]
    m.allocate(4, [1])
    assert m.block_table(4) == [3]


def test_free_releases_tail_first(make):
    m = make(8)
    m.allocate(0, toks(0, 10))  # [0, 1, 2]: 0, 1 full (cached on free), 2 partial
    m.allocate(1, toks(100, 11))  # [3, 4, 5]
    m.free(1)
    m.free(0)
    assert (m.num_cached_blocks, m.num_free_blocks) == (4, 4)
    # The free stack got 5 then 2: 2 is on top.
    m.allocate(2, [1000])
    m.allocate(3, [1001])
    assert [m.block_table(2), m.block_table(3)] == [[2], [5]]
    # LRU: 4, 3 (sequence 1, tail first), then 1, 0.
    got = []
    for s in range(4, 10):
        m.allocate(s, [2000 + s])
        got.append(m.block_table(s)[0])
    assert got == [6, 7, 4, 3, 1, 0]
    assert m.allocate(10, [1]) is None


def test_free_swapped_returns_cpu_blocks_tail_first(make):
    m = make(8, num_cpu_blocks=4)
    m.allocate(0, toks(0, 8))
    assert m.swap_out(0) == [(0, 0), (1, 1)]
    assert m.num_free_cpu_blocks == 2
    m.free(0)
    assert m.num_free_cpu_blocks == 4
    assert 0 not in m
    m.allocate(1, toks(100, 3))
    assert m.swap_out(1) == [(2, 0)]  # CPU 1 was pushed first, then 0


@pytest.mark.parametrize(
    ("call", "exc"),
    [
        ("m.free(7)", UnknownSequenceError),
        ("m.free(-1)", InvalidArgumentError),
    ],
)
def test_free_errors(impl, call, exc):
    assert_rejected(impl, _one_seq, call, exc)


def test_free_twice(make):
    m = make(8)
    m.allocate(0, [1])
    m.free(0)
    with pytest.raises(UnknownSequenceError):
        m.free(0)


# ------------------------------------------------------------------ swap


def test_swap_out_and_in(make):
    m = make(8, num_cpu_blocks=4, enable_kv_events=True)
    m.allocate(0, toks(0, 6))  # [0, 1]
    d = m.block_hashes(0)
    m.drain_events()
    assert m.swap_out(0) == [(0, 0), (1, 1)]
    # Its one registered block now also lives on the CPU (an indexer tracks the medium).
    assert m.drain_events() == [BlockStored([d[0]], None, list(toks(0, 4)), 4, None, medium="CPU")]
    assert m.is_swapped(0)
    assert 0 in m and len(m) == 1
    assert m.num_tokens(0) == 6
    assert m.block_hashes(0) == d
    assert m.num_free_cpu_blocks == 2
    assert (m.num_cached_blocks, m.num_free_blocks) == (1, 7)  # block 0 cached, findable
    s = m.stats()
    assert s.swapped_out_blocks == 2
    assert (s.reserved_slots, s.used_slots, s.num_sequences) == (0, 0, 1)
    with pytest.raises(SequenceSwappedError):
        m.block_table(0)
    # Another prompt hits the cached block; it takes block 1, released by the swap.
    assert m.allocate(1, [*toks(0, 4), 9]) == 4
    assert m.block_table(1) == [0, 1]
    assert m.can_swap_in(0) == AllocStatus.OK
    assert m.swap_in(0) == [(0, 2), (1, 3)]
    assert not m.is_swapped(0)
    assert m.block_table(0) == [2, 3]
    assert m.num_free_cpu_blocks == 4
    assert m.stats().swapped_in_blocks == 2
    # The CPU copy is gone; the digest is already registered (block 0), so block 2 stays
    # unhashed and no GPU event follows.
    assert m.drain_events() == [BlockRemoved([d[0]], medium="CPU")]
    m.free(1)
    m.free(0)
    assert m.num_cached_blocks == 1
    # The CPU free stack got 1 then 0 back: 0 is popped first again.
    m.allocate(2, toks(50, 3))
    assert m.swap_out(2)[0][1] == 0


def test_swap_in_reregisters_evicted_blocks(make):
    m = make(4, num_cpu_blocks=4, enable_kv_events=True)
    m.allocate(0, toks(0, 8))
    d = m.block_hashes(0)
    assert m.swap_out(0) == [(0, 0), (1, 1)]
    m.allocate(1, toks(100, 16))  # takes 2, 3, then evicts 1 and 0
    assert m.block_table(1) == [2, 3, 1, 0]
    m.free(1)
    m.drain_events()
    assert m.swap_in(0) is not None
    tbl = m.block_table(0)
    ev = m.drain_events()
    assert ev[-2:] == [
        BlockStored([d[0]], None, toks(0, 4), 4, None, "GPU"),
        BlockStored([d[1]], d[0], toks(4, 4), 4, None, "GPU"),
    ]
    m.free(0)
    assert m.allocate(2, toks(0, 9)) == 8
    assert m.block_table(2)[:2] == tbl


def test_swap_out_none_when_cpu_space_is_short(make):
    m = make(8, num_cpu_blocks=1)
    m.allocate(0, toks(0, 5))
    assert_refused(m, lambda m: m.swap_out(0))
    assert not m.is_swapped(0)
    assert m.stats().swapped_out_blocks == 0


def test_swap_out_counts_lookahead_blocks(make):
    m = make(8, num_cpu_blocks=4)
    m.allocate(0, [1], lookahead=5)
    assert m.swap_out(0) == [(0, 0), (1, 1)]
    # Swap-out freed the GPU blocks tail first: block 1 is on top of the free stack.
    assert m.swap_in(0) == [(0, 1), (1, 0)]


def test_swap_in_none_when_gpu_is_short(make):
    m = make(2, num_cpu_blocks=4)
    m.allocate(0, toks(0, 8))
    m.swap_out(0)
    m.allocate(1, toks(100, 5))
    assert m.can_swap_in(0) == AllocStatus.LATER
    assert_refused(m, lambda m: m.swap_in(0))
    assert m.is_swapped(0)


def test_swap_of_forked_sequence(make):
    m = make(8, num_cpu_blocks=4)
    m.allocate(0, toks(0, 6))
    m.fork(0, 1)
    assert m.swap_out(1) == [(0, 0), (1, 1)]
    assert m.block_table(0) == [0, 1]
    assert m.stats().used_blocks == 2
    assert m.append(0, [6]) == []  # no longer shared


@pytest.mark.parametrize(
    ("call", "exc"),
    [
        ("m.swap_out(7)", UnknownSequenceError),
        ("m.swap_in(7)", UnknownSequenceError),
        ("m.can_swap_in(7)", UnknownSequenceError),
        ("m.swap_out(1)", SequenceSwappedError),
        ("m.swap_in(0)", SequenceNotSwappedError),
        ("m.can_swap_in(0)", SequenceNotSwappedError),
        ("m.block_table(1)", SequenceSwappedError),
    ],
)
def test_swap_errors(impl, call, exc):
    def setup(m: Manager) -> None:
        m.allocate(0, toks(0, 6))
        m.allocate(1, toks(0, 3))
        m.swap_out(1)

    assert_rejected(impl, setup, call, exc)


# ------------------------------------------------------------------ can_allocate


def test_can_allocate_with_watermark(make):
    m = make(100, 4, watermark=0.1)  # watermark_blocks = 10
    assert m.can_allocate(1) == AllocStatus.OK
    assert m.can_allocate(4 * 90) == AllocStatus.OK
    assert m.can_allocate(4 * 90 + 1) == AllocStatus.NEVER
    assert m.can_allocate(4 * 100) == AllocStatus.NEVER
    m.allocate(0, toks(0, 4 * 20))
    assert m.can_allocate(4 * 70) == AllocStatus.OK
    assert m.can_allocate(4 * 70 + 1) == AllocStatus.LATER
    assert m.can_allocate(4 * 90) == AllocStatus.LATER
    assert m.can_allocate(4 * 91) == AllocStatus.NEVER
    # allocate itself ignores the watermark.
    assert m.allocate(1, toks(1000, 4 * 80)) == 0
    assert m.num_available_blocks == 0
    assert m.can_allocate(1) == AllocStatus.LATER
    # Neither call counts prefix lookups.
    assert m.stats().prefix_queries == 4 * 100


def test_can_allocate_counts_cached_blocks_as_available(make):
    m = make(4, watermark=0.0)
    m.allocate(0, toks(0, 16))
    assert m.can_allocate(1) == AllocStatus.LATER
    m.free(0)
    assert m.num_cached_blocks == 4
    assert m.can_allocate(16) == AllocStatus.OK
    assert m.can_allocate(17) == AllocStatus.NEVER


def test_default_watermark_is_one_percent(make):
    m = make(200)  # watermark_blocks = 2
    assert m.can_allocate(4 * 198) == AllocStatus.OK
    assert m.can_allocate(4 * 199) == AllocStatus.NEVER


def test_can_swap_in_with_watermark(make):
    m = make(10, num_cpu_blocks=12, watermark=0.2, enable_prefix_caching=False)  # wm 2 blocks
    m.allocate(1, toks(100, 4 * 3))
    assert m.swap_out(1) is not None
    m.allocate(0, toks(0, 4 * 9))
    assert m.swap_out(0) is not None
    assert m.can_swap_in(0) == AllocStatus.NEVER
    assert m.can_swap_in(1) == AllocStatus.OK
    m.allocate(2, toks(200, 4 * 6), lookahead=0)
    assert m.can_swap_in(1) == AllocStatus.LATER  # 4 available - 3 < 2
    m.free(2)
    # swap_in ignores the watermark too.
    assert m.swap_in(0) is not None
    assert m.num_available_blocks == 1


@pytest.mark.parametrize(
    ("call", "exc"),
    [
        ("m.can_allocate(0)", InvalidArgumentError),
        ("m.can_allocate(-4)", InvalidArgumentError),
    ],
)
def test_can_allocate_errors(impl, call, exc):
    assert_rejected(impl, _one_seq, call, exc)


# ------------------------------------------------------------------ batch calls


def test_append_batch(make):
    m = make(8)
    m.allocate(0, toks(0, 4))  # [0]
    m.allocate(1, toks(10, 2))  # [1]
    m.fork(1, 2)
    out = m.append_batch([0, 1, 2], [4, 16, 26])
    assert isinstance(out, np.ndarray)
    assert out.dtype == np.int32 and out.shape == (1, 2)
    assert out.tolist() == [[1, 3]]  # 0 gets new block 2; 1 copies block 1 to 3
    assert m.block_table(0) == [0, 2]
    assert m.block_table(1) == [3]
    assert m.block_table(2) == [1]  # the fork now owns block 1 alone: no second copy
    assert [m.num_tokens(s) for s in range(3)] == [5, 3, 3]
    assert m.stats().cow_copies == 1
    none = m.append_batch(np.array([0, 1], dtype=np.int64), np.array([5, 17], dtype=np.uint32))
    assert none is not None and none.shape == (0, 2) and none.dtype == np.int32


def test_append_batch_need_is_summed_before_appending(make):
    m = make(3)
    m.allocate(0, toks(0, 6))  # [0, 1]
    m.fork(0, 1)
    assert m.num_available_blocks == 1
    # Each sequence alone would need one copy: 2 > 1, even though after the first copy the
    # second would not need one.
    assert_refused(m, lambda m: m.append_batch([0, 1], [6, 6]))
    out = m.append_batch([1], [6])
    assert out is not None and out.tolist() == [[1, 2]]


def test_append_batch_when_both_copies_fit(make):
    m = make(4)
    m.allocate(0, toks(0, 6))
    m.fork(0, 1)
    out = m.append_batch([0, 1], [6, 6])
    assert out is not None and out.tolist() == [[1, 2]]
    assert m.block_table(0) == [0, 2]
    assert m.block_table(1) == [0, 1]
    assert m.stats().cow_copies == 1


def test_append_batch_none_when_full(make):
    m = make(3)
    m.allocate(0, toks(0, 4))
    m.allocate(1, toks(10, 4))
    m.allocate(2, toks(20, 3))
    assert_refused(m, lambda m: m.append_batch([2, 0, 1], [1, 2, 3]))
    assert m.num_tokens(2) == 3


@pytest.mark.parametrize(
    ("call", "exc"),
    [
        ("m.append_batch([0, 7], [1, 2])", UnknownSequenceError),
        ("m.append_batch([0, 1], [1, 2])", SequenceSwappedError),
        ("m.append_batch([0, 2], [1])", InvalidArgumentError),
        ("m.append_batch([0, 0], [1, 2])", InvalidArgumentError),
        ("m.append_batch([0, 2], [1, -2])", InvalidArgumentError),
        ("m.append_batch([0, 2], [1.0, 2.0])", InvalidArgumentError),
        ("m.append_batch(np.array([[0, 2]]), [1, 2])", InvalidArgumentError),
        ("m.append_batch(np.array([0.0, 2.0]), [1, 2])", InvalidArgumentError),
        ("m.append_batch([0, -2], [1, 2])", InvalidArgumentError),
    ],
)
def test_append_batch_errors(impl, call, exc):
    def setup(m: Manager) -> None:
        m.allocate(0, toks(0, 4))
        m.allocate(1, toks(0, 3))
        m.swap_out(1)
        m.allocate(2, toks(0, 6))

    assert_rejected(impl, setup, call, exc)


def test_free_batch(make):
    m = make(8, num_cpu_blocks=2)
    for s in range(3):
        m.allocate(s, toks(10 * s, 3))
    m.swap_out(1)
    assert m.free_batch(np.array([2, 1, 0], dtype=np.uint64)) is None
    assert len(m) == 0
    assert m.num_free_cpu_blocks == 2
    # Freed in the given order: 2 pushed, then 0 (1 was swapped): 0 is on top.
    m.allocate(5, toks(100, 8))
    assert m.block_table(5) == [0, 2]


@pytest.mark.parametrize(
    ("call", "exc"),
    [
        ("m.free_batch([0, 7])", UnknownSequenceError),
        ("m.free_batch([0, 0])", InvalidArgumentError),
        ("m.free_batch([0, -1])", InvalidArgumentError),
        ("m.free_batch(np.array([[0]]))", InvalidArgumentError),
    ],
)
def test_free_batch_errors(impl, call, exc):
    assert_rejected(impl, _one_seq, call, exc)


def test_block_tables(make):
    m = make(16, num_cpu_blocks=4)
    m.allocate(0, toks(0, 9))  # [0, 1, 2]
    m.allocate(1, toks(100, 2))  # [3]
    m.allocate(2, toks(200, 5), lookahead=4)  # [4, 5, 6]
    bt = m.block_tables([1, 0, 2])
    assert bt.dtype == np.int32 and bt.shape == (3, 3)
    assert bt.tolist() == [[3, -1, -1], [0, 1, 2], [4, 5, 6]]
    assert m.block_tables(np.array([1], dtype=np.int64), pad=0).tolist() == [[3]]
    assert m.block_tables([1, 0], pad=99).tolist() == [[3, 99, 99], [0, 1, 2]]


def test_slot_mapping(make):
    m = make(16)
    m.allocate(0, toks(0, 2))  # block 0: slots 0, 1
    m.allocate(1, toks(100, 6))  # blocks 1, 2
    m.allocate(2, toks(200, 9))  # blocks 3, 4, 5
    sm = m.slot_mapping([0, 1, 2], 1)
    assert sm.dtype == np.int64
    assert sm.tolist() == [1, 9, 20]
    sm = m.slot_mapping([1, 2, 0], [3, 2, 2])
    assert sm.tolist() == [7, 8, 9, 19, 20, 0, 1]
    sm = m.slot_mapping(np.array([1]), np.array([6]))
    assert sm.tolist() == [4, 5, 6, 7, 8, 9]
    # Slots follow the table after copy-on-write.
    m.fork(1, 3)
    m.append(3, [7])
    assert m.block_table(3) == [1, 6]
    assert m.slot_mapping([3], 3).tolist() == [24, 25, 26]


@pytest.mark.parametrize(
    ("call", "exc"),
    [
        ("m.slot_mapping([0], 0)", InvalidArgumentError),
        ("m.slot_mapping([0], 7)", InvalidArgumentError),
        ("m.slot_mapping([0, 2], [1])", InvalidArgumentError),
        ("m.slot_mapping([0, 2], [1, 0])", InvalidArgumentError),
        ("m.slot_mapping([0], -1)", InvalidArgumentError),
        ("m.slot_mapping([7], 1)", UnknownSequenceError),
        ("m.slot_mapping([0, 1], 1)", SequenceSwappedError),
        ("m.block_tables([0, 7])", UnknownSequenceError),
        ("m.block_tables([0, 1])", SequenceSwappedError),
        ("m.block_tables([0, -1])", InvalidArgumentError),
        ("m.block_tables([0], pad=2**31)", InvalidArgumentError),
        ("m.flashinfer_page_table([7])", UnknownSequenceError),
        ("m.flashinfer_page_table([2, 1])", SequenceSwappedError),
        ("m.flashinfer_page_table(np.array([[0]]))", InvalidArgumentError),
    ],
)
def test_query_batch_errors(impl, call, exc):
    def setup(m: Manager) -> None:
        m.allocate(0, toks(0, 6))
        m.allocate(1, toks(0, 3))
        m.swap_out(1)
        m.allocate(2, toks(0, 6))

    assert_rejected(impl, setup, call, exc)


def test_flashinfer_page_table(make):
    m = make(16)
    m.allocate(0, toks(0, 8))  # [0, 1], last page full
    m.allocate(1, toks(100, 1), lookahead=6)  # [2, 3]: only 1 page in use
    m.allocate(2, toks(200, 9))  # [4, 5, 6]
    indptr, indices, last = m.flashinfer_page_table([0, 1, 2])
    assert indptr.dtype == indices.dtype == last.dtype == np.int32
    assert indptr.tolist() == [0, 2, 3, 6]
    assert indices.tolist() == [0, 1, 2, 4, 5, 6]
    assert last.tolist() == [4, 1, 1]
    indptr, indices, last = m.flashinfer_page_table(np.array([2], dtype=np.int64))
    assert (indptr.tolist(), indices.tolist(), last.tolist()) == ([0, 3], [4, 5, 6], [1])


# ------------------------------------------------------------------ queries


@pytest.mark.parametrize(
    "call",
    [
        "m.block_table(7)",
        "m.num_tokens(7)",
        "m.table_digest(7)",
        "m.block_hashes(7)",
        "m.is_swapped(7)",
    ],
)
def test_queries_on_unknown_sequences(impl, call):
    e = assert_rejected(impl, _one_seq, call, UnknownSequenceError)
    assert "7" in str(e)


def test_queries(make):
    m = make(8, num_cpu_blocks=2)
    m.allocate(0, toks(0, 9))
    m.allocate(1, toks(0, 9))
    m.fork(0, 2)
    assert m.block_table(0) == [0, 1, 2]
    assert isinstance(m.table_digest(0), int)
    assert 0 <= m.table_digest(0) < 2**64
    assert m.table_digest(0) == m.table_digest(2)
    assert m.num_tokens(1) == 9
    assert len(m.block_hashes(1)) == 2
    assert all(isinstance(d, bytes) and len(d) == 32 for d in m.block_hashes(1))
    assert m.block_hashes(0) == m.block_hashes(1) == ref_hash_blocks(toks(0, 9), 4)
    assert len(m) == 3
    assert 2 in m and 5 not in m
    assert not m.is_swapped(1)
    m.free(2)
    m.allocate(3, [1])
    assert m.swap_out(3) == [(4, 0)]
    assert m.is_swapped(3)
    assert m.num_tokens(3) == 1
    assert m.block_hashes(3) == []


# ------------------------------------------------------------------ stats


def test_stats_fields(make):
    m = make(10, 4, num_cpu_blocks=5)
    m.allocate(0, toks(0, 10))  # [0, 1, 2]
    m.allocate(1, toks(0, 9))  # hits 8: [0, 1, 3]
    m.fork(1, 2)
    m.append(2, [9])  # copy 3 -> 4
    m.allocate(3, toks(100, 5))  # [5, 6]
    m.swap_out(3)
    m.allocate(4, toks(200, 8))  # [6, 7]
    m.free(4)  # cached: 5 (swapped out, full), 7, 6
    s = m.stats()
    assert isinstance(s, Stats)
    assert s.num_blocks == 10 and s.block_size == 4
    assert s.used_blocks == 5  # 0, 1, 2, 3, 4
    assert s.cached_blocks == 3
    assert s.free_blocks == 2
    assert s.free_blocks + s.used_blocks + s.cached_blocks == 10
    assert (s.num_cpu_blocks, s.free_cpu_blocks) == (5, 3)
    assert s.num_sequences == 4
    assert (s.prefix_queries, s.prefix_hits) == (10 + 9 + 5 + 8, 8)
    assert s.evictions == 0
    assert s.cow_copies == 1
    assert (s.swapped_out_blocks, s.swapped_in_blocks) == (2, 0)
    assert s.reserved_slots == 3 * 3 * 4
    assert s.used_slots == 10 + 9 + 10
    assert s.usage == 0.5
    assert s.hit_rate == 8 / 32
    assert s.fragmentation == 1 - 29 / 36
    d = s.as_dict()
    assert d["usage"] == 0.5 and d["cow_copies"] == 1
    assert s == m.stats()


def test_stats_empty(make):
    s = make(4).stats()
    assert (s.usage, s.hit_rate, s.fragmentation) == (0.0, 0.0, 0.0)
    assert (s.free_blocks, s.used_blocks, s.num_sequences) == (4, 0, 0)


def test_print_memory_stats(make, capsys):
    m = make(8)
    m.allocate(0, toks(0, 5))
    m.print_memory_stats()
    out = capsys.readouterr().out
    assert out.strip() == str(m.stats())
    assert "GPU blocks  8 x 4 tokens: 2 used" in out


# ------------------------------------------------------------------ reset_prefix_cache


def test_reset_prefix_cache_refused_while_blocks_are_owned(make):
    m = make(8, enable_kv_events=True)
    m.allocate(0, toks(0, 8))
    m.allocate(1, toks(100, 8))
    m.free(0)
    m.drain_events()
    before = snapshot(m)
    assert m.reset_prefix_cache() is False
    assert snapshot(m) == before
    assert m.drain_events() == []
    assert m.allocate(2, toks(0, 9)) == 8  # the cache still hits


def test_reset_prefix_cache(make):
    m = make(4, num_cpu_blocks=2, enable_kv_events=True)
    m.allocate(0, toks(0, 4))  # [0]
    m.allocate(1, toks(100, 4))  # [1]
    m.allocate(2, [7])  # [2]
    m.swap_out(2)  # a swapped sequence holds no GPU block
    m.free(0)
    m.free(1)  # LRU: 0, 1
    assert m.num_cached_blocks == 2
    m.drain_events()
    assert m.reset_prefix_cache() is True
    assert (m.num_cached_blocks, m.num_free_blocks) == (0, 4)
    assert m.drain_events() == [AllBlocksCleared()]
    assert m.stats().evictions == 0
    # As in vLLM, the formerly cached blocks come after the free ones (2, freed by the swap,
    # then 3, never used), oldest release first.
    assert m.allocate(3, toks(0, 5)) == 0
    assert m.block_table(3) == [2, 3]
    assert m.swap_in(2) == [(0, 0)]
    # Resetting an empty cache still succeeds.
    m.free_batch([2, 3])
    m.drain_events()
    assert m.reset_prefix_cache() is True
    assert m.drain_events() == [AllBlocksCleared()]
    assert m.reset_prefix_cache() is True
    assert (m.num_cached_blocks, m.num_free_blocks) == (0, 4)


# ------------------------------------------------------------------ events


def test_events_disabled_by_default(make):
    m = make(2)
    m.allocate(0, toks(0, 8))
    m.free(0)
    m.allocate(1, toks(10, 8))
    assert m.stats().evictions == 2
    assert m.drain_events() == []


def test_drain_events_empties_the_queue(make):
    m = make(4, enable_kv_events=True)
    m.allocate(0, toks(0, 4), lora_id=9)
    ev = m.drain_events()
    assert len(ev) == 1 and isinstance(ev[0], BlockStored)
    assert ev[0].lora_id == 9 and ev[0].token_ids == [0, 1, 2, 3] and ev[0].block_size == 4
    assert ev[0].medium == "GPU"
    assert m.drain_events() == []


def test_eviction_events_in_order(make):
    m = make(3, enable_kv_events=True)
    m.allocate(0, toks(0, 12))
    d = m.block_hashes(0)
    stored = m.drain_events()
    assert [e.block_hashes for e in stored] == [[d[0]], [d[1]], [d[2]]]
    assert [e.parent_block_hash for e in stored] == [None, d[0], d[1]]
    m.free(0)
    m.allocate(1, toks(100, 5))
    ev = m.drain_events()
    assert ev[:2] == [BlockRemoved([d[2]], "GPU"), BlockRemoved([d[1]], "GPU")]
    assert isinstance(ev[2], BlockStored) and ev[2].token_ids == toks(100, 4)
    assert m.block_table(1) == [2, 1]


# ------------------------------------------------------------------ errors, invariants


def test_error_hierarchy():
    assert issubclass(UnknownSequenceError, KeyError)
    for value_error in (DuplicateSequenceError, SequenceSwappedError, InvalidArgumentError):
        assert issubclass(value_error, ValueError)
    for cls in (
        UnknownSequenceError,
        DuplicateSequenceError,
        SequenceSwappedError,
        InvalidArgumentError,
        InvariantError,
    ):
        assert issubclass(cls, PagedKVError)
    assert issubclass(InvariantError, AssertionError)
    assert str(UnknownSequenceError("unknown sequence id 7")) == "unknown sequence id 7"


def test_errors_are_caught_by_builtin_excepts(make):
    m = make(4)
    m.allocate(0, [1])
    with pytest.raises(KeyError):
        m.free(3)
    with pytest.raises(ValueError, match="0"):
        m.allocate(0, [1])
    with pytest.raises(ValueError):
        m.allocate(1, [])


def test_check_invariants_passes_on_a_busy_manager(make):
    m = make(6, 2, num_cpu_blocks=3)
    m.allocate(0, [1, 2, 3, 4, 5])
    m.fork(0, 1)
    m.append(1, [6, 7])
    m.allocate(2, [1, 2, 3, 4, 9])
    m.swap_out(2)
    m.free(0)
    assert m.check_invariants() is None


def test_reference_check_invariants_detects_corruption():
    m = ReferenceBlockManager(4, 4)
    m.allocate(0, toks(0, 5))
    m.check_invariants()
    m._rc[0] += 1  # corrupt a refcount
    with pytest.raises(InvariantError, match="refcount"):
        m.check_invariants()
    m._rc[0] -= 1
    m._free.append(0)  # a block both owned and free
    with pytest.raises(InvariantError):
        m.check_invariants()
