"""Priority retention with TensorRT-LLM's meaning, plus pins.

Each block has a retention priority in [0, 100] (default 35, TensorRT-LLM's
`kDefaultRetentionPriority`) and an optional duration in seconds:

- Every evictable block of lower priority is evicted before any of higher priority; within
  one priority, least recently released first (LRU).
- The duration starts when the block is released (becomes evictable), as TensorRT-LLM's
  `releaseBlock` sets the expiration time. When it runs out the block returns to the default
  priority for good, and counts as released at its deadline: it joins the default level
  ahead of every block released after the deadline, and of those released at the very same
  instant. The deadline is inclusive (expired when now >= deadline), as TensorRT-LLM's
  `refresh` tests it. The result depends only on the times, never on when `victim` runs
  (TensorRT-LLM appends an expired block to the default queue whenever it next refreshes,
  so there its place depends on that moment).
- A block at the default priority has no deadline (TensorRT-LLM only queues expiry for
  non-default priorities).
- NEVER_EVICT (a pin) is a level above 100: a pinned block is never a victim; `victim`
  returns None when only pinned blocks are evictable. A pin may carry a duration too, after
  which it is an ordinary default-priority block.

`set_retention` is per block. Set on a block in use, it applies from the block's next
release (the manager sets it when it writes the block, from `allocate(retention=...)`); set
on an evictable block, it applies at once: the block keeps its release time and its new
duration counts from `now`. It survives prefix hits (a revived block is released again with
its priority and a fresh full duration, unless the old one had run out; the manager calls
`set_retention` again when the reviving request has its own retention for the block, which
then overrides, as TensorRT-LLM's `claimBlock` does. Unlike `claimBlock`, a revival without
retention keeps the duration: TensorRT-LLM clears it, which leaves the block at its raised
priority for good) and is forgotten
when the block is evicted or removed. The owner of a block that goes free unhashed resets it
with `set_retention(block, DEFAULT_PRIORITY)`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

from pagedkv_reference.eviction.base import EvictionPolicy, check_block, check_int, check_number

__all__ = [
    "DEFAULT_PRIORITY",
    "MAX_PRIORITY",
    "MIN_PRIORITY",
    "NEVER_EVICT",
    "Priority",
    "per_block_retention",
]

MIN_PRIORITY = 0
MAX_PRIORITY = 100
DEFAULT_PRIORITY = 35
NEVER_EVICT = MAX_PRIORITY + 1
"""The pin level: above every priority, and never a victim."""


Range = tuple[int, int | None, int, float | None]
"""(start_token, end_token or None for "to the end", priority, duration_s or None)."""


def per_block_retention(
    ranges: Sequence[Range], block_size: int, num_tokens: int
) -> list[tuple[int, float | None] | None]:
    """The (priority, duration) of each block of a prompt of `num_tokens` tokens, from
    token-range retention (`allocate(retention=...)`), as TensorRT-LLM's
    `getPerBlockRetentionPriorityDuration` maps them: ranges are taken in start order and
    must not overlap nor be empty; a block takes the range holding its first token; None
    where no range does (the block keeps the default)."""
    bs = check_int(block_size, "block_size", 1)
    n = check_int(num_tokens, "num_tokens")
    rs = sorted(ranges, key=lambda r: r[0])
    for i, (start, end, prio, dur) in enumerate(rs):
        check_int(start, "start_token")
        if end is not None and check_int(end, "end_token") <= start:
            raise ValueError(f"retention range [{start}, {end}) is empty")
        if check_int(prio, "priority") > NEVER_EVICT:
            raise ValueError(f"priority {prio} out of range [{MIN_PRIORITY}, {MAX_PRIORITY}]")
        if dur is not None and not check_number(dur, "duration_s") >= 0:
            raise ValueError(f"duration_s must be >= 0, got {dur}")
        if i + 1 < len(rs) and (end is None or end > rs[i + 1][0]):
            raise ValueError(f"retention ranges overlap at token {rs[i + 1][0]}")
    out: list[tuple[int, float | None] | None] = []
    for t in range(0, n, bs):
        hit = next((r for r in rs if r[0] <= t and (r[1] is None or t < r[1])), None)
        out.append(None if hit is None else (hit[2], hit[3]))
    return out


_Carried = tuple[tuple[int, float | None], tuple[int, float | None, float] | None]
"""What a moved block carries: (its retention, (priority, deadline, release time) if cached)."""


@dataclass
class _Entry:
    """An evictable block's rank."""

    priority: int
    deadline: float | None  # when it returns to DEFAULT_PRIORITY
    released: float  # the release time: the LRU order within a level
    seq: int  # the release order: ties at one instant

    def rank(self, now: float) -> tuple[int, float, int, int]:
        """(level, time, kind, seq), least first; an expired block is (default, deadline, 0)
        so that it goes before blocks released at its deadline (kind 1)."""
        if self.deadline is not None and self.deadline <= now:
            return (DEFAULT_PRIORITY, self.deadline, 0, self.seq)
        return (self.priority, self.released, 1, self.seq)


