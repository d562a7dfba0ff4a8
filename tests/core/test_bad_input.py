"""Bad input and faults: every public method, every kind of wrong argument a user could send.

Each bad call must raise a clear exception (a `PagedKVError` subclass naming the argument, or a
`TypeError` for the two arguments PyO3 types itself) and leave the manager exactly as it was:
the snapshot (stats, every table, token count, digests, swap state, free and cached counts,
pending events) is compared before and after, and the audit runs after each call. Running
out of blocks at any point of a batch, and a Python exception raised by an iterator that
the API is consuming, must leave nothing half done either.
"""

from __future__ import annotations

import functools
import itertools
import os
import subprocess
import sys
import textwrap
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
    SequenceNotSwappedError,
    SequenceSwappedError,
    UnknownSequenceError,
)
from pagedkv.config import BlockManagerConfig
from pagedkv.errors import InvalidArgumentTypeError
from pagedkv_reference import ReferenceBlockManager
from pagedkv_reference import hash_blocks as ref_hash_blocks

Manager = Any  # BlockManager or ReferenceBlockManager: the same API
# With KV-cache groups every bad call must change nothing either (docs/semantics.md).
GROUPS = [
    pagedkv.KVCacheGroup("full"),
    pagedkv.KVCacheGroup("sliding_window", window=8),
    pagedkv.KVCacheGroup("state"),
]
IMPLS = [
    ReferenceBlockManager,
    BlockManager,
    functools.partial(ReferenceBlockManager, groups=GROUPS),
    functools.partial(BlockManager, groups=GROUPS),
]
PLAIN = IMPLS[:2]  # for the tests that spell out block ids (a grouped pool starts at 1)

B = 4
RESIDENT, SWAPPED, FORKED, FREED, PARTIAL, NEVER = 0, 1, 2, 3, 4, 77


def _setup(impl: type = BlockManager) -> Manager:
    """Resident, swapped, forked (shared blocks), freed (cached blocks) sequences, and one
    whose prompt is only partly scheduled (5 of 13 tokens: chunked prefill)."""
    # Three groups hold about three times the blocks: a larger pool, the same situations.
    blocks, cpu = (72, 12) if isinstance(impl, functools.partial) else (24, 4)
    m = impl(blocks, B, num_cpu_blocks=cpu, enable_kv_events=True)
    m.allocate(RESIDENT, list(range(10)))
    m.allocate(SWAPPED, list(range(100, 105)))
    assert m.swap_out(SWAPPED) is not None
    m.fork(RESIDENT, FORKED)
    m.allocate(FREED, list(range(200, 209)))
    m.free(FREED)
    m.allocate(PARTIAL, list(range(300, 313)), num_new_tokens=5)
    m.drain_events()
    return m


def _snapshot(m: Manager) -> dict[str, Any]:
    seqs = {}
    for s in (RESIDENT, SWAPPED, FORKED, FREED, PARTIAL, NEVER, 5, 6):
        if s in m:
            swapped = m.is_swapped(s)
            seqs[s] = (
                m.num_tokens(s),
                m.num_scheduled_tokens(s),
                swapped,
                m.block_hashes(s),
                None
                if swapped
                else (
                    [m.block_table(s, group=g) for g in range(max(1, len(m.stats().groups)))],
                    m.table_digest(s),
                ),
            )
    return {
        "seqs": seqs,
        "len": len(m),
        "stats": m.stats().as_dict(),
        "counts": (m.num_free_blocks, m.num_cached_blocks, m.num_available_blocks),
        "cpu": m.num_free_cpu_blocks,
    }


