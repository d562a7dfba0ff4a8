"""`EventQueue`: a `TieredCache`'s tier events, bounded as the manager's queue is
(docs/events.md, "Bounded queues"), with the set of blocks they describe for snapshots.

The same contract as the core's event log: every event is folded into `described` (stored:
in; removed: out; cleared: empty) under the one lock that also queues it, so a snapshot is
taken between two events and the drains after it continue it exactly. A push that finds
the queue full drops it and every event until the next snapshot, counted, and never waits.
"""

from __future__ import annotations

import threading

from pagedkv.errors import InvalidArgumentError, KVEventsOverflowError
from pagedkv.events import (
    DEFAULT_EVENT_CAPACITY,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    KVEventQueueStats,
    parents_first,
)

_Key = tuple[str | None, int, bytes]


class EventQueue:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        # Each field below holds its invariant whenever `_lock` is free.
        self._queue: list[KVEvent] = []  # undrained events, in order; empty while overflowed
        # The most undrained events (None: unbounded): bounded by default at the manager's
        # and the publisher's DEFAULT_EVENT_CAPACITY, so that events nobody drains cannot
        # grow without bound.
        self._capacity: int | None = DEFAULT_EVENT_CAPACITY
        self._overflowed = False  # events were lost since the last snapshot
        self._dropped = 0
        self._overflows = 0
        # (medium, group, hash) -> its one-block BlockStored, in the order last stored
        # (dicts keep insertion order; a re-store moves the key to the end).
        self._described: dict[_Key, BlockStored] = {}

    def push(self, e: KVEvent) -> None:
        with self._lock:
            d = self._described
            if isinstance(e, BlockStored):
                bs, parent = e.block_size, e.parent_block_hash
                for i, h in enumerate(e.block_hashes):
                    key = (e.medium, e.group_idx, h)
                    d.pop(key, None)
                    toks = e.token_ids[i * bs : (i + 1) * bs]
                    d[key] = BlockStored([h], parent, toks, bs, e.lora_id, e.medium, e.group_idx)
                    parent = h
            elif isinstance(e, BlockRemoved):
                for h in e.block_hashes:
                    d.pop((e.medium, e.group_idx, h), None)
            elif isinstance(e, AllBlocksCleared):
                d.clear()
            else:
                raise TypeError(f"not a KV event: {e!r}")
            if self._overflowed:
                self._dropped += 1
            elif self._capacity is not None and len(self._queue) >= self._capacity:
                self._dropped += len(self._queue) + 1
                self._overflows += 1
                self._overflowed = True
                self._queue = []
            else:
                self._queue.append(e)

    def drain(self) -> list[KVEvent]:
        with self._lock:
            if self._overflowed:
                raise KVEventsOverflowError(
                    f"the tier event queue overflowed its capacity of {self._capacity} "
                    f"events and {self._dropped} events were not delivered; take "
                    "kv_event_snapshot() to start again from the described set"
                )
            out, self._queue = self._queue, []
            return out

    def snapshot(self) -> list[BlockStored]:
        """The described blocks, parents first (else oldest first); the queue restarts."""
        with self._lock:
            self._queue = []
            self._overflowed = False
            # One C-level copy under the lock; the ordering runs after it, so that a push
            # (a demotion's events) never waits for a sort.
            d = dict(self._described)

        def parent(k: _Key) -> _Key | None:
            p = d[k].parent_block_hash
            return None if p is None else (k[0], k[1], p)

        return [d[k] for k in parents_first(d, parent)]

    def set_capacity(self, capacity: int | None) -> None:
        c: object = capacity
        if c is not None and (isinstance(c, bool) or not isinstance(c, int) or c < 1):
            raise InvalidArgumentError(
                f"capacity must be an int >= 1 or None (unbounded), got {capacity!r}"
            )
        with self._lock:
            self._capacity = capacity

    def stats(self) -> KVEventQueueStats:
        with self._lock:
            return KVEventQueueStats(
                queued=len(self._queue),
                capacity=self._capacity,
                dropped=self._dropped,
                overflows=self._overflows,
                blocks=len(self._described),
            )


__all__ = ["EventQueue"]
