"""`DigestTier`: a tier that keeps which blocks it holds and none of their bytes (the
simulator's count-only tier run, `sim.tier_run`; docs/tiers.md, "In the simulator").

It is a `TierStore` whose capacity is a number of blocks, LRU, with exactly the host tiers'
rules: a put of a present key replaces it (most recent), a put that does not fit evicts the
least recently used entries first, `get` refreshes an entry's recency and `count_present`
does not. What a raw `HostTier` holding the same number of blocks would hit, it hits. Its
`get` returns ``b""``: a `TieredCache` without a pool (count-only, 0 bytes per block) takes
that as the block. It is thread-safe, so several `TieredCache`s (nodes) may share one.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import replace

from pagedkv.tiers.base import TierKey, TierStats


class DigestTier:
    """Up to `capacity_blocks` block keys, LRU (module docstring). `block_bytes` is what one
    block stands for (the model's bytes per block): the stats count it as the bytes put and
    got. `medium` is the event medium it reports ("CPU" for a host tier)."""

    def __init__(
        self,
        capacity_blocks: int,
        *,
        block_bytes: int = 0,
        name: str = "host",
        medium: str = "CPU",
    ) -> None:
        given: tuple[tuple[str, object], ...] = (
            ("capacity_blocks", capacity_blocks),
            ("block_bytes", block_bytes),
        )
        for what, v in given:
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"{what} must be an int >= 0, got {v!r}")
        self.capacity_blocks = capacity_blocks
        self.block_bytes = block_bytes
        self.medium = medium
        self._lock = threading.Lock()
        self._keys: OrderedDict[TierKey, None] = OrderedDict()
        self._removed: list[TierKey] = []
        self._stats = TierStats(name)
        self._stats.extra.update({"stored_bytes_in": 0.0, "discards": 0.0})

    def __repr__(self) -> str:
        return f"DigestTier(capacity_blocks={self.capacity_blocks}, medium={self.medium!r})"

    def __len__(self) -> int:
        with self._lock:
            return len(self._keys)

    def put(self, key: TierKey, data: bytes | memoryview = b"") -> bool:
        """Hold `key` (its bytes are not kept); False when the capacity is 0."""
        return self.put_many((key,)) == 1

    def put_many(self, keys: Sequence[TierKey]) -> int:
        """`put` of each key in order, under one lock; returns how many were held."""
        with self._lock:
            st, entries, cap = self._stats, self._keys, self.capacity_blocks
            if cap == 0:
                st.dropped_puts += len(keys)
                return 0
            touch, oldest, removed = entries.move_to_end, entries.popitem, self._removed
            evicted = 0
            for key in keys:
                if key in entries:
                    touch(key)
                else:
                    if len(entries) >= cap:
                        removed.append(oldest(False)[0])
                        evicted += 1
                    entries[key] = None
            st.evictions += evicted
            n = len(keys)
            st.puts += n
            st.raw_bytes_in += n * self.block_bytes
            st.extra["stored_bytes_in"] += n * self.block_bytes
            return n

    def get(self, key: TierKey) -> bytes | None:
        """``b""`` when `key` is held (now the most recent), else None."""
        with self._lock:
            st = self._stats
            st.gets += 1
            if key not in self._keys:
                st.misses += 1
                return None
            self._keys.move_to_end(key)
            st.hits += 1
            st.raw_bytes_out += self.block_bytes
            return b""

    def count_present(self, keys: Sequence[TierKey]) -> int:
        """How many of `keys`, from the first, are held (recency unchanged)."""
        n = 0
        with self._lock:
            entries = self._keys
            for k in keys:
                if k not in entries:
                    break
                n += 1
        return n

    def present_each(self, keys: Sequence[TierKey]) -> list[bool]:
        """Whether each key is held (recency unchanged)."""
        with self._lock:
            entries = self._keys
            return [k in entries for k in keys]

    def discard(self, key: TierKey) -> None:
        with self._lock:
            if key in self._keys:
                del self._keys[key]
                self._removed.append(key)
                self._stats.extra["discards"] += 1

    def drain_removed(self) -> list[TierKey]:
        with self._lock:
            out, self._removed = self._removed, []
        return out

    def stats(self) -> TierStats:
        with self._lock:
            return replace(
                self._stats,
                entries=len(self._keys),
                stored_bytes=len(self._keys) * self.block_bytes,
                extra=dict(self._stats.extra),
            )


__all__ = ["DigestTier"]