def _assert_unchanged(m: Manager, before: dict[str, Any]) -> None:
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
    # Not sequences (docs/inputs.md): iterators, buffers, arrays that are not 1-D integer
    (t for t in [1]),
    iter([1]),
    itertools.repeat(1, 10**10),
    memoryview(b"\x01"),
    bytearray(b"\x01"),
    np.ma.array([1, 2], mask=[False, True]),
    np.ma.array([1, 2]),
    np.array(1, dtype=">u8"),
    np.array([1.0], dtype=">f8"),
    np.array([np.timedelta64(1, "s")]),
    [np.timedelta64(1, "s")],
    [np.True_],
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
        for v in [-1, 2**63, 2**64, 1.5, float("nan"), "1", None, True, np.float32(1)]
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
    # arguments before state (the child's type before the parent's state)
    ("m.fork(NEVER, -1)", InvalidArgumentError),
    ("m.fork(SWAPPED, 1.5)", InvalidArgumentTypeError),
    ("m.fork(SWAPPED, FORKED)", SequenceSwappedError),  # the parent before the child
    ("m.append(1.5, [])", InvalidArgumentTypeError),  # seq_id before token_ids
    ("m.allocate(RESIDENT, [1], lookahead=None)", InvalidArgumentTypeError),
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
    ("m.swap_in(RESIDENT)", SequenceNotSwappedError),
    # can_allocate, can_swap_in
    *[
        (f"m.can_allocate({v!r})", InvalidArgumentError)
        for v in [0, -4, -(2**70), 1.5, float("nan"), None, "1", True, [], range(0), [-1]]
    ],
    ("m.can_allocate(iter([1]))", InvalidArgumentTypeError),
    ("m.can_allocate(np.array([[1]]))", InvalidArgumentTypeError),
    ("m.can_allocate([1.0])", InvalidArgumentTypeError),
    *[
        (f"m.can_allocate({n}, num_new_tokens={v!r})", InvalidArgumentError)
        for n in ("5", "[1, 2, 3, 4, 5]")
        for v in [0, -1, 6, 2**63, 1.5, "1", True]
    ],
    ("m.can_allocate([1], cache_salt=3)", InvalidArgumentTypeError),
    ("m.can_allocate(5, lora_id=-1)", InvalidArgumentError),
    ("m.can_allocate(5, num_new_tokens=6, lora_id=1.5)", InvalidArgumentTypeError),
    *[(f"m.can_swap_in({i!r})", InvalidArgumentError) for i in BAD_IDS],
    ("m.can_swap_in(NEVER)", UnknownSequenceError),
    ("m.can_swap_in(RESIDENT)", SequenceNotSwappedError),
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
    # cross-argument checks before state; then per sequence, in batch order
    ("m.append_batch([NEVER, 0, 0], [1, 2, 3])", InvalidArgumentError),
    ("m.append_batch([NEVER, 0], [1])", InvalidArgumentError),
    ("m.append_batch([SWAPPED, NEVER], [1, 2])", SequenceSwappedError),
    ("m.append_batch([NEVER, SWAPPED], [1, 2])", UnknownSequenceError),
    ("m.append_batch([0, 2], (t for t in [1, 2]))", InvalidArgumentTypeError),
    ("m.append_batch(range(2), memoryview(b'ab'))", InvalidArgumentTypeError),
    *[
        (f"m.free_batch({ids})", InvalidArgumentError)
        for ids in ["[0, 0]", "[0, -1]", "np.array([[0]])", "'ab'", "None", "[0.5]", "{0}"]
    ],
    ("m.free_batch([0, NEVER])", UnknownSequenceError),
    ("m.free_batch([FREED, 0])", UnknownSequenceError),
    ("m.free_batch([NEVER, 0, 0])", InvalidArgumentError),
    ("m.free_batch(iter([0]))", InvalidArgumentTypeError),
    ("m.free_batch(bytearray(b'\\x00'))", InvalidArgumentTypeError),
    *[
        (f"m.{f}({ids})", InvalidArgumentError)
        for f in ("block_tables", "flashinfer_page_table")
        for ids in ["[0, -1]", "np.array([[0]])", "'ab'", "None", "[0.5]", "np.array([0.5])", "{0}"]
    ],
    *[
        (f"m.block_tables([0], pad={v!r})", InvalidArgumentError)
        for v in [2**31, -(2**31) - 1, 1.5, float("nan"), "x", None, True]
    ],
    ("m.block_tables(1.5, pad=2**40)", InvalidArgumentTypeError),  # seq_ids before pad
    ("m.block_tables([NEVER], pad=2**40)", InvalidArgumentError),
    ("m.block_tables([SWAPPED, NEVER])", SequenceSwappedError),
    ("m.block_tables(np.array([0, 1], dtype='>u8'))", SequenceSwappedError),
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
    # arguments, then lengths, then per sequence: known, resident, count fits
    ("m.slot_mapping([NEVER], 0)", InvalidArgumentError),
    ("m.slot_mapping([NEVER], [1, 1])", InvalidArgumentError),
    ("m.slot_mapping([NEVER, 0], 11)", UnknownSequenceError),
    ("m.slot_mapping([0, NEVER], 11)", InvalidArgumentError),
    ("m.slot_mapping([SWAPPED], [2**62])", SequenceSwappedError),
    ("m.slot_mapping([0], True)", InvalidArgumentTypeError),
    ("m.slot_mapping([0], iter([1]))", InvalidArgumentTypeError),
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
    # block_hashes' range: ints from 0
    ("m.block_hashes(0, -1)", InvalidArgumentError),
    ("m.block_hashes(0, 0, -1)", InvalidArgumentError),
    ("m.block_hashes(0, 1.5)", InvalidArgumentTypeError),
    ("m.block_hashes(0, 0, '2')", InvalidArgumentTypeError),
    ("m.block_table(0, -1)", InvalidArgumentError),
    ("m.block_table(0, 0, -3)", InvalidArgumentError),
    ("m.block_table(0, [1])", InvalidArgumentTypeError),
    *[(f"m.num_scheduled_tokens({i!r})", InvalidArgumentError) for i in BAD_IDS],
    ("m.num_scheduled_tokens(NEVER)", UnknownSequenceError),
    ("m.num_scheduled_tokens(FREED)", UnknownSequenceError),
    # ---- issue 9: chunked prefill, drafts, truncate, retraction, lookup
    # allocate(num_new_tokens=...): an int in 1..len(token_ids)
    *[
        (f"m.allocate(5, [1, 2], num_new_tokens={v!r})", InvalidArgumentError)
        for v in [0, -1, 3, 2**63, 2**64, 1.5, float("nan"), "1", True, [1]]
    ],
    ("m.allocate(RESIDENT, [1, 2], num_new_tokens=3)", InvalidArgumentError),  # before state
    ("m.allocate(RESIDENT, [1, 2], num_new_tokens=0)", InvalidArgumentError),
    # every argument's kind before the cross-argument fit of num_new_tokens
    ("m.allocate(5, [1], num_new_tokens=2, lookahead=1.5)", InvalidArgumentTypeError),
    ("m.allocate(5, [1], num_new_tokens=2, cache_salt=3)", InvalidArgumentTypeError),
    ("m.allocate(5, [1], num_new_tokens=1.5, lookahead=-1)", InvalidArgumentTypeError),
    # extend
    *[(f"m.extend({i!r}, 1)", InvalidArgumentError) for i in BAD_IDS],
    *[
        (f"m.extend(PARTIAL, {v!r})", InvalidArgumentError)
        for v in [0, -1, 9, 2**63, 1.5, float("nan"), None, "1", True, [1]]
    ],
    ("m.extend(RESIDENT, 1)", InvalidArgumentError),  # nothing left to schedule
    ("m.extend(NEVER, 1)", UnknownSequenceError),
    ("m.extend(FREED, 1)", UnknownSequenceError),
    ("m.extend(SWAPPED, 1)", SequenceSwappedError),
    ("m.extend(SWAPPED, 100)", SequenceSwappedError),  # swapped before the count's fit
    ("m.extend(NEVER, 0)", InvalidArgumentError),  # arguments before state
    *[
        (f"m.extend(PARTIAL, 1, lookahead={v!r})", InvalidArgumentError)
        for v in [-1, 2**63, 1.5, None, "1", True]
    ],
    ("m.extend(SWAPPED, 1, lookahead=-1)", InvalidArgumentError),
    ("m.extend(PARTIAL, 9, lookahead=1.5)", InvalidArgumentTypeError),
    # append: the whole prompt must be scheduled; lookahead
    ("m.append(PARTIAL, [1])", InvalidArgumentError),
    ("m.append(PARTIAL, [])", InvalidArgumentError),
    *[
        (f"m.append(RESIDENT, [1], lookahead={v!r})", InvalidArgumentError)
        for v in [-1, 2**63, 1.5, None, "1", True]
    ],
    ("m.append(SWAPPED, [1], lookahead=-1)", InvalidArgumentError),
    ("m.append(NEVER, [1], lookahead=None)", InvalidArgumentTypeError),
    ("m.append_batch([0, PARTIAL], [1, 2])", InvalidArgumentError),
    ("m.append_batch([PARTIAL, SWAPPED], [1, 2])", InvalidArgumentError),
    ("m.append_batch([SWAPPED, PARTIAL], [1, 2])", SequenceSwappedError),
    ("m.append_batch([0], [1], lookahead=-1)", InvalidArgumentError),
    ("m.append_batch([0, NEVER], [1], lookahead=1.5)", InvalidArgumentTypeError),
    ("m.append_batch([0, 0], [1, 2], lookahead=-1)", InvalidArgumentError),
    # truncate
    *[(f"m.truncate({i!r}, 1)", InvalidArgumentError) for i in BAD_IDS],
    *[
        (f"m.truncate(RESIDENT, {v!r})", InvalidArgumentError)
        for v in [0, -1, 11, 2**63, 1.5, float("nan"), None, "1", True, [1]]
    ],
    ("m.truncate(PARTIAL, 14)", InvalidArgumentError),
    ("m.truncate(NEVER, 1)", UnknownSequenceError),
    ("m.truncate(FREED, 1)", UnknownSequenceError),
    ("m.truncate(SWAPPED, 1)", SequenceSwappedError),
    ("m.truncate(SWAPPED, 99)", SequenceSwappedError),
    ("m.truncate(NEVER, 0)", InvalidArgumentError),
    ("m.truncate(1.5, 0)", InvalidArgumentTypeError),
    # free(num_computed_tokens=...): an int in 0..num_tokens
    *[
        (f"m.free(RESIDENT, num_computed_tokens={v!r})", InvalidArgumentError)
        for v in [-1, 11, 2**63, 2**64, 1.5, float("nan"), "1", True, [1]]
    ],
    ("m.free(SWAPPED, num_computed_tokens=6)", InvalidArgumentError),
    ("m.free(PARTIAL, num_computed_tokens=14)", InvalidArgumentError),
    ("m.free(NEVER, num_computed_tokens=-1)", InvalidArgumentError),
    ("m.free(NEVER, num_computed_tokens=99)", UnknownSequenceError),
    ("m.free(FREED, num_computed_tokens=0)", UnknownSequenceError),
    # lookup, lookup_many
    *[(f"m.lookup({t!r})", InvalidArgumentError) for t in range(len(BAD_TOKENS))],
    ("m.lookup([1], cache_salt=3)", InvalidArgumentTypeError),
    ("m.lookup([1], lora_id=-1)", InvalidArgumentError),
    ("m.lookup([1.5], lora_id=-1)", InvalidArgumentTypeError),  # token_ids first
    *[(f"m.lookup([1], cache_salt={v!r})", InvalidArgumentError) for v in ["\udc80", 1.5]],
    *[
        (f"m.lookup_many({v})", InvalidArgumentError)
        for v in [
            "[[1], []]",
            "[[1], [-1]]",
            "[[1], [2**32]]",
            "[[1], 'ab']",
            "[1, 2]",
            "'ab'",
            "(p for p in [[1], []])",
            "[[1]], cache_salt=3",
            "[[1]], lora_id=2**64",
            "[[]], cache_salt=3",
        ]
    ],
    ("m.lookup_many([[1], iter([1])])", InvalidArgumentTypeError),
    # slot_mapping(lookahead=...): the table must have room for the draft slots
    *[
        (f"m.slot_mapping([0], 1, lookahead={v!r})", InvalidArgumentError)
        for v in [-1, 2**63, 1.5, None, "1", True, 3]
    ],
    ("m.slot_mapping([PARTIAL], 6)", InvalidArgumentError),  # 5 of 13 scheduled
    ("m.slot_mapping([PARTIAL], 1, lookahead=4)", InvalidArgumentError),  # 5 + 4 > 8
    ("m.slot_mapping([NEVER], [1, 1], lookahead=1.5)", InvalidArgumentTypeError),
    ("m.slot_mapping([NEVER, 0], 1, lookahead=3)", UnknownSequenceError),
    ("m.slot_mapping([SWAPPED], 1, lookahead=99)", SequenceSwappedError),
    # `group`: an int naming one of the manager's groups (one without `groups=`).
    *[
        (f"m.{call}, group={g!r})", exc)
        for call in (
            "block_table(RESIDENT",
            "block_tables([RESIDENT]",
            "slot_mapping([RESIDENT], 1",
            "flashinfer_page_table([RESIDENT]",
        )
        for g, exc in [
            (3, InvalidArgumentError),
            (-1, InvalidArgumentError),
            (2**70, InvalidArgumentError),
            (1.0, InvalidArgumentTypeError),
            ("0", InvalidArgumentTypeError),
            (None, InvalidArgumentTypeError),
        ]
    ],
    ("m.block_table(NEVER, group=3)", InvalidArgumentError),  # the group before the state
    # evict_blocks: every id checked (kind, then range, in order) before any is withdrawn;
    # the valid ids before a bad one stay cached.
    *[
        (f"m.evict_blocks({v})", InvalidArgumentError)
        for v in ["[1, m.num_blocks]", "[1, -1]", "[1, 2**31]", "[1, 2**64]", "range(99999)"]
    ],
    *[
        (f"m.evict_blocks({v})", InvalidArgumentTypeError)
        for v in [
            "[1, 1.5]",
            "[m.num_blocks, 1.5]",  # each entry's kind before the next entry
            "[1, True]",
            "{1}",
            "1",
            "None",
            "iter([1])",
            "array([1.0])",
            "array([[1]])",
            "b'\\x01'",
        ]
    ],
    # allocation_cost and lookup_blocks: as can_allocate and lookup, plus max_hit_tokens.
    *[
        (f"m.{call}{args})", exc)
        for call in ("allocation_cost(", "lookup_blocks(")
        for args, exc in [
            ("[]", InvalidArgumentError),
            ("[-1]", InvalidArgumentError),
            ("[1], max_hit_tokens=-1", InvalidArgumentError),
            ("[1], max_hit_tokens=2**63", InvalidArgumentError),
            ("[1], max_hit_tokens=1.5", InvalidArgumentTypeError),
            ("[1], max_hit_tokens=True", InvalidArgumentTypeError),
            ("[1.5], max_hit_tokens=-1", InvalidArgumentTypeError),  # token_ids first
            ("[1], cache_salt=3, max_hit_tokens=-1", InvalidArgumentTypeError),
            ("[1], lora_id=-1", InvalidArgumentError),
            ("(t for t in [1])", InvalidArgumentTypeError),
        ]
    ],
    ("m.allocation_cost(0)", InvalidArgumentError),
    ("m.allocation_cost(-5, max_hit_tokens=1.5)", InvalidArgumentError),
    ("m.allocation_cost(5, num_new_tokens=6)", InvalidArgumentError),
    ("m.allocation_cost([1, 2], num_new_tokens=3)", InvalidArgumentError),
    ("m.allocation_cost([1, 2], num_new_tokens=0)", InvalidArgumentError),
    ("m.allocation_cost([1], lookahead=-1)", InvalidArgumentError),
    ("m.allocation_cost(5, lookahead=None)", InvalidArgumentTypeError),
    ("m.allocation_cost([1], num_new_tokens=3, lookahead=1.5)", InvalidArgumentTypeError),
    # pins, the clock, tenants and retention (eviction="lru", no tenants: refused)
    *[(f"m.{call}({i!r})", InvalidArgumentError) for call in ("pin", "unpin") for i in BAD_IDS],
    ("m.pin(NEVER)", UnknownSequenceError),
    ("m.unpin(SWAPPED)", SequenceSwappedError),
    ("m.set_time(nan)", InvalidArgumentError),
    ("m.set_time(-1.0)", InvalidArgumentError),
    # a float argument, as `watermark` (docs/inputs.md): no bool, np.float32 or 0-d array
    *[
        (f"m.set_time({t})", InvalidArgumentTypeError)
        for t in ("True", "np.float32(1.0)", "array(1.0)", "'1'", "None", "[1.0]")
    ],
    ("m.set_time(2**64)", InvalidArgumentError),
    ("m.set_tenant_quota(None, max_cached=1)", InvalidArgumentError),
    ("m.set_tenant_quota(3)", InvalidArgumentTypeError),
    ("m.set_tenant_quota('a', reserved=-1)", InvalidArgumentError),
    ("m.tenant_stats()", InvalidArgumentError),
    ("m.allocate(5, [1], retention=[(0, None, 50, None)])", InvalidArgumentError),
    ("m.allocate(5, [1], decode_retention=(50, None))", InvalidArgumentError),
    ("m.allocate(5, [1], retention='x')", InvalidArgumentTypeError),
    ("m.allocate(5, [1], retention=[(0, 1, 50)])", InvalidArgumentError),
    ("m.allocate(5, [1], retention=[(0, 1, 101, None)])", InvalidArgumentError),
    ("m.allocate(5, [1], decode_retention=(5, -1.0))", InvalidArgumentError),
    ("m.allocate(RESIDENT, [1], retention=[(2, 2, 5, None)])", InvalidArgumentError),
]


