"""The interface every tier store implements, and its statistics (docs/tiers.md)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol


class TierKey(NamedTuple):
    """A block's identity below the GPU: its KV-cache group and its chain digest (the
    published block-hash spec, docs/hashing.md). The namespace is the store's."""

    group: int
    digest: bytes


@dataclass
class TierStats:
    """What one store did. Bytes are the block's raw bytes (before any codec) unless named
    `stored_bytes` (what the store holds, after the codec and framing)."""

    name: str
    entries: int = 0
    stored_bytes: int = 0
    puts: int = 0
    dropped_puts: int = 0  # full, too slow, unreachable: the block was dropped, never half-written
    evictions: int = 0
    gets: int = 0
    hits: int = 0
    misses: int = 0
    corrupt: int = 0  # entries that failed their checksum, namespace or length check: misses
    errors: int = 0  # server errors and timeouts (remote tiers)
    raw_bytes_in: int = 0
    raw_bytes_out: int = 0
    seconds_put: float = 0.0
    seconds_get: float = 0.0
    extra: dict[str, float] = field(default_factory=dict)

    @property
    def compression_ratio(self) -> float:
        """Raw bytes over stored bytes of what was put (1.0 before any put)."""
        stored = self.extra.get("stored_bytes_in", 0.0)
        return self.raw_bytes_in / stored if stored else 1.0


class TierStore(Protocol):
    """One tier below the GPU. Every method is safe to call from several threads, never
    raises for a missing, damaged or unreachable entry (that is a miss, or a dropped put),
    and never blocks longer than the store's timeout."""

    #: The event medium of this tier: "CPU", "CPU_COMPRESSED", "REMOTE".
    medium: str

    def put(self, key: TierKey, data: bytes | memoryview) -> bool:
        """Store a block's raw bytes under `key`; False when the entry was dropped."""
        ...

    def get(self, key: TierKey) -> bytes | None:
        """The raw bytes stored under `key`, or None (absent, damaged, other namespace,
        unreachable)."""
        ...

    def count_present(self, keys: Sequence[TierKey]) -> int:
        """How many of `keys`, from the first, are present (one round trip where the store
        is remote); a prefix match below the GPU continues only that far."""
        ...

    def discard(self, key: TierKey) -> None:
        """Forget `key` if present (a no-op otherwise)."""
        ...

    def drain_removed(self) -> list[TierKey]:
        """The keys this store dropped (evicted or discarded) since the last call, for
        `BlockRemoved` events."""
        ...

    def stats(self) -> TierStats: ...


__all__ = ["TierKey", "TierStats", "TierStore"]
