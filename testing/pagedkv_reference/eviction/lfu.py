"""LFU with dynamic aging (LFU-DA; Arlitt, Cherkasova et al., "Evaluating content management
techniques for Web proxy caches", 2000).

Plain LFU keeps whatever was popular once forever; LFU-DA ages it out with one number, the
cache age L (the key of the last victim):

- A block's frequency F starts at 1 when it is first cached and grows by 1 per prefix hit.
- When it becomes evictable its key is K = L + F (L as it is at that moment).
- The victim is the block of least K, ties by least recently released; L becomes its K.

So a block that stops being hit falls behind newer ones as L climbs past its K, however
many hits it once had. Frequencies are per block: they live while the block is cached or in
use and are forgotten when it is evicted or removed (LFU-DA is an in-cache LFU).
"""

from __future__ import annotations

from pagedkv_reference.eviction.base import EvictionPolicy

__all__ = ["LfuAging"]


class LfuAging(EvictionPolicy):
    name = "lfu"

    def __init__(self) -> None:
        super().__init__()
        self._age = 0  # L
        self._seq = 0  # release counter: the LRU tie-break
        self._freq: dict[int, int] = {}  # cached or revived block -> F
        self._rank: dict[int, tuple[int, int]] = {}  # evictable block -> (K, release seq)

    @property
    def age(self) -> int:
        return self._age

    def _insert(self, block: int, now: float, key: bytes, revived: bool) -> None:
        if not revived:
            self._freq[block] = 1
        self._rank[block] = (self._age + self._freq[block], self._seq)
        self._seq += 1

    def _hit(self, block: int, now: float, key: bytes) -> None:
        del self._rank[block]
        self._freq[block] += 1

    def _forget(self, block: int, key: bytes) -> None:
        del self._rank[block]
        del self._freq[block]

    def _pick(self, now: float) -> int | None:
        if not self._rank:
            return None
        b = min(self._rank, key=self._rank.__getitem__)
        self._age = self._rank[b][0]
        self._forget(b, b"")
        return b

    def _peek(self, now: float) -> int | None:
        return min(self._rank, key=self._rank.__getitem__, default=None)

    def ranks(self) -> dict[int, tuple[int, int]]:
        """Evictable block -> (K, release order): for tests and debugging."""
        return dict(self._rank)