@pytest.mark.parametrize(
    ("call", "exc"),
    [pytest.param(c, e, id=c) for c, e in CASES],
)
def test_bad_call_raises_and_changes_nothing(call: str, exc: type[BaseException]) -> None:
    """Both implementations raise `exc` (or a subclass), the very same class, and change
    nothing."""
    raised = []
    for impl in IMPLS:
        m = _setup(impl)
        before = _snapshot(m)
        names = {
            "m": m,
            "np": np,
            "RESIDENT": RESIDENT,
            "SWAPPED": SWAPPED,
            "FORKED": FORKED,
            "FREED": FREED,
            "PARTIAL": PARTIAL,
            "NEVER": NEVER,
            "nan": float("nan"),
            "array": np.array,
        }
        # `m.allocate(5, <i>)` with a bare int i indexes BAD_TOKENS (arrays have no usable
        # repr).
        code = call
        for verb in ("allocate(5, ", "append(RESIDENT, ", "lookup("):
            prefix = f"m.{verb}"
            rest = call.removeprefix(prefix)
            if rest != call and rest[:-1].isdigit():
                names["T"] = BAD_TOKENS[int(rest[:-1])]
                code = f"{prefix}T)"
        with pytest.raises(exc) as info:
            eval(code, names)
        assert isinstance(info.value, PagedKVError)
        assert str(info.value), "the message must say what was wrong"
        _assert_unchanged(m, before)
        raised.append(type(info.value))
    assert len(set(raised)) == 1, f"reference, rust, grouped reference, grouped rust: {raised}"


