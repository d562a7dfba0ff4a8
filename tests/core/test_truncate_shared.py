"""Held registration, fork and truncate (issue 32, item 1; docs/semantics.md, "truncate").

`allocate(7, P, register=False)`, `fork(7, 9)`, `truncate(7, 3)` left the shared, unhashed
block 1 as 7's partial last block; `register(9)` hashed it, and after `free(9)` 7's next
token was written into the cached block, which `allocate(10, P)` then served as P's KV. A
partial block kept by `truncate` is now this sequence's alone and unhashed: a shared one is
copied (the pair is reported). A hand-kept oracle records which prefix wrote each slot, and
every hit of P is checked against it, in both managers, with one group and with two.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

import pagedkv
from audited import audited
from pagedkv.groups import KVCacheGroup
from pagedkv_reference import ReferenceBlockManager

BS = 2
P = [11, 12, 13, 14, 15, 16]
FULL = KVCacheGroup("full")
WINDOW = KVCacheGroup("sliding_window", window=8)
LAYOUTS = {"plain": None, "full+window": [FULL, WINDOW], "full+full": [FULL, FULL]}


@pytest.fixture(params=[ReferenceBlockManager, pagedkv.BlockManager], ids=["reference", "rust"])
def make(request: pytest.FixtureRequest) -> Iterator[Callable[..., Any]]:
    yield from audited(request.param, num_blocks=24, block_size=BS)


class Kv:
    """Each slot's KV as the prefix (tokens up to its position) that wrote it."""

    def __init__(self, m: Any, groups: list[KVCacheGroup] | None) -> None:
        self.m = m
        self.groups = len(groups) if groups else 1
        # Block 0 is the null block once some group is not full attention.
        self.null = bool(groups) and any(g.kind != "full" for g in groups)
        self.slots: dict[int, tuple[int, ...]] = {}

    def entries(self, sid: int, p: int) -> list[int]:
        out = []
        for g in range(self.groups):
            b = self.m.block_table(sid, group=g)[p // BS]
            if not (self.null and b == 0):
                out.append(b * BS + p % BS)
        return out

    def write(self, sid: int, tokens: list[int], positions: range) -> None:
        for p in positions:
            for slot in self.entries(sid, p):
                self.slots[slot] = tuple(tokens[: p + 1])

    def copy(self, pairs: list[tuple[int, int]]) -> None:
        for src, dst in pairs:
            for o in range(BS):
                kv = self.slots.get(src * BS + o)
                if kv is None:
                    self.slots.pop(dst * BS + o, None)
                else:
                    self.slots[dst * BS + o] = kv

    def check(self, sid: int, tokens: list[int], n: int) -> None:
        for p in range(n):
            for slot in self.entries(sid, p):
                assert self.slots.get(slot) == tuple(tokens[: p + 1]), (
                    f"sequence {sid} reads the wrong KV at position {p} (slot {slot})"
                )


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("variant", ["parent", "child", "num_tokens"])
def test_a_truncated_shared_block_is_copied_and_every_hit_reads_its_own_kv(
    make: Callable[..., Any], layout: str, variant: str
) -> None:
    groups = LAYOUTS[layout]
    m = make(groups=groups) if groups else make()
    kv = Kv(m, groups)
    assert m.allocate(7, P, register=False) == 0
    kv.write(7, P, range(len(P)))
    m.fork(7, 9)
    short, full = (9, 7) if variant == "child" else (7, 9)
    pairs = m.truncate(short, 3)
    # Block 1 (positions 2, 3) is left partial and shared: copied in every group.
    assert pairs is not None and len(pairs) == kv.groups, pairs
    kv.copy(pairs)
    registered = m.register(full, num_tokens=4) if variant == "num_tokens" else m.register(full)
    assert registered >= 2 * kv.groups
    m.check_invariants()
    m.free(full)
    mine = [*P[:3], 99]
    pairs = m.append(short, [99])
    assert pairs == [], "the partial block is already its own"
    kv.write(short, mine, range(3, 4))
    m.check_invariants()
    kv.check(short, mine, 4)
    hit = m.allocate(10, P)
    assert hit == 4, "blocks 0 and 1 of P stay cached"
    kv.check(10, P, hit)


def test_a_truncate_whose_copy_does_not_fit_changes_nothing(make: Callable[..., Any]) -> None:
    m = make(4)  # the prompt's 3 blocks and one spare, which a second prompt takes
    m.allocate(7, P, register=False)
    m.fork(7, 9)
    m.allocate(5, [1])
    before = m.block_table(7)
    assert m.truncate(7, 3) is None
    assert m.block_table(7) == before
    assert m.num_tokens(7) == len(P)


def test_the_reference_copies_a_hashed_partial_block_before_writing_it() -> None:
    # The defence the core has (rust/core/src/partial_block_tests.rs), in the oracle: a
    # state the API cannot make (the audit flags it), made by hand.
    m = ReferenceBlockManager(8, BS)
    m.allocate(1, [1, 2, 3])
    b = m.block_table(1)[1]
    m._hashed[b] = b"d" * 32
    m._index[b"d" * 32] = b
    with pytest.raises(pagedkv.InvariantError, match="hashed but not full"):
        m.check_invariants()
    pairs = m.append(1, [4])
    assert pairs is not None and len(pairs) == 1 and pairs[0][0] == b
    assert m._index[b"d" * 32] == b and m._rc[b] == 0, "cached with the content it had"
    m.check_invariants()


def test_a_roll_back_inside_a_partial_shared_block_copies_nothing(
    make: Callable[..., Any],
) -> None:
    # Block size 4, 7 tokens: block 1 holds 3 of them, shared with the fork. Rolling back
    # inside it leaves every holder partial there (no holder can register it), so nothing
    # is copied; the fork's next write copies it as always.
    m = make(16, 4)
    m.allocate(7, list(range(7)))
    m.fork(7, 9)
    assert m.truncate(7, 5) == []
    assert m.block_table(7) == m.block_table(9)
    m.check_invariants()
    pairs = m.append(7, [50])
    assert pairs is not None and [src for src, _ in pairs] == [m.block_table(9)[1]]
