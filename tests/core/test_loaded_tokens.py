"""`loaded_tokens=` and `lookup_blocks_per_group` from Python (docs/semantics.md, "Loaded
tokens", "Each group's own hit"): every call that decides a hit agrees on the deeper hit a
load makes servable, and bad values raise a clear error and change nothing.
"""

from __future__ import annotations

from typing import Any

import pytest

import pagedkv
from pagedkv import AllocStatus, BlockManager, InvalidArgumentError
from pagedkv.errors import InvalidArgumentTypeError
from pagedkv_reference import ReferenceBlockManager

IMPLS = [BlockManager, ReferenceBlockManager]

B = 4
STATE_HYBRID = [pagedkv.KVCacheGroup("full"), pagedkv.KVCacheGroup("state")]
PROMPT = list(range(16))
REPLAY = [*PROMPT, 7, 7, 7, 7]  # 4 cached blocks + 1 new


def _diverged(impl: Any = BlockManager) -> Any:
    """Full attention holds 4 cached blocks; the state group only block 0's state."""
    m = impl(32, B, groups=STATE_HYBRID, enable_kv_events=True)
    m.allocate(1, PROMPT, num_new_tokens=B)
    for _ in range(3):
        m.extend(1, B)
    m.free(1)
    for i in (1, 2, 3):
        _, tables = m.lookup_blocks(REPLAY, max_hit_tokens=(i + 1) * B)
        m.evict_blocks([tables[1][i]])
    m.drain_events()
    return m


def _snapshot(m: Any) -> Any:
    tables = {s: [m.block_table(s, group=g) for g in range(2)] for s in (1, 2, 3) if s in m}
    return (
        tables,
        len(m),
        m.stats().as_dict(),
        (m.num_free_blocks, m.num_cached_blocks, m.num_available_blocks),
    )


@pytest.mark.parametrize("impl", IMPLS)
def test_every_hit_deciding_call_agrees_on_the_loaded_hit(impl: Any) -> None:
    m = _diverged(impl)
    assert [h for h, _ in m.lookup_blocks_per_group(REPLAY)] == [16, 4]
    assert m.lookup(REPLAY) == 4
    assert m.lookup(REPLAY, loaded_tokens=2) == 16
    hit, tables = m.lookup_blocks(REPLAY, loaded_tokens=2)
    assert (hit, tables[1]) == (16, [0, 0, 0, 0])
    # 4 revived full-attention blocks; one new entry per group.
    assert m.allocation_cost(REPLAY, loaded_tokens=2) == (16, 2, 4)
    assert m.can_allocate(REPLAY, loaded_tokens=2) == AllocStatus.OK
    assert m.allocate(2, REPLAY, loaded_tokens=2) == 16
    assert m.block_table(2, group=1)[:4] == [0, 0, 0, 0]
    assert m.num_scheduled_tokens(2) == len(REPLAY)
    m.check_invariants()


@pytest.mark.parametrize("impl", IMPLS)
def test_a_plain_manager_reports_its_one_group(impl: Any) -> None:
    m = impl(16, B)
    m.allocate(1, PROMPT)
    m.free(1)
    per_group = m.lookup_blocks_per_group(REPLAY)
    assert per_group == [(16, m.lookup_blocks(REPLAY)[1][0])]
    assert m.lookup(REPLAY, loaded_tokens=3) == 16  # full attention needs every block


BAD = [
    (-1, InvalidArgumentError),
    (2**63, InvalidArgumentError),
    (1.5, InvalidArgumentTypeError),
    (True, InvalidArgumentTypeError),
    ("2", InvalidArgumentTypeError),
]
CALLS = {
    "allocate": lambda m, v: m.allocate(3, REPLAY, loaded_tokens=v),
    "lookup": lambda m, v: m.lookup(REPLAY, loaded_tokens=v),
    "can_allocate": lambda m, v: m.can_allocate(REPLAY, loaded_tokens=v),
    "allocation_cost": lambda m, v: m.allocation_cost(REPLAY, loaded_tokens=v),
    "allocation_cost of a length": lambda m, v: m.allocation_cost(20, loaded_tokens=v),
    "lookup_blocks": lambda m, v: m.lookup_blocks(REPLAY, loaded_tokens=v),
}


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("call", sorted(CALLS))
@pytest.mark.parametrize(("value", "error"), BAD, ids=[repr(v) for v, _ in BAD])
def test_bad_loaded_tokens_raise_and_change_nothing(
    impl: Any, call: str, value: Any, error: type
) -> None:
    m = _diverged(impl)
    before = _snapshot(m)
    with pytest.raises(error, match="loaded_tokens"):
        CALLS[call](m, value)
    assert _snapshot(m) == before
    assert m.drain_events() == []
    m.check_invariants()


@pytest.mark.parametrize("impl", IMPLS)
def test_more_loaded_than_scheduled_tokens_is_refused(impl: Any) -> None:
    m = _diverged(impl)
    before = _snapshot(m)
    with pytest.raises(InvalidArgumentError, match="loaded_tokens 3 exceeds the 2 tokens"):
        m.allocate(3, REPLAY, num_new_tokens=2, loaded_tokens=3)
    with pytest.raises(InvalidArgumentError, match="loaded_tokens 21 exceeds"):
        m.lookup(REPLAY, loaded_tokens=21)
    with pytest.raises(InvalidArgumentError, match="loaded_tokens 5 exceeds the 4 tokens"):
        m.allocation_cost(20, num_new_tokens=4, loaded_tokens=5)
    with pytest.raises(InvalidArgumentError, match="loaded_tokens 5 exceeds the 4 tokens"):
        m.can_allocate(20, num_new_tokens=4, loaded_tokens=5)
    assert _snapshot(m) == before
    assert 3 not in m
    m.check_invariants()