@pytest.mark.parametrize("impl", IMPLS[2:])
def test_evict_blocks_refuses_the_null_block_and_changes_nothing(impl: type) -> None:
    m = _setup(impl)
    cached = m.lookup_blocks(list(range(200, 209)))[1][0]
    assert cached and 0 not in cached
    before = _snapshot(m)
    with pytest.raises(InvalidArgumentError, match="null block"):
        m.evict_blocks([*cached, 0])
    _assert_unchanged(m, before)
    assert m.evict_blocks(cached) == len(cached)
    m.check_invariants()


@pytest.mark.parametrize("impl", IMPLS)
def test_contains_answers_false_for_anything_that_is_not_a_known_id(impl: type) -> None:
    m = _setup(impl)  # SWAPPED == 1 == True: found if a bool counted as an id
    before = _snapshot(m)

    class Index:
        def __index__(self) -> int:
            raise RuntimeError("__index__ must not be called")

    for x in [*BAD_IDS, np.True_, Index(), np.timedelta64(1), NEVER, FREED, 2**64 + 1]:
        assert (x in m) is False, repr(x)
    assert RESIDENT in m and SWAPPED in m and 1 in m and np.uint64(1) in m
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
    [([1], 0), ([1], 2**17), ("ab", 4), ([-1], 4), ([1], 4.0), ([1], None), (iter([1]), 4)],
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


