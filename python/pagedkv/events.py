"""KV-cache events for external indexers, with vLLM's field names.

A router or an external prefix index replays these to mirror what the manager caches.
"""

from __future__ import annotations

from dataclasses import dataclass


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


@dataclass(frozen=True, slots=True)
class KVEventQueueStats:
    """The event queue's state (`BlockManager.kv_event_queue_stats()`)."""

    queued: int
    """Events waiting to be drained."""
    capacity: int | None
    """The most events the queue holds; None: unbounded (the default)."""
    dropped: int
    """Events never delivered: those queued when the queue overflowed, and every one after,
    until the next `kv_event_snapshot()`."""
    overflows: int
    """Times the queue overflowed."""
    blocks: int
    """Blocks the events so far describe: what `kv_event_snapshot()` lists."""


__all__ = ["AllBlocksCleared", "BlockRemoved", "BlockStored", "KVEvent", "KVEventQueueStats"]
