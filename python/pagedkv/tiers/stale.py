"""Table entries below a tier hit that hold no KV (docs/tiers.md, "Promotion").

A hit of `L` blocks served from the tiers needs, in a sliding-window or chunked-local group,
only the blocks from `first_needed(g, L)` on. The manager, which counts the tier's blocks as
scheduled tokens, still gives that group new blocks for the positions before them (it nulls
only what its own GPU hit skips): nothing loads them and the step does not compute them.
`TieredCache` withdraws them from the prefix cache, and the manager releases them at the
sequence's next step; until then they sit in the table as ordinary entries. Attention past
the hit never reads them, but a `truncate` back into them would make them the window's
again: `StaleEntries` remembers their block range per sequence (and its forks) so that such
a truncate is refused, as the manager refuses one into entries it released.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from pagedkv.errors import InvalidArgumentError
from pagedkv.groups import KVCacheGroup

#: Per group, the block range `[lo, hi)` whose entries hold no KV (`lo == hi`: none).
Ranges = tuple[tuple[int, int], ...]
#: Past this many tracked sequences, those the manager no longer holds are dropped.
_PRUNE_AT = 4096


class StaleEntries:
    """The stale block ranges of each sequence a tiered allocation left them in. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ranges: dict[int, Ranges] = {}

    def set(self, seq_id: int, ranges: Ranges, live: object) -> None:
        """Record `seq_id`'s ranges (none: forget it). `live` is the manager: sequences it
        no longer holds (freed without this cache) are dropped once many are tracked."""
        with self._lock:
            if not any(lo < hi for lo, hi in ranges):
                self._ranges.pop(seq_id, None)
                return
            self._ranges[seq_id] = ranges
            if len(self._ranges) > _PRUNE_AT:
                for sid in [s for s in self._ranges if s not in live]:  # type: ignore[operator]
                    del self._ranges[sid]

    def get(self, seq_id: int) -> Ranges | None:
        with self._lock:
            return self._ranges.get(seq_id)

    def clip(self, seq_id: int, end: int) -> None:
        """Entries from block `end` on are computed by the step (a load that stopped early
        serves a shorter hit): only those below `end` stay stale."""
        with self._lock:
            ranges = self._ranges.get(seq_id)
            if ranges is not None:
                self._ranges[seq_id] = tuple((lo, min(hi, max(lo, end))) for lo, hi in ranges)

    def fork(self, parent_id: int, child_id: int) -> None:
        with self._lock:
            ranges = self._ranges.get(parent_id)
            if ranges is not None:
                self._ranges[child_id] = ranges

    def drop(self, seq_id: int) -> None:
        with self._lock:
            self._ranges.pop(seq_id, None)

    def __len__(self) -> int:
        with self._lock:
            return len(self._ranges)

    def check_truncate(
        self, seq_id: int, num_tokens: int, kinds: Sequence[KVCacheGroup], block_size: int
    ) -> None:
        """Refuse (before anything changes) a truncate to `num_tokens` after which some
        group would need a stale entry."""
        ranges = self.get(seq_id)
        if ranges is None or num_tokens <= 0:
            return
        end = -(-num_tokens // block_size)
        for g, (kind, (lo, hi)) in enumerate(zip(kinds, ranges, strict=True)):
            first = kind.skipped_tokens(num_tokens) // block_size
            if max(first, lo) < min(end, hi):
                raise InvalidArgumentError(
                    f"truncate({seq_id}, {num_tokens}): group {g} ({kind.kind}) would need "
                    f"blocks {max(first, lo)}..{min(end, hi) - 1} of its table, which its "
                    "tier hit skipped and nothing computed (they hold no KV)"
                )


__all__ = ["Ranges", "StaleEntries"]
