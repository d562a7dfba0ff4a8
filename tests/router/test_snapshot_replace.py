"""A snapshot that replaces an engine's blocks: `commit_snapshot` returns with the new blocks
counted and the old ones ignored, the old ones dropped on a thread of the index's own;
`drop_replaced` waits for that; the index is consistent throughout; a refused commit changes
nothing."""

from __future__ import annotations

import pytest

from pagedkv import _core
from pagedkv.errors import InvalidArgumentError
from pagedkv.events import BlockStored
from pagedkv.kv_events import WireEncoder
from pagedkv.router import RouterIndex


def _held(hashes: range) -> list[bytes]:
    """Compact snapshot parts of `hashes` (as a publisher's `HeldBlocks` writes them)."""
    held = _core.HeldBlocks()
    digests = [h.to_bytes(8, "big") for h in hashes]  # an 8-byte digest's integer is itself
    held.apply(WireEncoder().batch([BlockStored(digests, None, [], 4, None, "GPU", 0)]))
    return held.parts(per_part=4096)


def test_a_replacing_commit_counts_only_the_new_blocks_and_drops_the_old() -> None:
    ix = RouterIndex()
    old, new = range(1, 20_001), range(100_001, 110_001)
    ix.begin_snapshot("e")
    for p in _held(old):
        ix.apply_staged("e", p)
    ix.commit_snapshot("e")
    ix.drop_replaced()
    entries = ix.stats().entries
    assert ix.stats().memberships == len(old) == entries
    ix.begin_snapshot("e")
    for p in _held(new):
        ix.apply_staged("e", p)
    assert ix.scores(list(old)[:50]) == {"e": 50}  # staged: not seen yet
    ix.commit_snapshot("e")
    # At once: the old blocks no longer count, the new ones do, whatever the drop's progress.
    assert ix.scores(list(old)[:50]) == {}
    assert ix.scores(list(new)) == {"e": len(new)}
    assert ix.stats().memberships == len(new)
    ix.check_invariants()
    ix.drop_replaced()  # waits for the commit's own thread, or drops what it left
    assert ix.drop_replaced() == 0
    assert ix.stats().entries == len(new)
    assert ix.blocks("e") == set(new)
    ix.check_invariants()


def test_a_refused_commit_leaves_the_old_blocks() -> None:
    ix = RouterIndex()
    ix.begin_snapshot("e")
    for p in _held(range(1, 101)):
        ix.apply_staged("e", p)
    ix.commit_snapshot("e")
    with pytest.raises(InvalidArgumentError, match="no snapshot begun for engine e"):
        ix.commit_snapshot("e")
    assert ix.scores(list(range(1, 101))) == {"e": 100}
    assert ix.drop_replaced() == 0
    ix.check_invariants()