# ------------------------------------------------------------------ iterators, __index__


def _raising(values: list[int], at: int) -> Iterator[int]:
    for i, v in enumerate(values):
        if i == at:
            raise RuntimeError("the caller's iterator broke")
        yield v


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize(
    "call",
    [
        lambda m, it: m.allocate(5, it),
        lambda m, it: m.append(RESIDENT, it),
        lambda m, it: m.append_batch(it, [1, 2, 3, 4, 5, 6]),
        lambda m, it: m.append_batch([RESIDENT, FORKED], it),
        lambda m, it: m.free_batch(it),
        lambda m, it: m.slot_mapping([RESIDENT], it),
        lambda m, it: m.slot_mapping([RESIDENT], 1, lookahead=it),
        lambda m, it: m.flashinfer_page_table([RESIDENT], lookahead=it),
        lambda m, it: (pagedkv if isinstance(m, BlockManager) else _ref).hash_blocks(it, 4),
        lambda m, it: m.lookup(it),
        lambda m, it: m.lookup_many([[1], it]),
        lambda m, it: m.can_allocate(it),
    ],
    ids=[
        "allocate",
        "append",
        "append_batch-ids",
        "append_batch-tokens",
        "free_batch",
        "slot_mapping",
        "slot_mapping-lookahead",
        "flashinfer_page_table-lookahead",
        "hash_blocks",
        "lookup",
        "lookup_many-prompt",
        "can_allocate",
    ],
)
def test_an_iterator_is_refused_unread(
    call: Callable[[Manager, Iterator[int]], Any], impl: type
) -> None:
    """Iterators are not sequences (docs/inputs.md): refused before a single item is read,
    so a broken one cannot fail midway."""
    m = _setup(impl)
    before = _snapshot(m)
    it = _raising([RESIDENT, FORKED, 1, 2, 3, 4, 5, 6], 0)
    with pytest.raises(InvalidArgumentTypeError):
        call(m, it)
    with pytest.raises(RuntimeError, match="iterator broke"):
        next(it)  # the first item was never asked for
    _assert_unchanged(m, before)


class _Ref:
    hash_blocks = staticmethod(ref_hash_blocks)


_ref = _Ref()


@pytest.mark.parametrize("impl", IMPLS)
def test_index_methods_are_never_called(impl: type) -> None:
    """Only ints and numpy integer scalars are ints: an object with `__index__` (raising,
    or returning a value at or above 2**63) is refused by type, its method never called."""
    calls = []

    class Bad:
        def __index__(self) -> int:
            calls.append("bad")
            raise RuntimeError("boom")

    class Big:
        def __index__(self) -> int:
            calls.append("big")
            return 2**63 + 1

    m = _setup(impl)
    before = _snapshot(m)
    for obj in (Bad(), Big()):
        for call in (
            lambda o: m.allocate(5, [1, o]),
            lambda o: m.allocate(5, (1, o)),
            lambda o: m.allocate(o, [1]),
            lambda o: m.allocate(5, [1], lookahead=o),
            lambda o: m.allocate(5, [1], lora_id=o),
            lambda o: m.free(o),
            lambda o: m.free_batch([o]),
            lambda o: m.can_allocate(o),
            lambda o: m.slot_mapping([RESIDENT], o),
            lambda o: m.block_tables([RESIDENT], pad=o),
            lambda o: m.allocate(5, [1], num_new_tokens=o),
            lambda o: m.extend(PARTIAL, o),
            lambda o: m.extend(PARTIAL, 1, lookahead=o),
            lambda o: m.append(RESIDENT, [1], lookahead=o),
            lambda o: m.truncate(RESIDENT, o),
            lambda o: m.free(RESIDENT, num_computed_tokens=o),
            lambda o: m.can_allocate([1], num_new_tokens=o),
            lambda o: m.slot_mapping([RESIDENT], 1, lookahead=o),
            lambda o: m.slot_mapping([RESIDENT], 1, lookahead=[o]),
            lambda o: m.flashinfer_page_table([RESIDENT], lookahead=(o,)),
            lambda o: m.lookup([1, o]),
            lambda o: m.num_scheduled_tokens(o),
        ):
            with pytest.raises(InvalidArgumentTypeError, match="must"):
                call(obj)
    assert calls == []
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


# ------------------------------------------------------------------ the list


@pytest.mark.parametrize("impl", PLAIN)
@pytest.mark.parametrize("order", ["<", ">", "="])
def test_uint64_ids_at_or_above_2_63_are_ids_in_any_byte_order(impl: type, order: str) -> None:
    m = impl(16, B)
    big = 2**63 + 5
    ids = np.array([big, 2**64 - 1], dtype=f"{order}u8")
    assert m.allocate(np.uint64(big), [1, 2, 3]) == 0
    assert m.allocate(2**64 - 1, [4, 5]) == 0
    assert m.block_tables(ids).tolist() == [[0], [1]]
    assert m.slot_mapping(ids, np.array([1, 1], dtype=f"{order}u8")).tolist() == [2, 5]
    assert m.append_batch(ids, np.array([7, 8], dtype=f"{order}u4")) is not None
    with pytest.raises(UnknownSequenceError, match=str(2**63)):
        m.block_tables(np.array([2**63], dtype=f"{order}u8"))
    m.free_batch(ids)
    assert len(m) == 0
    m.check_invariants()


