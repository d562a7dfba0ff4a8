"""The stores behind one `PagedKVStore`, nearest first: a host tier (raw or compressed),
then a remote tier, either or both (docs/tiers.md, "Under SGLang").

A put goes to every store (write-through: the host tier serves this node fast, the remote
one every node); a get asks them in order and copies a remote hit into the host tier;
presence is the leading run of keys that some store holds. Each store is thread-safe and
bounded in time (`TierStore`), so this is too, with no lock of its own.
"""

from __future__ import annotations

from collections.abc import Sequence

from pagedkv.tiers.base import TierKey, TierStats, TierStore


class TierChain:
    def __init__(self, stores: Sequence[TierStore]) -> None:
        if not stores:
            raise ValueError("a tier chain needs at least one store")
        self.stores = list(stores)

    def put(self, key: TierKey, data: bytes | memoryview) -> bool:
        """Store in every store; True if at least one kept the block."""
        kept = False
        for store in self.stores:
            kept |= store.put(key, data)
        return kept

    def get(self, key: TierKey) -> bytes | None:
        """The block from the nearest store that has it (checked by that store), or None;
        a hit below the first store is copied into the stores above it."""
        for i, store in enumerate(self.stores):
            data = store.get(key)
            if data is not None:
                for upper in self.stores[:i]:
                    upper.put(key, data)
                return data
        return None

    def count_present(self, keys: Sequence[TierKey]) -> int:
        """How many of `keys`, from the first, some store holds. Each round asks every store
        for its leading run from the current position and moves past the longest, so a run
        split between the stores (the first half here, the rest only remote) is counted
        whole; it ends when no store holds the next key."""
        pos = 0
        while pos < len(keys):
            rest = keys[pos:]
            step = max(store.count_present(rest) for store in self.stores)
            if step == 0:
                break
            pos += step
        return pos

    def present(self, keys: Sequence[TierKey]) -> list[bool]:
        """Whether each key is held by some store (one look-up per key and store)."""
        return [any(store.count_present([k]) == 1 for store in self.stores) for k in keys]

    def stats(self) -> list[TierStats]:
        return [store.stats() for store in self.stores]


__all__ = ["TierChain"]
