"""KV-cache events for external indexers, with vLLM's field names.

A router or an external prefix index replays these to mirror what the manager caches.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Iterator
from dataclasses import dataclass
from typing import TypeVar

K = TypeVar("K", bound=Hashable)


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Blocks became findable by prefix lookups (registered under their digests)."""

    block_hashes: list[bytes]
    parent_block_hash: bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None = "GPU"
    group_idx: int = 0


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Cached blocks were evicted: their digests no longer hit."""

    block_hashes: list[bytes]
    medium: str | None = "GPU"
    group_idx: int = 0


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """`reset_prefix_cache` dropped every cached block."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared

DEFAULT_EVENT_CAPACITY = 1 << 18
"""The manager's event queue bound unless `set_kv_event_capacity` sets another (the core's
`events::DEFAULT_EVENT_CAPACITY`; the publisher's `queue_events` default): events nobody
drains cost at most about 50 MB, and past it the queue overflows as any bounded one does."""


@dataclass(frozen=True, slots=True)
class KVEventQueueStats:
    """The event queue's state (`BlockManager.kv_event_queue_stats()`)."""

    queued: int
    """Events waiting to be drained."""
    capacity: int | None
    """The most events the queue holds (`DEFAULT_EVENT_CAPACITY` unless set); None:
    unbounded."""
    dropped: int
    """Events never delivered: those queued when the queue overflowed, and every one after,
    until the next `kv_event_snapshot()`."""
    overflows: int
    """Times the queue overflowed."""
    blocks: int
    """Blocks the events so far describe: what `kv_event_snapshot()` lists."""


def parents_first(keys: Iterable[K], parent: Callable[[K], K | None]) -> Iterator[K]:
    """`keys` in their order, except that each comes after its ancestors among them
    (`parent(k)`: the key of k's parent, or None; keys outside `keys` end a chain). How a
    set of blocks is announced again so that an indexer can chain each to its parent."""
    order = list(keys)
    present = set(order)
    done: set[K] = set()
    for key in order:
        chain: list[K] = []
        k: K | None = key
        while k is not None and k not in done and k in present and len(chain) <= len(present):
            chain.append(k)
            k = parent(k)
        for c in reversed(chain):
            if c not in done:
                done.add(c)
                yield c


__all__ = [
    "DEFAULT_EVENT_CAPACITY",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "KVEvent",
    "KVEventQueueStats",
    "parents_first",
]