class Priority(EvictionPolicy):
    name = "priority"

    def __init__(self) -> None:
        super().__init__()
        self._seq = 0
        self._retention: dict[int, tuple[int, float | None]] = {}  # block -> (prio, duration)
        self._entries: dict[int, _Entry] = {}  # evictable block -> its rank
        self._peeked_at: float | None = None  # the latest peek's time, while no call came

    def set_retention(
        self,
        block: int,
        priority: int,
        duration_s: float | None = None,
        *,
        now: float | None = None,
    ) -> None:
        """Give `block` a priority (MIN_PRIORITY..MAX_PRIORITY, or NEVER_EVICT) for
        `duration_s` seconds (None: until changed). `now` is required when the block is
        evictable, where the change takes effect at once."""
        b = check_block(block)
        prio = check_int(priority, "priority", MIN_PRIORITY)
        if prio > NEVER_EVICT:
            raise ValueError(
                f"priority {prio} out of range [{MIN_PRIORITY}, {MAX_PRIORITY}] "
                f"(or NEVER_EVICT = {NEVER_EVICT})"
            )
        dur = None if duration_s is None else check_number(duration_s, "duration_s")
        if dur is not None and dur < 0:
            raise ValueError(f"duration_s must be >= 0, got {dur}")
        if b in self._entries:
            if now is None:
                raise ValueError(f"block {b} is cached: set_retention needs now=")
            self._tick(now)
            e = self._entries[b]
            e.priority = prio
            e.deadline = self._deadline(prio, dur, self._now)
        self._retention[b] = (prio, dur)
        self._peeked_at = self._peeked = None  # a call between a peek and its victim

    def pin(self, block: int, *, now: float | None = None) -> None:
        """Never evict `block` (until `unpin`)."""
        self.set_retention(block, NEVER_EVICT, now=now)

    def unpin(self, block: int, *, now: float | None = None) -> None:
        """Back to the default priority."""
        self.set_retention(block, DEFAULT_PRIORITY, now=now)

    def priority_of(self, block: int, now: float) -> int:
        """The block's effective priority at `now` (its retention if not cached)."""
        e = self._entries.get(block)
        if e is not None:
            return e.rank(now)[0]
        return self._retention.get(block, (DEFAULT_PRIORITY, None))[0]

    def cross_rank(self, block: int, now: float) -> tuple[float, ...]:
        """(level, time, kind) at `now`, or at the latest peek's time while no call came
        since (the time its choice was made; the victim right after it keeps it too)."""
        at = now if self._peeked_at is None else self._peeked_at
        return self._entries[block].rank(at)[:3]

    @property
    def num_pinned(self) -> int:
        """Evictable blocks that `victim` may not take now (pins not yet expired)."""
        return sum(1 for e in self._entries.values() if e.rank(self._now)[0] == NEVER_EVICT)

    @staticmethod
    def _deadline(priority: int, duration_s: float | None, now: float) -> float | None:
        if duration_s is None or priority == DEFAULT_PRIORITY:
            return None
        return now + duration_s

    def _insert(self, block: int, now: float, key: bytes, revived: bool) -> None:
        self._peeked_at = None
        prio, dur = self._retention.get(block, (DEFAULT_PRIORITY, None))
        self._entries[block] = _Entry(prio, self._deadline(prio, dur, now), now, self._seq)
        self._seq += 1

    def _hit(self, block: int, now: float, key: bytes) -> None:
        self._peeked_at = None
        e = self._entries.pop(block)
        if e.deadline is not None and e.deadline <= now:  # ran out while cached: for good
            self._retention[block] = (DEFAULT_PRIORITY, None)

    def _carried(self, block: int, in_set: bool) -> object:
        """(retention, (priority, deadline, release time) if cached): a moved block keeps
        its place in the order, which is a function of those times."""
        r = self._retention.get(block, (DEFAULT_PRIORITY, None))
        e = self._entries.get(block) if in_set else None
        return (r, None if e is None else (e.priority, e.deadline, e.released))

    def _forget_held(self, block: int) -> None:
        self._retention.pop(block, None)

    def _insert_carried(self, block: int, now: float, key: bytes, carried: object) -> None:
        """A moved block: its retention, and its level, deadline and release time if it was
        cached (behind the blocks here released at the same instant); else as released now."""
        r, rank = cast("_Carried", carried)
        if r != (DEFAULT_PRIORITY, None):
            self._retention[block] = r
        else:
            self._retention.pop(block, None)
        if rank is None:
            self._insert(block, now, key, False)
            return
        self._peeked_at = None
        prio, deadline, released = rank
        self._entries[block] = _Entry(prio, deadline, released, self._seq)
        self._seq += 1

    def _forget(self, block: int, key: bytes) -> None:
        self._peeked_at = None
        del self._entries[block]
        self._retention.pop(block, None)

    def _miss(self, key: bytes, now: float) -> None:
        self._peeked_at = None

    def _first(self, now: float) -> int | None:
        """The least unpinned block by rank at `now`."""
        ranks = {b: e.rank(now) for b, e in self._entries.items()}
        movable = [b for b, r in ranks.items() if r[0] != NEVER_EVICT]
        return min(movable, key=ranks.__getitem__, default=None)

    def passed_over(self) -> None:
        """Forget the peek's time and block: the next peek expires and ranks at its own `now`
        (issue 32 item 8: a passed-over peek's time kept an expired block at its level)."""
        self._peeked_at = self._peeked = None

    def _peek(self, now: float) -> int | None:
        if self._peeked_at is None:
            self._peeked_at = now
        return self._first(self._peeked_at)

    def _pick(self, now: float) -> int | None:
        # Right after a peek, the order at the peek's time: the victim is the peeked block
        # even if a deadline passed since (as the Rust core, whose clock runs on).
        at = now if self._peeked_at is None else self._peeked_at
        self._peeked_at = None
        b = self._first(at)
        if b is not None:
            self._forget(b, b"")
        return b

    def order(self, now: float) -> list[int]:
        """The evictable, unpinned blocks in eviction order at `now` (does not tick)."""
        ranks = {b: e.rank(now) for b, e in self._entries.items()}
        return sorted((b for b in ranks if ranks[b][0] != NEVER_EVICT), key=ranks.__getitem__)
