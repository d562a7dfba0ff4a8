"""The plain eviction-policy interface over the CACHED blocks of a block manager.

A policy sees only the evictable set: blocks released with refcount 0 while hashed. The
manager tells it four things and asks one:

- `on_cached(block, now, key)`: the block became CACHED (evictable) under digest `key`.
- `on_hit(block, now)`: a prefix hit revived the CACHED block: it leaves the evictable set
  (it is in use again) and the hit counts as an access for the policies that count them.
- `on_removed(block)`: the CACHED block was claimed for another reason (reset, withdrawal
  of bad KV): it leaves the set without being an eviction and without counting as an access.
- `victim(now)`: the next block to evict, removed from the set; None when nothing may go.
- `peek(now)`: the block the next `victim` returns if no other call comes in between, left
  in the set (tenant quotas choose among the tenants' next victims with it). It may do for
  real the bookkeeping `victim` does before it chooses: S3-FIFO moves S's reused oldest
  blocks to M and reinserts M's oldest with an access spent, so a peek changes its later
  order even when no victim follows; for the other policies the order is as if the peek
  never happened. The `victim` right after a peek returns the peeked block even at a later
  `now` (the priority policy keeps the peek's time for it), as the Rust core does.

And one optional report, for the policies with ghosts (S3-FIFO, ARC):

- `on_miss(key, now)`: a request needs `key` and the cache does not have it (the manager
  reports the keys past a prompt's hit when it admits it). The paper algorithms look their
  ghosts up at the request, before they evict for it; a block is only cached (`on_cached`)
  after it is computed, and the evictions made meanwhile could push its key out of the
  ghost list first. A key that was never reported is still looked up at `on_cached`.

`now` is the manager's clock in seconds (a simulated clock in the tests); it must never go
back, because retention deadlines and recency stamps are compared across calls.

For tenant quotas (`quotas`), a block may move from one instance to another:

- `carry_out(block, in_set)`: take the block out of this instance (in the set: as by
  `on_removed`; held since a hit: its revival memory here is dropped) and return what it
  carries along; `carry_in(block, now, key, carried)` caches it in the other instance with
  that. Only the priority policy carries anything (its retention, and a cached block's
  level, deadline and release time); the others place it as a new block.

A revived block that is released again with the same key is the same cached content coming
back, not a new insertion: the base class remembers the key each hit took out (`_revived`)
and tells `_insert` so, which is how S3-FIFO, ARC and LFU keep a block's history across the
time it spends in use. Bad input raises ValueError (or TypeError) and changes no state.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

__all__ = ["EvictionPolicy", "check_block", "check_int", "check_num_blocks", "check_number"]


def check_num_blocks(num_blocks: object) -> int:
    """The cache size `c` of the policies that need one: the manager's block count."""
    return check_int(num_blocks, "num_blocks", 1)


def check_int(x: object, what: str, lo: int = 0) -> int:
    """An int (not a bool) >= `lo`, else TypeError or ValueError naming `what`."""
    if not isinstance(x, int) or isinstance(x, bool):
        raise TypeError(f"{what} must be an int, got {type(x).__name__}")
    if x < lo:
        raise ValueError(f"{what} must be >= {lo}, got {x}")
    return x


def check_number(x: object, what: str) -> float:
    """A real number (int or float, not a bool, not NaN), else TypeError or ValueError."""
    if not isinstance(x, (int, float)) or isinstance(x, bool):
        raise TypeError(f"{what} must be a number, got {type(x).__name__}")
    if x != x:  # NaN compares false with everything: no order could hold
        raise ValueError(f"{what} must not be NaN")
    return float(x)


def check_block(block: object) -> int:
    return check_int(block, "block")


