"""LRU: least recently released first, exactly the order of today's managers.

The reference manager's default (`eviction="lru"`), the Rust core (`lru_queue.rs`) and vLLM's
free queue all evict the CACHED block whose latest release is oldest; a prefix hit
takes a block out, and its next release queues it at the newest end. The order is the order
of the `on_cached` calls, not of `now`: several releases at one instant keep their call order.
"""

from __future__ import annotations

from collections import OrderedDict

from pagedkv_reference.eviction.base import EvictionPolicy

__all__ = ["Lru"]


class Lru(EvictionPolicy):
    name = "lru"

    def __init__(self) -> None:
        super().__init__()
        self._queue: OrderedDict[int, None] = OrderedDict()  # oldest release first

    def _insert(self, block: int, now: float, key: bytes, revived: bool) -> None:
        self._queue[block] = None

    def _forget(self, block: int, key: bytes) -> None:
        del self._queue[block]

    def _pick(self, now: float) -> int | None:
        if not self._queue:
            return None
        return self._queue.popitem(last=False)[0]

    def _peek(self, now: float) -> int | None:
        return next(iter(self._queue), None)

    def order(self) -> list[int]:
        """The evictable blocks in eviction order (next victim first)."""
        return list(self._queue)
