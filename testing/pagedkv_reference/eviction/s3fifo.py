"""S3-FIFO (Yang et al., "FIFO queues are all you need for cache eviction", SOSP'23).

Three FIFO queues: a small one S (the filter for blocks used once), a main one M, and a ghost
one G of keys only (recently filtered-out digests). The paper's rules, as Algorithm 1 states
them:

- A new block enters M if its key is in G (it came back soon after being filtered: it is
  reused), else S. Its frequency starts at 0.
- An access (here: a prefix hit) adds 1 to the frequency, capped at 3 (two bits).
- Eviction takes from S while S holds at least 10% of the cache, else from M (and from
  whichever is non-empty when the other is empty).
- From S: the oldest block moves to M (frequency cleared) if its frequency is above 1,
  else it is evicted and its key joins G; repeat until one is evicted.
- From M: the oldest block with frequency f > 0 is reinserted at M's newest end with f - 1;
  the first with f = 0 is evicted (its key does not join G).
- G is a FIFO of at most as many keys as M's share of the cache (90% of `num_blocks`).
  The paper looks G up at the request: here at `on_miss`, which moves a ghost key to a
  readmission list (at most `num_blocks` keys, oldest dropped) that sends its block to M
  when it is cached; a key never reported is looked up in G at `on_cached`.

Adaptations to a block manager, and why:

- The cache S's 10% is measured against is the evictable set (|S| + |M|), not `num_blocks`:
  OWNED blocks cannot be evicted, and with most blocks in use a share of `num_blocks` would
  leave S permanently "small", so M (the reused blocks) would be evicted before S's
  one-hit blocks, the opposite of the filter's purpose.
- A hit takes a block out of the evictable set (it is in use), so its FIFO position cannot
  stay as the paper's does. It keeps its queue and frequency and, when released again, goes
  to the newest end of the queue it left. Its frequency is per block (it only lives while
  the block is cached or in use); only G holds history across evictions, by key.
- A block removed for another reason (reset, withdrawal) leaves no ghost.
- `peek` (the next victim, for tenant quotas) makes the moves from S to M and M's
  reinsertions that come before the victim for real, and the victim right after it keeps
  its choice of queue (the moves shrink S, which could otherwise turn the choice to M).
  A peek followed by another call leaves its moves and not its choice.
- The paper's "if M is full then evict from M" during a move from S cannot arise: a move
  does not change the evictable set's size, and the manager asks for one victim at a time.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Literal

from pagedkv_reference.eviction.base import EvictionPolicy, check_num_blocks

__all__ = ["S3Fifo"]

Queue = Literal["small", "main"]

MAX_FREQ = 3
"""The paper's two-bit counter."""


class S3Fifo(EvictionPolicy):
    name = "s3fifo"

    def __init__(self, num_blocks: int, *, small_ratio: float = 0.1, move_to_main: int = 2) -> None:
        """`move_to_main`: the frequency a block at S's tail needs to move to M (the paper's
        `t.freq > 1`, so 2)."""
        super().__init__()
        c = check_num_blocks(num_blocks)
        if not 0.0 < small_ratio < 1.0:
            raise ValueError(f"small_ratio must be in (0, 1), got {small_ratio}")
        if not 1 <= move_to_main <= MAX_FREQ:
            raise ValueError(f"move_to_main must be in [1, {MAX_FREQ}], got {move_to_main}")
        self._ratio = small_ratio
        self._move = move_to_main
        self._ghost_cap = c - int(c * small_ratio)  # as many keys as M's share
        self._small: OrderedDict[int, None] = OrderedDict()  # oldest first
        self._main: OrderedDict[int, None] = OrderedDict()
        self._ghost: OrderedDict[bytes, None] = OrderedDict()
        self._readmit: OrderedDict[bytes, None] = OrderedDict()  # ghost keys requested
        self._readmit_cap = c
        self._freq: dict[int, int] = {}  # cached or revived block -> its frequency
        self._home: dict[int, Queue] = {}  # cached or revived block -> its queue
        self._decided: Queue | None = None  # the latest peek's queue, while no call came

    def _queue(self, q: Queue) -> OrderedDict[int, None]:
        return self._small if q == "small" else self._main

    def _insert(self, block: int, now: float, key: bytes, revived: bool) -> None:
        self._decided = None
        if revived:
            q = self._home[block]  # back to the queue it left, newest end; freq kept
        else:
            q = "main" if key in self._ghost or key in self._readmit else "small"
            self._ghost.pop(key, None)
            self._readmit.pop(key, None)
            self._freq[block] = 0
        self._home[block] = q
        self._queue(q)[block] = None

    def _miss(self, key: bytes, now: float) -> None:
        self._decided = None
        if key in self._ghost:
            del self._ghost[key]
            self._readmit[key] = None
            while len(self._readmit) > self._readmit_cap:
                self._readmit.popitem(last=False)

    def _hit(self, block: int, now: float, key: bytes) -> None:
        self._decided = None
        del self._queue(self._home[block])[block]
        self._freq[block] = min(self._freq[block] + 1, MAX_FREQ)

    def _forget(self, block: int, key: bytes) -> None:
        self._decided = None
        del self._queue(self._home.pop(block))[block]
        del self._freq[block]

    def _pick(self, now: float) -> int | None:
        q = self._settle()
        self._decided = None
        if q is None:
            return None
        queue = self._queue(q)
        b = next(iter(queue))
        del queue[b]
        if q == "small":  # evicted from S: its key joins G (from M: no ghost)
            self._ghost[self._keys[b]] = None
            while len(self._ghost) > self._ghost_cap:
                self._ghost.popitem(last=False)
        self._drop(b)
        return b

    def _peek(self, now: float) -> int | None:
        q = self._settle()
        return None if q is None else next(iter(self._queue(q)))

    def _settle(self) -> Queue | None:
        """Decide which queue the victim comes from and make the moves that come first, so
        that the victim is that queue's oldest block; None when the set is empty. Decided
        once: a peek's moves change the sizes the choice between S and M looks at, so the
        `_pick` right after it keeps the peek's choice."""
        if self._decided is not None:
            return self._decided
        total = len(self._small) + len(self._main)
        if total == 0:
            return None
        small = bool(self._small) and (len(self._small) >= self._ratio * total or not self._main)
        if small and self._settle_small():
            self._decided = "small"
        else:
            self._settle_main()  # M is non-empty here: S emptied into it, or S was small
            self._decided = "main"
        return self._decided

    def _settle_small(self) -> bool:
        """S's oldest block moves to M while reused; whether one used less is left (the
        victim), False if every block of S moved."""
        while self._small:
            b = next(iter(self._small))
            if self._freq[b] < self._move:
                return True
            del self._small[b]
            self._freq[b] = 0  # the paper clears the bits on the move
            self._home[b] = "main"
            self._main[b] = None
        return False

    def _settle_main(self) -> None:
        """M's oldest block is reinserted with one access spent while it has any."""
        while True:
            b = next(iter(self._main))
            if self._freq[b] == 0:
                return
            del self._main[b]
            self._freq[b] -= 1
            self._main[b] = None

    def _drop(self, block: int) -> None:
        del self._freq[block]
        del self._home[block]

    def queues(self) -> tuple[list[int], list[int], list[bytes]]:
        """(S, M, G), each oldest first: for tests and debugging."""
        return list(self._small), list(self._main), list(self._ghost)