@pytest.mark.parametrize("impl", IMPLS)
def test_sequences_are_lists_tuples_ranges_and_1d_integer_arrays(impl: type) -> None:
    m = impl(32, B)
    plain = m.allocate(0, [5, 6, 7, 8, 9])
    for sid, toks in enumerate(
        [
            (5, 6, 7, 8, 9),
            range(5, 10),
            np.arange(5, 10, dtype=">i2"),
            np.arange(5, 10, dtype=np.uint8),
            [np.int64(5), 6, np.uint32(7), 8, np.int8(9)],
        ],
        start=1,
    ):
        assert m.allocate(sid, toks) == 4, type(toks)  # the first block is a hit
        assert m.block_hashes(sid) == m.block_hashes(0)
    assert plain == 0
    assert m.block_tables(range(3)).shape == (3, 2)
    both = m.slot_mapping([0], 1).tolist() + m.slot_mapping([1], 2).tolist()
    assert m.slot_mapping((0, 1), range(1, 3)).tolist() == both
    m.free_batch(range(6))
    m.check_invariants()


def test_hash_blocks_of_nothing_is_empty_in_both() -> None:
    assert pagedkv.hash_blocks([], 4) == [] == ref_hash_blocks([], 4)
    assert pagedkv.hash_blocks(range(0), 4) == [] == ref_hash_blocks(np.array([], np.int8), 4)


@pytest.mark.parametrize("impl", PLAIN)
def test_an_ndarray_subclass_is_read_as_a_plain_array(impl: type) -> None:
    """Without calling its overridden methods (the old binding called `astype`)."""

    class Broken(np.ndarray):
        def astype(self, *a: Any, **k: Any) -> Any:
            raise RuntimeError("astype must not be called")

        def tolist(self) -> Any:
            raise RuntimeError("tolist must not be called")

        def __iter__(self) -> Any:
            raise RuntimeError("__iter__ must not be called")

    toks = np.array([1, 2, 3, 4, 5], dtype=">i8").view(Broken)
    ids = np.array([0], dtype=">u8").view(Broken)
    m = impl(8, B)
    assert m.allocate(0, toks) == 0
    assert m.block_tables(ids).tolist() == [[0, 1]]
    assert pagedkv.hash_blocks(toks, B) == ref_hash_blocks(toks, B)


@pytest.mark.parametrize("impl", IMPLS)
def test_can_allocate_of_any_size_is_never(impl: type) -> None:
    m = impl(8, B)
    for n in (2**63 - 1, 2**63, 2**64, 2**200, np.uint64(2**64 - 1)):
        assert m.can_allocate(n) == pagedkv.AllocStatus.NEVER
    assert m.can_allocate(1) == pagedkv.AllocStatus.OK


@pytest.mark.parametrize(
    "kw",
    [
        *({k: None} for k in ("block_size", "num_cpu_blocks", "hash_seed", "watermark")),
        *({k: v} for k in ("enable_prefix_caching", "enable_kv_events") for v in (1, "yes", None)),
        {"hash_algo": b"sha256"},
        {"num_blocks": np.float64(8)},
        {"watermark": np.float32(0.1)},
    ],
    ids=repr,
)
def test_construction_refuses_the_same_kinds_in_both(kw: dict[str, Any]) -> None:
    args = {"num_blocks": 8, "block_size": 4, **kw}
    raised = []
    for impl in IMPLS:
        a = dict(args)
        with pytest.raises(InvalidArgumentTypeError) as info:
            impl(a.pop("num_blocks"), a.pop("block_size"), **a)
        raised.append(type(info.value))
    assert raised[0] is raised[1]


def test_construction_errors_come_in_argument_order() -> None:
    for impl in IMPLS:
        with pytest.raises(InvalidArgumentTypeError, match="block_size"):
            impl(8, None, watermark=2.0)  # block_size before watermark
        with pytest.raises(InvalidArgumentError, match="watermark"):
            impl(8, 4, watermark=2.0, enable_kv_events="yes")  # watermark before events
        with pytest.raises(InvalidArgumentError, match="num_blocks"):
            impl(0, 4, hash_algo=3)  # num_blocks before hash_algo


def test_config_refuses_the_block_sizes_the_constructor_refuses() -> None:
    BlockManagerConfig(num_blocks=8, block_size=2**16)
    with pytest.raises(InvalidArgumentError):
        BlockManager(8, 2**16 + 1)
    with pytest.raises(InvalidArgumentError):
        BlockManagerConfig(num_blocks=8, block_size=2**16 + 1)


