"""The swap space's events are per copy (issue 32, item 12; docs/semantics.md, "Events"):
`BlockStored(medium="CPU")` when the first CPU copy of a key (group, digest) appears and
`BlockRemoved(medium="CPU")` when the last goes. With two swapped-out copies of one prompt,
the first `swap_in` used to announce the key gone from the CPU though the other copy still
held it. A replay of the events must always describe exactly the keys some CPU copy holds."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest

import pagedkv
from pagedkv.events import BlockRemoved, BlockStored
from pagedkv.groups import KVCacheGroup
from pagedkv_reference import ReferenceBlockManager

F = KVCacheGroup("full")
W = KVCacheGroup("sliding_window", window=8)
LAYOUTS = {"plain": None, "full+full": [F, F], "full+window": [F, W]}
P = [1, 2, 3, 4, 5]  # block size 2: two full blocks


@pytest.fixture(params=[ReferenceBlockManager, pagedkv.BlockManager], ids=["reference", "rust"])
def impl(request: pytest.FixtureRequest) -> Any:
    return request.param


def cpu_keys(events: list[Any], known: set[tuple[int, bytes]]) -> set[tuple[int, bytes]]:
    """Apply the CPU-medium events to the set of keys a router believes the CPU holds."""
    for e in events:
        if getattr(e, "medium", None) != "CPU":
            continue
        key = (e.group_idx, e.block_hashes[0])
        if isinstance(e, BlockStored):
            known.add(key)
        elif isinstance(e, BlockRemoved):
            assert key in known, f"removed a key never stored: {key}"
            known.discard(key)
    return known


def held(m: Any, seqs: list[int], groups: int) -> set[tuple[int, bytes]]:
    """The keys the swapped-out sequences' CPU copies hold (their full scheduled blocks)."""
    out = set()
    for s in seqs:
        if s in m and m.is_swapped(s):
            hashes = m.block_hashes(s)[: m.num_scheduled_tokens(s) // 2]
            out |= {(g, h) for g in range(groups) for h in hashes}
    return out


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("first_goes_by", ["swap_in", "free"])
def test_a_key_leaves_the_cpu_with_its_last_copy(
    impl: Any, layout: str, first_goes_by: str
) -> None:
    groups = LAYOUTS[layout]
    g = len(groups) if groups else 1
    kw: dict[str, Any] = {"groups": groups} if groups else {}
    m = impl(32, 2, num_cpu_blocks=32, enable_kv_events=True, **kw)
    m.allocate(1, P)
    m.allocate(2, P)  # hits 1's blocks: one prompt, two sequences
    m.drain_events()
    known: set[tuple[int, bytes]] = set()
    m.swap_out(1)
    m.swap_out(2)
    events = m.drain_events()
    stored = Counter(type(e).__name__ for e in events if e.medium == "CPU")
    assert stored == {"BlockStored": 2 * g}, "each key once, for its first copy"
    assert cpu_keys(events, known) == held(m, [1, 2], g)
    getattr(m, first_goes_by)(1)
    events = m.drain_events()
    assert not [e for e in events if getattr(e, "medium", None) == "CPU"], events
    assert cpu_keys(events, known) == held(m, [1, 2], g) != set()
    if first_goes_by == "swap_in":
        m.swap_out(1)  # two copies again
    m.drain_events()
    m.free(2)
    if first_goes_by == "swap_in":
        m.swap_in(1)
    events = m.drain_events()
    removed = [e for e in events if isinstance(e, BlockRemoved) and e.medium == "CPU"]
    assert len(removed) == 2 * g, "the last copy of each key announces it gone"
    assert cpu_keys(events, known) == held(m, [1, 2], g) == set()
    m.check_invariants()
