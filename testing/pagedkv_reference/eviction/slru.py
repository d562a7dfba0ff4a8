"""Segmented LRU (SLRU; Karedla, Love and Wherry, "Caching strategies to improve disk system
performance", IEEE Computer 1994).

Two LRU segments: probationary (blocks used once) and protected (blocks used again). The
rules:

- A new block enters the probationary segment's MRU end.
- A hit moves a block to the protected segment's MRU end: here, since a hit takes the block
  out (it is in use), it enters there when it is released again.
- The protected segment holds at most `protected_ratio` (0.8) of `num_blocks`; a block
  pushed past that is demoted to the probationary segment's MRU end (a second chance).
- The victim is the probationary segment's LRU block, or the protected one's when the
  probationary segment is empty.

As with ARC, only evictable blocks count in the segments: a block in use is in neither.
"""

from __future__ import annotations

from collections import OrderedDict

from pagedkv_reference.eviction.base import EvictionPolicy, check_num_blocks

__all__ = ["Slru"]


class Slru(EvictionPolicy):
    name = "slru"

    def __init__(self, num_blocks: int, *, protected_ratio: float = 0.8) -> None:
        super().__init__()
        c = check_num_blocks(num_blocks)
        if not 0.0 < protected_ratio < 1.0:
            raise ValueError(f"protected_ratio must be in (0, 1), got {protected_ratio}")
        self._cap = max(1, int(c * protected_ratio))
        self._probation: OrderedDict[int, None] = OrderedDict()  # LRU first
        self._protected: OrderedDict[int, None] = OrderedDict()

    def _insert(self, block: int, now: float, key: bytes, revived: bool) -> None:
        if not revived:
            self._probation[block] = None
            return
        self._protected[block] = None
        while len(self._protected) > self._cap:
            demoted = self._protected.popitem(last=False)[0]
            self._probation[demoted] = None

    def _forget(self, block: int, key: bytes) -> None:
        if block in self._probation:
            del self._probation[block]
        else:
            del self._protected[block]

    def _pick(self, now: float) -> int | None:
        seg = self._probation or self._protected
        if not seg:
            return None
        return seg.popitem(last=False)[0]

    def _peek(self, now: float) -> int | None:
        return next(iter(self._probation or self._protected), None)

    def segments(self) -> tuple[list[int], list[int]]:
        """(probationary, protected), each LRU first: for tests and debugging."""
        return list(self._probation), list(self._protected)
