"""ARC (Megiddo and Modha, "ARC: A Self-Tuning, Low Overhead Replacement Cache", FAST'03).

Four LRU lists: T1 (blocks seen once recently), T2 (blocks seen at least twice), and the
ghost lists B1 and B2 (keys recently evicted from T1 and T2). The target size `p` of T1
adapts: a request for a key in B1 means T1 was too small (p grows), one in B2 means T2 was
(p shrinks). The cache size `c` is the manager's block count.

The paper's cases, mapped to the manager's calls:

- Case I, a hit in T1 or T2: `on_hit` takes the block out (it is in use); when released
  again it goes to T2's MRU end, where the paper moves a hit.
- Case II, key in B1: when the key is requested (`on_miss`; else when a block is cached
  under it), p = min(c, p + max(|B2| // |B1|, 1)) and the key leaves B1; its block enters
  T2's MRU end when cached.
- Case III, key in B2 (likewise): p = max(0, p - max(|B1| // |B2|, 1)); the block enters
  T2. Keys requested from B1 or B2 wait in a readmission list (at most c, oldest dropped)
  until their block is cached.
- Case IV, a new key: the block enters T1's MRU end.
- REPLACE, run here by `victim`: evict T1's LRU block (its key to B1's MRU end) if T1 is
  non-empty and |T1| > p, or T2 is empty; else T2's LRU block (its key to B2).
- The directory bounds: |T1| + |B1| <= c (else B1's LRU key goes) and
  |T1| + |T2| + |B1| + |B2| <= 2c (else B2's LRU key goes, or B1's if B2 is empty).

Deviations, and why: the manager, not ARC, decides when to evict, so REPLACE runs at
`victim` and the paper's tie rule ("or x in B2 and |T1| = p", about the request that caused
the miss) has no request to look at: ties go to T2. `p` and its steps are integers (floor
division) so that the Rust core can match the order exactly without floating point. T1 and
T2 hold only the evictable blocks: a block in use counts in neither.
"""

from __future__ import annotations

from collections import OrderedDict

from pagedkv_reference.eviction.base import EvictionPolicy, check_num_blocks

__all__ = ["Arc"]


class Arc(EvictionPolicy):
    name = "arc"

    def __init__(self, num_blocks: int) -> None:
        super().__init__()
        self._c = check_num_blocks(num_blocks)
        self._p = 0  # the target size of T1
        self._t1: OrderedDict[int, None] = OrderedDict()  # LRU first
        self._t2: OrderedDict[int, None] = OrderedDict()
        self._b1: OrderedDict[bytes, None] = OrderedDict()
        self._b2: OrderedDict[bytes, None] = OrderedDict()
        self._readmit: OrderedDict[bytes, None] = OrderedDict()  # ghost keys requested

    @property
    def p(self) -> int:
        return self._p

    def _ghost_hit(self, key: bytes) -> bool:
        """Cases II and III: adapt p and take the key out of its ghost list."""
        b1, b2 = self._b1, self._b2
        if key in b1:
            self._p = min(self._c, self._p + max(len(b2) // len(b1), 1))
            del b1[key]
        elif key in b2:
            self._p = max(0, self._p - max(len(b1) // len(b2), 1))
            del b2[key]
        else:
            return False
        return True

    def _miss(self, key: bytes, now: float) -> None:
        if self._ghost_hit(key):
            self._readmit[key] = None
            while len(self._readmit) > self._c:
                self._readmit.popitem(last=False)

    def _insert(self, block: int, now: float, key: bytes, revived: bool) -> None:
        readmit = key in self._readmit
        self._readmit.pop(key, None)
        if revived or readmit or self._ghost_hit(key):  # cases I, II, III
            self._t2[block] = None
        else:  # case IV
            self._t1[block] = None
        self._bound()

    def _forget(self, block: int, key: bytes) -> None:
        if block in self._t1:
            del self._t1[block]
        else:
            del self._t2[block]

    def _from_t1(self) -> bool:
        """REPLACE's choice: T1 if it is over its target p (or T2 is empty); ties to T2."""
        return bool(self._t1) and (len(self._t1) > self._p or not self._t2)

    def _peek(self, now: float) -> int | None:
        return next(iter(self._t1 if self._from_t1() else self._t2), None)

    def _pick(self, now: float) -> int | None:
        if self._from_t1():
            b = self._t1.popitem(last=False)[0]
            self._b1[self._keys[b]] = None
        elif self._t2:
            b = self._t2.popitem(last=False)[0]
            self._b2[self._keys[b]] = None
        else:
            return None
        self._bound()
        return b

    def _bound(self) -> None:
        c = self._c
        while len(self._t1) + len(self._b1) > c and self._b1:
            self._b1.popitem(last=False)
        while len(self._t1) + len(self._t2) + len(self._b1) + len(self._b2) > 2 * c:
            (self._b2 or self._b1).popitem(last=False)

    def lists(self) -> tuple[list[int], list[int], list[bytes], list[bytes]]:
        """(T1, T2, B1, B2), each LRU first: for tests and debugging."""
        return list(self._t1), list(self._t2), list(self._b1), list(self._b2)
