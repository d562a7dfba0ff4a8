"""Bad input and faults: every public method, every kind of wrong argument a user could send.

Each bad call must raise a clear exception (a `PagedKVError` subclass naming the argument, or a
`TypeError` for the two arguments PyO3 types itself) and leave the manager exactly as it was:
the snapshot (stats, every table, token count, digests, swap state, free and cached counts,
pending events) is compared before and after, and the audit runs after each call. Running
out of blocks at any point of a batch, and a Python exception raised by an iterator that
the API is consuming, must leave nothing half done either.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

import pagedkv
from pagedkv import (
    BlockManager,
    DuplicateSequenceError,
    InvalidArgumentError,
    PagedKVError,
    SequenceSwappedError,
    UnknownSequenceError,
)

B = 4
RESIDENT, SWAPPED, FORKED, FREED, NEVER = 0, 1, 2, 3, 77


def _setup() -> BlockManager:
    """Resident, swapped, forked (shared blocks), freed (cached blocks) sequences."""
    m = BlockManager(24, B, num_cpu_blocks=4, enable_kv_events=True)
    m.allocate(RESIDENT, list(range(10)))
    m.allocate(SWAPPED, list(range(100, 105)))
    assert m.swap_out(SWAPPED) is not None
    m.fork(RESIDENT, FORKED)
    m.allocate(FREED, list(range(200, 209)))
    m.free(FREED)
    m.drain_events()
    return m


def _snapshot(m: BlockManager) -> dict[str, Any]:
    seqs = {}
    for s in (RESIDENT, SWAPPED, FORKED, FREED, NEVER, 5, 6):
        if s in m:
            swapped = m.is_swapped(s)
            seqs[s] = (
                m.num_tokens(s),
                swapped,
                m.block_hashes(s),
                None if swapped else (m.block_table(s), m.table_digest(s)),
            )
    return {
        "seqs": seqs,
        "len": len(m),
        "stats": m.stats().as_dict(),
        "counts": (m.num_free_blocks, m.num_cached_blocks, m.num_available_blocks),
        "cpu": m.num_free_cpu_blocks,
    }


def _assert_unchanged(m: BlockManager, before: dict[str, Any]) -> None:
    assert _snapshot(m) == before
    assert m.drain_events() == [], "a refused call emitted events"
    m.check_invariants()


BAD_IDS = [-1, 2**64, 2**100, 1.0, float("nan"), None, "0", b"0", [0], True, np.float64(0)]
BAD_TOKENS = [
    [],
    np.array([], dtype=np.int64),
    "ab",
    b"ab",
    None,
    3,
    1.5,
    [1.5],
    [float("nan")],
    [-1],
    [2**32],
    [2**64],
    [None],
    [True],
    ["1"],
    {1, 2},
    {1: 2},
    np.array([1.5]),
    np.array([np.nan]),
    np.array([True]),
    np.array([[1]]),
    np.array(1),
    np.array([1], dtype=np.complex64),
    np.array(["1"]),
    np.array([1], dtype=object),
    np.array([-1], dtype=np.int8),
    np.array([2**32], dtype=np.uint64),
    np.array([[1, 2], [3, 4]]).T,
]
BAD_COUNTS = [0, -1, 2**63, 1.5, float("nan"), None, "1", [1.5], np.array([0.5]), {1}]

# (call, exception) with `m` the set-up manager; each is also an id for the test report.
CASES: list[tuple[str, type[BaseException]]] = [
    # allocate
    *[(f"m.allocate({i!r}, [1])", InvalidArgumentError) for i in BAD_IDS],
    *[(f"m.allocate(5, {t!r})", InvalidArgumentError) for t in range(len(BAD_TOKENS))],
    ("m.allocate(RESIDENT, [1])", DuplicateSequenceError),
    ("m.allocate(SWAPPED, [1])", DuplicateSequenceError),
    *[
        (f"m.allocate(5, [1], lookahead={v!r})", InvalidArgumentError)
        for v in [-1, 2**63, 2**64, 1.5, float("nan"), "1"]
    ],
    *[
        (f"m.allocate(5, [1], cache_salt={v!r})", InvalidArgumentError)
        for v in [3, float("nan"), bytearray(b"x"), ["a"], "\udc80"]
    ],
    *[
        (f"m.allocate(5, [1], lora_id={v!r})", InvalidArgumentError)
        for v in [-1, 2**64, 1.5, "x", float("nan")]
    ],
    # append
    *[(f"m.append({i!r}, [1])", InvalidArgumentError) for i in BAD_IDS],
    *[(f"m.append(RESIDENT, {t!r})", InvalidArgumentError) for t in range(len(BAD_TOKENS))],
    ("m.append(NEVER, [1])", UnknownSequenceError),
    ("m.append(FREED, [1])", UnknownSequenceError),
    ("m.append(SWAPPED, [1])", SequenceSwappedError),
    # fork
    *[(f"m.fork({i!r}, 5)", InvalidArgumentError) for i in BAD_IDS],
    *[(f"m.fork(RESIDENT, {i!r})", InvalidArgumentError) for i in BAD_IDS],
    ("m.fork(NEVER, 5)", UnknownSequenceError),
    ("m.fork(FREED, 5)", UnknownSequenceError),
    ("m.fork(SWAPPED, 5)", SequenceSwappedError),
    ("m.fork(RESIDENT, FORKED)", DuplicateSequenceError),
    ("m.fork(RESIDENT, RESIDENT)", DuplicateSequenceError),
    # free, swap
    *[
        (f"m.{f}({i!r})", InvalidArgumentError)
        for f in ("free", "swap_out", "swap_in")
        for i in BAD_IDS
    ],
    ("m.free(NEVER)", UnknownSequenceError),
    ("m.free(FREED)", UnknownSequenceError),
    ("m.swap_out(NEVER)", UnknownSequenceError),
    ("m.swap_out(SWAPPED)", SequenceSwappedError),
    ("m.swap_in(FREED)", UnknownSequenceError),
    ("m.swap_in(RESIDENT)", SequenceSwappedError),
    # can_allocate, can_swap_in
    *[
        (f"m.can_allocate({v!r})", InvalidArgumentError)
        for v in [0, -4, 2**63, 1.5, float("nan"), None, "1", [1]]
    ],
    *[(f"m.can_swap_in({i!r})", InvalidArgumentError) for i in BAD_IDS],
    ("m.can_swap_in(NEVER)", UnknownSequenceError),
    ("m.can_swap_in(RESIDENT)", SequenceSwappedError),
    # batch calls
    *[
        (f"m.append_batch({ids}, {toks})", InvalidArgumentError)
        for ids, toks in [
            ("[0, 2]", "[1]"),
            ("[0, 0]", "[1, 2]"),
            ("[0, -1]", "[1, 2]"),
            ("[0, 2**64]", "[1, 2]"),
            ("[0, 2]", "[1, -2]"),
            ("[0, 2]", "[1, 2**32]"),
            ("[0, 2]", "[1.0, 2.0]"),
            ("[0, 2]", "np.array([1.0, 2.0])"),
            ("np.array([[0, 2]])", "[1, 2]"),
            ("np.array([0.0, 2.0])", "[1, 2]"),
            ("'ab'", "'ab'"),
            ("None", "None"),
            ("{0, 2}", "[1, 2]"),
            ("[0, 2]", "[[1], [2]]"),
        ]
    ],
    ("m.append_batch([0, NEVER], [1, 2])", UnknownSequenceError),
    ("m.append_batch([FREED, 0], [1, 2])", UnknownSequenceError),
    ("m.append_batch([0, SWAPPED], [1, 2])", SequenceSwappedError),
    *[
        (f"m.free_batch({ids})", InvalidArgumentError)
        for ids in ["[0, 0]", "[0, -1]", "np.array([[0]])", "'ab'", "None", "[0.5]", "{0}"]
    ],
    ("m.free_batch([0, NEVER])", UnknownSequenceError),
    ("m.free_batch([FREED, 0])", UnknownSequenceError),
    *[
        (f"m.{f}({ids})", InvalidArgumentError)
        for f in ("block_tables", "flashinfer_page_table")
        for ids in ["[0, -1]", "np.array([[0]])", "'ab'", "None", "[0.5]", "np.array([0.5])", "{0}"]
    ],
    *[
        (f"m.block_tables([0], pad={v!r})", InvalidArgumentError)
        for v in [2**31, -(2**31) - 1, 1.5, float("nan"), "x"]
    ],
    ("m.block_tables([0, NEVER])", UnknownSequenceError),
    ("m.block_tables([0, SWAPPED])", SequenceSwappedError),
    ("m.flashinfer_page_table([FREED])", UnknownSequenceError),
    ("m.flashinfer_page_table([SWAPPED])", SequenceSwappedError),
    *[(f"m.slot_mapping([0], {c!r})", InvalidArgumentError) for c in BAD_COUNTS],
    ("m.slot_mapping([0], 11)", InvalidArgumentError),
    ("m.slot_mapping([0, 2], [1])", InvalidArgumentError),
    ("m.slot_mapping([0, 2], [2**62, 2**62])", InvalidArgumentError),
    ("m.slot_mapping([0, -1], 1)", InvalidArgumentError),
    ("m.slot_mapping([NEVER], 1)", UnknownSequenceError),
    ("m.slot_mapping([0, SWAPPED], 1)", SequenceSwappedError),
    # per-sequence queries
    *[
        (f"m.{f}({i!r})", InvalidArgumentError)
        for f in ("block_table", "num_tokens", "table_digest", "block_hashes", "is_swapped")
        for i in BAD_IDS
    ],
    *[
        (f"m.{f}({i})", UnknownSequenceError)
        for f in ("block_table", "num_tokens", "table_digest", "block_hashes", "is_swapped")
        for i in ("NEVER", "FREED")
    ],
    ("m.block_table(SWAPPED)", SequenceSwappedError),
]


@pytest.mark.parametrize(("call", "exc"), CASES, ids=[c for c, _ in CASES])
def test_bad_call_raises_and_changes_nothing(call: str, exc: type[BaseException]) -> None:
    m = _setup()
    before = _snapshot(m)
    names = {
        "m": m,
        "np": np,
        "RESIDENT": RESIDENT,
        "SWAPPED": SWAPPED,
        "FORKED": FORKED,
        "FREED": FREED,
        "NEVER": NEVER,
        "nan": float("nan"),
        "array": np.array,
    }
    # `m.allocate(5, <i>)` with a bare int i indexes BAD_TOKENS (arrays have no usable repr).
    for verb in ("allocate(5, ", "append(RESIDENT, "):
        prefix = f"m.{verb}"
        rest = call.removeprefix(prefix)
        if rest != call and rest[:-1].isdigit():
            names["T"] = BAD_TOKENS[int(rest[:-1])]
            call = f"{prefix}T)"
    with pytest.raises(exc) as info:
        eval(call, names)
    assert isinstance(info.value, PagedKVError)
    assert str(info.value), "the message must say what was wrong"
    _assert_unchanged(m, before)


@pytest.mark.parametrize("call", ["m.contains(x)", "x in m"])
def test_contains_answers_false_for_anything_that_is_not_a_known_id(call: str) -> None:
    m = _setup()
    before = _snapshot(m)
    for x in [*(i for i in BAD_IDS if i is not True), NEVER, FREED]:
        assert not eval(call.replace("m.contains(x)", "x in m"), {"m": m, "x": x})
    assert RESIDENT in m and SWAPPED in m
    _assert_unchanged(m, before)


@pytest.mark.parametrize(
    "kw",
    [
        *({"num_blocks": v} for v in [0, -1, 2**31, 2**64, 1.5, float("nan"), None, "4"]),
        *({"block_size": v} for v in [0, -1, 2**16 + 1, 1.5, "4"]),
        *({"num_cpu_blocks": v} for v in [-1, 2**31, 1.5, "1"]),
        *({"hash_algo": v} for v in ["md5", "", "SHA256", "xxh3_128_trunc8"]),
        *({"hash_seed": v} for v in [-1, 2**64, 1.5, float("nan"), "0"]),
        *({"watermark": v} for v in [float("nan"), float("inf"), -0.1, 1.0, 1.5, "x", True]),
    ],
    ids=repr,
)
def test_bad_construction_is_refused(kw: dict[str, Any]) -> None:
    args = {"num_blocks": 8, "block_size": 4, **kw}
    with pytest.raises(InvalidArgumentError) as info:
        BlockManager(args.pop("num_blocks"), args.pop("block_size"), **args)
    assert str(info.value)


@pytest.mark.parametrize(
    "kw", [{"hash_algo": 3}, {"hash_algo": None}, {"enable_prefix_caching": "yes"}]
)
def test_pyo3_typed_arguments_raise_type_error(kw: dict[str, Any]) -> None:
    with pytest.raises(TypeError):
        BlockManager(8, 4, **kw)


@pytest.mark.parametrize(
    "args",
    [([1], 0), ([1], 2**17), ([], 4), ("ab", 4), ([-1], 4), ([1], 4.0), ([1], None)],
    ids=repr,
)
def test_hash_blocks_bad_input(args: tuple[Any, Any]) -> None:
    with pytest.raises(InvalidArgumentError):
        pagedkv.hash_blocks(*args)
    with pytest.raises(InvalidArgumentError):
        pagedkv.hash_blocks([1, 2, 3, 4], 4, hash_algo="md5")


# ------------------------------------------------------------------ empty and odd-but-valid


def test_empty_batches_are_valid_and_change_nothing() -> None:
    m = _setup()
    before = _snapshot(m)
    empty = np.array([], dtype=np.int64)
    out = m.append_batch(empty, empty)
    assert out is not None and out.shape == (0, 2)
    assert m.append_batch([], []) is not None
    m.free_batch([])
    assert m.block_tables([]).shape == (0, 0)
    assert m.slot_mapping([], 1).tolist() == []
    indptr, indices, last = m.flashinfer_page_table([])
    assert (indptr.tolist(), indices.tolist(), last.tolist()) == ([0], [], [])
    _assert_unchanged(m, before)


def test_non_contiguous_arrays_are_read_by_value() -> None:
    m = _setup()
    m.allocate(5, np.arange(20, dtype=np.int64)[::2])
    assert m.num_tokens(5) == 10
    assert m.block_hashes(5) == pagedkv.hash_blocks(list(range(0, 20, 2)), B)
    ids = np.array([5, 9, RESIDENT, 9], dtype=np.uint64)[::2]
    assert m.block_tables(ids).shape[0] == 2
    m.check_invariants()


# ------------------------------------------------------------------ iterators that raise


def _raising(values: list[int], at: int) -> Iterator[int]:
    for i, v in enumerate(values):
        if i == at:
            raise RuntimeError("the caller's iterator broke")
        yield v


@pytest.mark.parametrize("at", [0, 1, 5])
@pytest.mark.parametrize(
    "call",
    [
        lambda m, it: m.allocate(5, it),
        lambda m, it: m.append(RESIDENT, it),
        lambda m, it: m.append_batch(it, [1, 2, 3, 4, 5, 6]),
        lambda m, it: m.append_batch([RESIDENT, FORKED], it),
        lambda m, it: m.free_batch(it),
        lambda m, it: m.slot_mapping([RESIDENT], it),
        lambda m, it: pagedkv.hash_blocks(it, 4),
    ],
    ids=[
        "allocate",
        "append",
        "append_batch-ids",
        "append_batch-tokens",
        "free_batch",
        "slot_mapping",
        "hash_blocks",
    ],
)
def test_an_iterator_raising_midway_leaves_the_manager_unchanged(
    call: Callable[[BlockManager, Iterator[int]], Any], at: int
) -> None:
    m = _setup()
    before = _snapshot(m)
    with pytest.raises(RuntimeError, match="iterator broke"):
        call(m, _raising([RESIDENT, FORKED, 1, 2, 3, 4, 5, 6], at))
    _assert_unchanged(m, before)


def test_an_index_method_raising_is_a_clear_error() -> None:
    class Bad:
        def __index__(self) -> int:
            raise RuntimeError("boom")

    m = _setup()
    before = _snapshot(m)
    with pytest.raises(PagedKVError):
        m.allocate(5, [1, Bad()])
    with pytest.raises(PagedKVError):
        m.free(Bad())
    _assert_unchanged(m, before)


# ------------------------------------------------------------------ out of blocks anywhere


def _decode_batch(n: int) -> tuple[BlockManager, list[int]]:
    """n sequences, each exactly at a block boundary (every append needs one block), plus a
    forked pair sharing a partial block (its append needs a copy)."""
    m = BlockManager(4 * n + 8, B, enable_kv_events=True)
    ids = []
    for s in range(n):
        m.allocate(s, [1000 * s + t for t in range(B * (1 + s % 3))])
        ids.append(s)
    m.allocate(100, [7, 8])
    m.fork(100, 101)
    ids += [100, 101]
    return m, ids


@pytest.mark.parametrize("short_by", [1, 2, 5])
def test_out_of_blocks_at_any_point_of_a_batch_changes_nothing(short_by: int) -> None:
    n = 8
    m, ids = _decode_batch(n)
    need = n + 1  # one new block per boundary sequence, one copy-on-write for the fork
    # Fill the pool so that exactly `need - short_by` blocks remain, then try the batch in
    # every rotation: wherever in the batch the blocks run out, nothing may change.
    filler = m.num_available_blocks - (need - short_by)
    assert m.allocate(500, list(range(10**6, 10**6 + filler * B))) is not None
    assert m.num_available_blocks == need - short_by
    m.drain_events()
    for r in range(len(ids)):
        order = ids[r:] + ids[:r]
        before = _snapshot(m)
        assert m.append_batch(order, [9] * len(order)) is None
        _assert_unchanged(m, before)
    m.free(500)
    out = m.append_batch(ids, [9] * len(ids))
    assert out is not None and len(out) == 1, "the fork's shared block is copied once"
    m.check_invariants()


def test_out_of_blocks_in_allocate_swap_in_and_append_changes_nothing() -> None:
    m = BlockManager(6, B, num_cpu_blocks=8)
    m.allocate(0, list(range(12)))  # 3 blocks
    assert m.swap_out(0) is not None
    m.allocate(1, list(range(100, 116)))  # 4 blocks: 2 left
    for call in (
        lambda: m.swap_in(0),
        lambda: m.allocate(2, list(range(200, 213))),
        lambda: m.allocate(2, [1], lookahead=2 * B),
        lambda: m.append(1, list(range(3 * B))),
    ):
        before = _snapshot(m)
        assert call() is None
        _assert_unchanged(m, before)


def test_free_batch_with_a_bad_id_anywhere_frees_nothing() -> None:
    for pos in range(4):
        m = _setup()
        ids = [RESIDENT, FORKED, SWAPPED]
        ids.insert(pos, NEVER)
        before = _snapshot(m)
        with pytest.raises(UnknownSequenceError):
            m.free_batch(ids)
        _assert_unchanged(m, before)