def test_reference_refcount_limit_refuses_before_any_change(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`fork` and a prefix-hit `allocate` that would give a block more than MAX_REFCOUNT
    holders raise RefcountOverflowError and change nothing (the limit is lowered here; the
    Rust one is checked at full size in test_rust_refcount_limit)."""
    from pagedkv.errors import RefcountOverflowError
    from pagedkv_reference import manager as reference

    monkeypatch.setattr(reference, "MAX_REFCOUNT", 3)
    m = ReferenceBlockManager(16, B)
    m.allocate(0, [1, 2, 3, 4, 5])
    m.fork(0, 1)
    m.allocate(2, [1, 2, 3, 4, 9])  # a hit on block 0: three holders
    before = _snapshot(m)
    with pytest.raises(RefcountOverflowError):
        m.fork(0, 3)
    with pytest.raises(RefcountOverflowError):
        m.allocate(3, [1, 2, 3, 4, 6])
    _assert_unchanged(m, before)
    with pytest.raises(UnknownSequenceError):
        m.fork(9, 3)  # state errors before the limit


def test_rust_refcount_limit() -> None:
    """The full-size limit in the Rust manager: MAX_REFCOUNT holders, then the error."""
    from pagedkv.errors import RefcountOverflowError
    from pagedkv_reference.manager import MAX_REFCOUNT

    m = BlockManager(4, B)
    m.allocate(0, [1])
    for child in range(1, MAX_REFCOUNT):
        m.fork(0, child)
    before = _snapshot(m)
    try:
        m.fork(0, MAX_REFCOUNT)
    except RefcountOverflowError:
        _assert_unchanged(m, before)
        return
    raise AssertionError("fork past MAX_REFCOUNT holders did not raise")


# ------------------------------------------------------------------ huge inputs, no memory


_HUGE = """
import resource, sys
import numpy as np
from numpy.lib.stride_tricks import as_strided
import pagedkv
from pagedkv.errors import InvalidArgumentError, InvalidArgumentTypeError
from pagedkv_reference import manager as reference
from pagedkv_reference import ReferenceBlockManager

def huge(n, dtype):
    return as_strided(np.zeros(1, dtype=dtype), shape=(n,), strides=(0,))

def expect(exc, call, what):
    m = impl(8, 4)
    m.allocate(0, [1, 2, 3])
    before = (m.stats().as_dict(), m.block_table(0))
    try:
        call(m)
    except exc as e:
        assert (m.stats().as_dict(), m.block_table(0)) == before, what
        print(what, type(e).__name__, flush=True)
        return
    raise AssertionError(f"{what}: no {exc.__name__}")

for impl in (pagedkv.BlockManager, ReferenceBlockManager):
    H = impl.__name__ + " "
    for n in (10**12, 2**31):
        ids, toks = huge(n, np.uint64), huge(n, np.uint32)
        E = InvalidArgumentError
        expect(E, lambda m: m.allocate(1, toks), H + "allocate")
        expect(E, lambda m: m.append(0, toks), H + "append")
        expect(E, lambda m: m.free_batch(ids), H + "free_batch")
        expect(E, lambda m: m.block_tables(ids), H + "block_tables")
        expect(E, lambda m: m.flashinfer_page_table(ids), H + "flashinfer_page_table")
        expect(E, lambda m: m.slot_mapping(ids, 1), H + "slot_mapping ids")
        expect(E, lambda m: m.slot_mapping([0], ids), H + "slot_mapping counts")
        expect(E, lambda m: m.append_batch(ids, toks), H + "append_batch")
        hb = pagedkv.hash_blocks if impl is pagedkv.BlockManager else reference.hash_blocks
        expect(E, lambda m: hb(toks, 4), H + "hash_blocks")
        expect(E, lambda m: m.allocate(1, range(n)), H + "allocate range")
    repeat = __import__("itertools").repeat(1, 10**10)
    expect(InvalidArgumentTypeError, lambda m: m.allocate(1, repeat), H + "repeat")

# Within the maximum but more than this process may allocate: MemoryError, state unchanged.
soft, hard = resource.getrlimit(resource.RLIMIT_AS)
with open("/proc/self/statm") as f:
    used = int(f.read().split()[0]) * resource.getpagesize()
resource.setrlimit(resource.RLIMIT_AS, (used + 2**31, hard))
impl = pagedkv.BlockManager
n = 2**31 - 1
expect(MemoryError, lambda m: m.allocate(1, huge(n, np.uint32)), "rust allocate")
expect(MemoryError, lambda m: m.free_batch(huge(n, np.uint64)), "rust free_batch")
expect(MemoryError, lambda m: m.block_tables(huge(n, np.int64)), "rust block_tables")
expect(MemoryError, lambda m: pagedkv.hash_blocks(huge(n, np.int8), 4), "rust hash_blocks")
print("ok")
"""


def test_huge_inputs_raise_instead_of_aborting() -> None:
    """Zero-stride views claiming 10**12 (or 2**31) entries, a 10**10-long `repeat`: a clear
    InvalidArgumentError (more than the 2**31 - 1 entries allowed) or InvalidArgumentTypeError,
    never an abort; an input within the maximum that does not fit in memory is a MemoryError.
    In a subprocess, so that an abort (the old behaviour) fails this test, not the run."""
    # the child imports what this process imports (pagedkv_reference: pytest's pythonpath)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_HUGE)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert out.returncode == 0, f"exit {out.returncode}\n{out.stdout}\n{out.stderr}"
    assert out.stdout.rstrip().endswith("ok"), out.stdout


# ------------------------------------------------------------------------------------------
# Caller keys, hit caps, held registration (docs/semantics.md): bad input changes nothing,
# and a refused `register` or keyed `append` publishes nothing either.

KEYED, HELD = 8, 9
K = [b"k0", b"k1"]  # the keys of KEYED's and HELD's two full blocks (9 tokens)


def _setup_keyed(impl: type) -> Manager:
    """`_setup` plus a caller-keyed sequence and a held caller-keyed one (other keys)."""
    m = _setup(impl)
    m.allocate(KEYED, list(range(400, 409)), block_hashes=K)
    m.allocate(HELD, list(range(500, 509)), block_hashes=[b"h0", b"h1"], register=False)
    m.drain_events()
    return m


def _keyed_snapshot(m: Manager) -> Any:
    """`_snapshot` with the keyed sequences and what the cache holds under their keys."""
    seqs = [
        (m.num_tokens(s), m.num_scheduled_tokens(s), m.block_hashes(s), m.num_block_hashes(s))
        for s in (KEYED, HELD)
        if s in m
    ]
    hits = [m.lookup([0] * 9, block_hashes=k) for k in (K, [b"h0", b"h1"])]
    return _snapshot(m), seqs, hits


KEY_CASES: list[tuple[str, type[BaseException]]] = [
    # allocate: each argument's kind, a key's length, then the cross-argument checks
    *[
        (f"m.allocate(5, list(range(9)), block_hashes={k!r})", InvalidArgumentTypeError)
        for k in ["ab", b"ab", [b"a", "b"], [bytearray(b"a")], [1], {b"a"}, 3]
    ],
    ("m.allocate(5, list(range(9)), block_hashes=iter([b'a']))", InvalidArgumentTypeError),
    ("m.allocate(5, list(range(9)), block_hashes=[b''])", InvalidArgumentError),
    ("m.allocate(5, list(range(9)), block_hashes=[b'x' * 129])", InvalidArgumentError),
    ("m.allocate(5, list(range(9)), block_hashes=[b'a', b'b', b'c'])", InvalidArgumentError),
    ("m.allocate(5, [1, 2, 3], block_hashes=[b'a'])", InvalidArgumentError),  # no full block
    ("m.allocate(5, list(range(9)), block_hashes=[b'a'], cache_salt='s')", InvalidArgumentError),
    ("m.allocate(5, list(range(9)), block_hashes=[b'a'], lora_id=1)", InvalidArgumentError),
    ("m.allocate(5, [], block_hashes=[b'a'])", InvalidArgumentError),
    ("m.allocate(5, [1], max_hit_tokens=-1)", InvalidArgumentError),
    ("m.allocate(5, [1], max_hit_tokens=1.5)", InvalidArgumentTypeError),
    ("m.allocate(5, [1], register=None)", InvalidArgumentTypeError),
    ("m.allocate(5, [1], register=1)", InvalidArgumentTypeError),
    ("m.allocate(5, [1], block_hashes=[b''], register=1)", InvalidArgumentError),  # in order
    ("m.allocate(KEYED, list(range(9)), block_hashes=[b'a'])", DuplicateSequenceError),
    ("m.allocate(KEYED, list(range(9)), block_hashes=[b''])", InvalidArgumentError),
    # append: empty tokens need lookahead or keys; keys only for a caller-keyed sequence
    ("m.append(KEYED, [])", InvalidArgumentError),
    ("m.append(KEYED, [], lookahead=-1)", InvalidArgumentError),
    ("m.append(KEYED, [], block_hashes='k2')", InvalidArgumentTypeError),
    ("m.append(KEYED, [], block_hashes=[b'k2'])", InvalidArgumentError),  # 9 tokens: 2 keys
    ("m.append(KEYED, [1, 2, 3], block_hashes=[b'k2', b'k3'])", InvalidArgumentError),
    ("m.append(RESIDENT, [1], block_hashes=[b'a'])", InvalidArgumentError),  # self-hashed
    ("m.append(RESIDENT, [1, 2], block_hashes=[])", InvalidArgumentError),
    ("m.append(NEVER, [], lookahead=1)", UnknownSequenceError),
    ("m.append(SWAPPED, [], lookahead=1)", SequenceSwappedError),
    ("m.append(PARTIAL, [], lookahead=1)", InvalidArgumentError),  # prompt not scheduled
    ("m.append(NEVER, [], block_hashes=[b''])", InvalidArgumentError),  # arguments first
    # register
    ("m.register(HELD, num_tokens=-1)", InvalidArgumentError),
    ("m.register(HELD, num_tokens=1.5)", InvalidArgumentTypeError),
    ("m.register(HELD, num_tokens=10)", InvalidArgumentError),  # past its 9 scheduled
    ("m.register(HELD, block_hashes=[b'h2'])", InvalidArgumentError),  # 9 tokens: 2 keys
    ("m.register(HELD, block_hashes=b'h2')", InvalidArgumentTypeError),
    ("m.register(HELD, block_hashes=[b'x' * 200])", InvalidArgumentError),
    ("m.register(RESIDENT, block_hashes=[b'a'])", InvalidArgumentError),  # self-hashed
    ("m.register(NEVER)", UnknownSequenceError),
    ("m.register(SWAPPED)", SequenceSwappedError),
    ("m.register(-1)", InvalidArgumentError),
    ("m.register(NEVER, num_tokens=-1)", InvalidArgumentError),  # arguments first
    # lookup and can_allocate
    ("m.lookup(list(range(9)), block_hashes=[b'a'] * 3)", InvalidArgumentError),
    ("m.lookup(list(range(9)), block_hashes=[b'a'], cache_salt='s')", InvalidArgumentError),
    ("m.lookup(list(range(9)), max_hit_tokens=-1)", InvalidArgumentError),
    ("m.lookup(list(range(9)), block_hashes=(b'a', 1))", InvalidArgumentTypeError),
    ("m.can_allocate(9, block_hashes=[b'a'] * 3)", InvalidArgumentError),
    ("m.can_allocate(9, block_hashes=[b'a'], lora_id=1)", InvalidArgumentError),
    ("m.can_allocate(9, max_hit_tokens=-1)", InvalidArgumentError),
    ("m.can_allocate(list(range(9)), block_hashes=[b''])", InvalidArgumentError),
    ("m.can_allocate(9, block_hashes='ab')", InvalidArgumentTypeError),
    ("m.num_block_hashes(NEVER)", UnknownSequenceError),
]


@pytest.mark.parametrize(("call", "exc"), [pytest.param(c, e, id=c) for c, e in KEY_CASES])
def test_bad_key_call_raises_and_changes_nothing(call: str, exc: type[BaseException]) -> None:
    """Every implementation and layout raises the same class, `exc` or a subclass, and
    changes nothing: no sequence, table, digest or key, and nothing registered."""
    raised = []
    for impl in IMPLS:
        m = _setup_keyed(impl)
        before = _keyed_snapshot(m)
        names = {
            "m": m,
            "RESIDENT": RESIDENT,
            "SWAPPED": SWAPPED,
            "PARTIAL": PARTIAL,
            "NEVER": NEVER,
            "KEYED": KEYED,
            "HELD": HELD,
        }
        with pytest.raises(exc) as info:
            eval(call, names)
        assert isinstance(info.value, PagedKVError)
        assert str(info.value), "the message must say what was wrong"
        assert _keyed_snapshot(m) == before
        assert m.drain_events() == [], "a refused call emitted events"
        m.check_invariants()
        raised.append(type(info.value))
    assert len(set(raised)) == 1, f"reference, rust, grouped reference, grouped rust: {raised}"


@pytest.mark.parametrize("impl", IMPLS)
def test_keyed_calls_that_run_out_of_blocks_change_nothing(impl: type) -> None:
    """A keyed `append` (keys and slots) that does not fit adds no key and registers
    nothing; an empty append's slots likewise."""
    m = _setup_keyed(impl)
    m.append(KEYED, [0, 0, 0])  # 12 tokens: a third key is allowed
    before = _keyed_snapshot(m)
    assert m.append(KEYED, [], lookahead=10**6, block_hashes=[b"k2"]) is None
    assert m.append(HELD, [], lookahead=10**6) is None
    assert _keyed_snapshot(m) == before
    assert m.drain_events() == []
    m.check_invariants()
