"""An evicting `append_batch`'s events come request by request on every layout (issue 32,
item 12; docs/semantics.md, "KV-cache groups"): a sequence's evictions, then its
`BlockStored`, then the next sequence's, as vLLM emits them (one `allocate_slots` per
request) and as the one-group path always did. With groups the reference used to emit every
eviction of the batch before any registration, and `groups=[full]` (which runs the one-group
path in the core) disagreed with it."""

from __future__ import annotations

from typing import Any

import pytest

import pagedkv
from pagedkv.events import BlockStored
from pagedkv.groups import KVCacheGroup
from pagedkv_reference import ReferenceBlockManager

F = KVCacheGroup("full")
W = KVCacheGroup("sliding_window", window=8)
LAYOUTS = {"plain": None, "full": [F], "full+full": [F, F], "full+window": [F, W]}


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("impl", [ReferenceBlockManager, pagedkv.BlockManager])
def test_an_evicting_append_batch_emits_events_request_by_request(impl: type, layout: str) -> None:
    groups = LAYOUTS[layout]
    g = len(groups) if groups else 1
    null = int(groups is not None and W in groups)
    kw: dict[str, Any] = {"groups": groups} if groups else {}
    m = impl(8 * g + null, 2, enable_kv_events=True, watermark=0.0, **kw)
    m.allocate(1, [1, 2, 3, 4, 21, 22])
    m.free(1)  # 3 blocks per group cached
    assert m.allocate(2, [5, 6, 7]) == 0
    assert m.allocate(3, [9, 10, 11]) == 0  # 1 block per group free
    m.drain_events()
    # Each sequence fills its partial block (registered) and takes one block past it per
    # group for the lookahead: sequence 2 takes the free ones, sequence 3 evicts.
    assert m.append_batch([2, 3], [13, 14], lookahead=1) is not None
    kinds = [
        (type(e).__name__, e.token_ids if isinstance(e, BlockStored) else None)
        for e in m.drain_events()
    ]
    # Per group in group order within each sequence's part.
    assert kinds == [
        *[("BlockStored", [7, 13])] * g,
        *[("BlockRemoved", None)] * g,
        *[("BlockStored", [11, 14])] * g,
    ], kinds
    m.check_invariants()
