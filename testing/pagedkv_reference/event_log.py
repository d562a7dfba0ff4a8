"""The reference's KV event queue: a list, an optional bound, and the blocks its events
describe, written plainly (the oracle of the core's `events.rs`; docs/events.md, "Bounded
queues")."""

from __future__ import annotations

from pagedkv.errors import InvalidArgumentError, KVEventsOverflowError
from pagedkv.events import (
    DEFAULT_EVENT_CAPACITY,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    KVEventQueueStats,
)

Key = tuple[str | None, int, bytes]


class EventLog:
    def __init__(self) -> None:
        self.queue: list[KVEvent] = []
        self.capacity: int | None = DEFAULT_EVENT_CAPACITY  # None: unbounded
        self.overflowed = False
        self.dropped = 0
        self.overflows = 0
        # Every block the events describe, in the order each was last stored.
        self.described: dict[Key, BlockStored] = {}

    def push(self, e: KVEvent) -> None:
        if isinstance(e, BlockStored):
            (h,) = e.block_hashes
            key = (e.medium, e.group_idx, h)
            self.described.pop(key, None)  # a re-store counts as the newest
            self.described[key] = e
        elif isinstance(e, BlockRemoved):
            for h in e.block_hashes:
                self.described.pop((e.medium, e.group_idx, h), None)
        else:
            assert isinstance(e, AllBlocksCleared)
            self.described.clear()
        if self.overflowed:
            self.dropped += 1
        elif self.capacity is not None and len(self.queue) >= self.capacity:
            self.dropped += len(self.queue) + 1
            self.overflows += 1
            self.overflowed = True
            self.queue = []
        else:
            self.queue.append(e)

    def drain(self) -> list[KVEvent]:
        if self.overflowed:
            raise KVEventsOverflowError("the KV event queue overflowed")
        out, self.queue = self.queue, []
        return out

    def snapshot(self) -> list[BlockStored]:
        """Parents before children; otherwise oldest first (by when each was last stored).
        A block is listed at its place unless its parent is listed later (stored again after
        it) or waits itself: then right after its parent, each child followed by its own."""
        self.queue = []
        self.overflowed = False
        keys = list(self.described)
        pos = {k: i for i, k in enumerate(keys)}
        out: list[BlockStored] = []
        waiting: dict[Key, list[Key]] = {}  # parent -> children waiting for it, in order
        wait_set: set[Key] = set()

        def emit(k: Key) -> None:
            stack = [k]
            while stack:
                c = stack.pop()
                out.append(self.described[c])
                wait_set.discard(c)
                stack.extend(reversed(waiting.pop(c, [])))

        for i, k in enumerate(keys):
            parent = self.described[k].parent_block_hash
            pk = None if parent is None else (k[0], k[1], parent)
            if pk is not None and (pk in wait_set or pos.get(pk, -1) > i):
                waiting.setdefault(pk, []).append(k)
                wait_set.add(k)
                continue
            emit(k)
        # Left waiting: a parent cycle (only colliding digests make one), in order.
        out.extend(self.described[k] for k in sorted(wait_set, key=pos.__getitem__))
        return out

    def set_capacity(self, capacity: int | None) -> None:
        c: object = capacity
        if c is not None and (isinstance(c, bool) or not isinstance(c, int) or c < 1):
            raise InvalidArgumentError(f"capacity must be >= 1 or None, got {capacity!r}")
        self.capacity = capacity

    def stats(self) -> KVEventQueueStats:
        return KVEventQueueStats(
            queued=len(self.queue),
            capacity=self.capacity,
            dropped=self.dropped,
            overflows=self.overflows,
            blocks=len(self.described),
        )
