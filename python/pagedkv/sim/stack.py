"""Exact LRU stack distances, a batch of keys at a time (Mattson's stack algorithm).

LRU is a stack algorithm: a cache of `C + 1` blocks always holds what a cache of `C` blocks
holds. So one number per access answers for every cache size at once: the key's *stack
distance*, 1 + the number of distinct keys touched since its last touch. The key is cached in
an LRU cache of `C` blocks exactly when its distance is at most `C`.

Times count touches. Each key's last touch leaves a mark at its time; the distance of a key
touched last at `p` is the number of marks at or after `p`. The marks live in a byte array
with a count per bucket of `BUCKET` times, so that a batch of queries costs one cumulative sum
over the bucket counts plus one over each bucket the batch lands in: numpy work per batch, no
Python loop per key (a Fenwick tree would need one `ufunc.at` call per tree level per batch,
several times slower here).

`lookup` answers a batch against one snapshot (a prompt's blocks are looked up together,
before any of them is touched); `touch` moves a batch to the top in order (the last one ends
most recent).
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

BUCKET = 128  # times per bucket: balances the bucket sum against the in-bucket sums

IntArray = npt.NDArray[np.int64]


class StackDistances:
    """Stack distances over keys `0 .. num_keys - 1`, for at most `capacity` touches."""

    __slots__ = ("_newest", "alive", "capacity", "counts", "distinct", "last", "time")

    def __init__(self, num_keys: int, capacity: int) -> None:
        self.capacity = capacity
        buckets = -(-max(capacity, 1) // BUCKET)
        self.last: IntArray = np.full(num_keys, -1, dtype=np.int64)  # last touch time, -1 never
        self.alive = np.zeros(buckets * BUCKET, dtype=np.uint8)  # 1 where a key's last touch is
        self.counts: IntArray = np.zeros(buckets, dtype=np.int64)  # marks per bucket
        self.distinct = 0  # keys touched so far (= marks)
        self.time = 0  # touches so far
        self._newest: IntArray = np.full(num_keys, -1, dtype=np.int64)  # scratch for `touch`

    def lookup(self, ids: IntArray) -> IntArray:
        """The stack distance of each key now (1 = the most recent), 0 if never touched."""
        t = self.last[ids]
        seen = t >= 0
        out = np.zeros(len(ids), dtype=np.int64)
        if not seen.any():
            return out
        ts = t[seen]
        b = ts // BUCKET
        before = np.concatenate(([0], np.cumsum(self.counts)))[b]  # marks in earlier buckets
        # Marks in the key's own bucket, before `ts`: one row of BUCKET cells per key.
        start = b * BUCKET
        cells = self.alive[start[:, None] + np.arange(BUCKET)]
        within = np.where(np.arange(BUCKET) < (ts - start)[:, None], cells, 0).sum(axis=1)
        out[seen] = self.distinct - before - within
        return out

    def touch(self, ids: IntArray) -> None:
        """Touch each key in order: the last one becomes the most recent."""
        if not len(ids):
            return
        # A key touched twice in the batch ends where its last touch puts it: keep each key's
        # last position only (no sort: the scratch array remembers the newest position).
        order = np.arange(len(ids), dtype=np.int64)
        np.maximum.at(self._newest, ids, order)
        ids = ids[self._newest[ids] == order]
        self._newest[ids] = -1
        if self.time + len(ids) > self.capacity:
            raise ValueError(f"more than {self.capacity} touches: raise the capacity")
        old = self.last[ids]
        was = old[old >= 0]
        self.alive[was] = 0
        self.counts -= np.bincount(was // BUCKET, minlength=len(self.counts))
        new = self.time + np.arange(len(ids), dtype=np.int64)
        self.alive[new] = 1
        self.counts += np.bincount(new // BUCKET, minlength=len(self.counts))
        self.last[ids] = new
        self.distinct += len(ids) - len(was)
        self.time += len(ids)


__all__ = ["BUCKET", "StackDistances"]