class EvictionPolicy(ABC):
    """Base of every policy: argument checks, the clock and the evictable set's keys."""

    name: ClassVar[str]

    def __init__(self) -> None:
        self._now = float("-inf")
        self._keys: dict[int, bytes] = {}  # evictable block -> its digest
        self._revived: dict[int, bytes] = {}  # block taken out by a hit -> its digest
        self._peeked: int | None = None  # the latest peek's block while no call came since

    # ------------------------------------------------------------------ the interface

    def on_cached(self, block: int, now: float, key: bytes) -> None:
        b = check_block(block)
        if not isinstance(key, bytes):
            raise TypeError(f"key must be bytes, got {type(key).__name__}")
        if b in self._keys:
            raise ValueError(f"block {b} is already cached")
        self._tick(now)
        revived = self._revived.pop(b, None) == key
        self._peeked = None
        self._keys[b] = key
        self._insert(b, self._now, key, revived)

    def on_miss(self, key: bytes, now: float) -> None:
        if not isinstance(key, bytes):
            raise TypeError(f"key must be bytes, got {type(key).__name__}")
        self._tick(now)
        self._peeked = None
        self._miss(key, self._now)

    def on_hit(self, block: int, now: float) -> None:
        b = self._member(block)
        self._tick(now)
        self._peeked = None
        key = self._keys.pop(b)
        self._revived[b] = key
        self._hit(b, self._now, key)

    def on_removed(self, block: int) -> None:
        b = self._member(block)
        key = self._keys.pop(b)
        self._peeked = None
        self._forget(b, key)

    def carry_out(self, block: int, in_set: bool) -> object:
        """Take `block` out to move it to another instance (module docs); returns what it
        carries (None: nothing)."""
        b = check_block(block)
        carried = self._carried(b, in_set)
        if in_set:
            self.on_removed(b)
        else:
            if b in self._keys:
                raise ValueError(f"block {b} is in the evictable set")
            self._peeked = None
            self._revived.pop(b, None)
            self._forget_held(b)
        return carried

    def carry_in(self, block: int, now: float, key: bytes, carried: object) -> None:
        """`on_cached` of a block moved here with what it carried (`carry_out`): never a
        revival here (its history stayed behind)."""
        b = check_block(block)
        if b in self._keys:
            raise ValueError(f"block {b} is already cached")
        self._tick(now)
        self._revived.pop(b, None)
        self._peeked = None
        self._keys[b] = key
        if carried is None:
            self._insert(b, self._now, key, False)
        else:
            self._insert_carried(b, self._now, key, carried)

    def victim(self, now: float) -> int | None:
        self._tick(now)
        peeked, self._peeked = self._peeked, None
        b = self._pick(self._now)
        assert peeked is None or b == peeked, f"victim {b} is not the peeked block {peeked}"
        if b is not None:
            del self._keys[b]
        return b

    def peek(self, now: float) -> int | None:
        """The block the next `victim` returns if no other call comes in between, left in
        the set (module docs); None when the set is empty."""
        self._tick(now)
        b = self._peek(self._now)
        assert self._peeked is None or b == self._peeked, f"peek {b} after {self._peeked}"
        assert b is None or b in self._keys, f"peek {b} is not in the set"
        self._peeked = b
        return b

    def passed_over(self) -> None:  # noqa: B027 (optional hook)
        """The latest peek was passed over (`quotas` evicted another instance's block): it
        binds no later call. Only the priority policy keeps anything of it (its time)."""

    def __len__(self) -> int:
        """Blocks in the evictable set (pinned ones included)."""
        return len(self._keys)

    def __contains__(self, block: object) -> bool:
        return block in self._keys

    def entries(self) -> list[tuple[int, bytes]]:
        """The evictable set: (block, key) pairs in no particular order (audits)."""
        return list(self._keys.items())

    def cross_rank(self, block: int, now: float) -> tuple[float, ...]:
        """What orders this policy's candidate against other instances' candidates before
        their release order (`quotas`): nothing by default."""
        return ()

    # ------------------------------------------------------------------ for subclasses

    @abstractmethod
    def _insert(self, block: int, now: float, key: bytes, revived: bool) -> None:
        """Place a block that just became evictable; `revived`: it left by a hit."""

    @abstractmethod
    def _forget(self, block: int, key: bytes) -> None:
        """Take an evictable block out of every structure (no history kept)."""

    def _hit(self, block: int, now: float, key: bytes) -> None:
        """A hit took the block out; by default it is just forgotten (LRU, FIFO-like)."""
        self._forget(block, key)

    def _miss(self, key: bytes, now: float) -> None:  # noqa: B027 (optional hook)
        """A request missed `key`; only the policies with ghosts care."""

    def _carried(self, block: int, in_set: bool) -> object:
        """What `block` carries to another instance: nothing but for priority."""
        return None

    def _forget_held(self, block: int) -> None:  # noqa: B027 (optional hook)
        """A held block leaves for another instance: drop what waits for its release."""

    def _insert_carried(self, block: int, now: float, key: bytes, carried: object) -> None:
        """Place a block moved here with what it carried (only priority carries any)."""
        raise NotImplementedError(f"{self.name} carries nothing")

    @abstractmethod
    def _pick(self, now: float) -> int | None:
        """Choose and remove the victim from the policy's own structures; right after
        `_peek`, the block it named."""

    @abstractmethod
    def _peek(self, now: float) -> int | None:
        """The block `_pick` would choose now, left in (`peek`)."""

    # ------------------------------------------------------------------ helpers

    def _member(self, block: object) -> int:
        b = check_block(block)
        if b not in self._keys:
            raise ValueError(f"block {b} is not cached (not in the evictable set)")
        return b

    def _tick(self, now: object) -> None:
        """Advance the clock; raises (changing nothing) if `now` is not a number or goes
        back."""
        self._now = self.check_now(now)

    def check_now(self, now: object) -> float:
        """`now` as a float; raises, as every call given it would, if it is not a number
        or is before the last time seen. Changes nothing."""
        t = check_number(now, "now")
        if t < self._now:
            raise ValueError(f"now {t} is before the last time seen, {self._now}")
        return t
