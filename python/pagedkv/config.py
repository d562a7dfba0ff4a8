"""`BlockManagerConfig`: the constructor's arguments as one validated, frozen value.

Handy for engines that read their settings from a file or the command line and want them
checked before a manager is built: `BlockManager.from_config(BlockManagerConfig(...))`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any, Literal

from pagedkv.errors import InvalidArgumentError
from pagedkv.groups import KVCacheGroup, check_groups

HashAlgo = Literal["sha256", "xxh3_128"]
HASH_ALGOS: tuple[HashAlgo, ...] = ("sha256", "xxh3_128")
Eviction = Literal["lru", "s3fifo", "arc", "lfu", "slru", "priority"]
EVICTIONS: tuple[Eviction, ...] = ("lru", "s3fifo", "arc", "lfu", "slru", "priority")
"""The eviction policies (docs/eviction.md); "lru" is the default and vLLM's order."""

_U64_LIMIT = 1 << 64


def _require_int(name: str, value: object, minimum: int, limit: int | None = None) -> None:
    # bool is an int subclass; `num_blocks=True` is a mistake, not 1.
    if not isinstance(value, int) or isinstance(value, bool):
        raise InvalidArgumentError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise InvalidArgumentError(f"{name} must be >= {minimum}, got {value}")
    if limit is not None and value >= limit:
        raise InvalidArgumentError(f"{name} must be < {limit}, got {value}")


def _require_bool(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise InvalidArgumentError(f"{name} must be a bool, got {type(value).__name__}")


@dataclass(frozen=True, slots=True, kw_only=True)
class BlockManagerConfig:
    """Every `BlockManager` constructor argument, validated on creation.

    Fields mirror `BlockManager(num_blocks, block_size=16, *, num_cpu_blocks=0,
    enable_prefix_caching=True, hash_algo="sha256", hash_seed=0, watermark=0.01,
    enable_kv_events=False, record_evictions=False, eviction="lru", tenants=False,
    groups=None, prefix_cache_retention_interval=None)`. Invalid values raise
    `InvalidArgumentError` (a `ValueError`); `groups` is kept as a tuple.
    """

    num_blocks: int
    block_size: int = 16
    num_cpu_blocks: int = 0
    enable_prefix_caching: bool = True
    hash_algo: HashAlgo = "sha256"
    hash_seed: int = 0
    watermark: float = 0.01
    enable_kv_events: bool = False
    record_evictions: bool = False
    eviction: Eviction = "lru"
    tenants: bool = False
    groups: tuple[KVCacheGroup, ...] | None = None
    prefix_cache_retention_interval: int | None = None

    def __post_init__(self) -> None:
        _require_int("num_blocks", self.num_blocks, 1)
        _require_int("block_size", self.block_size, 1, (1 << 16) + 1)  # as the constructor
        _require_int("num_cpu_blocks", self.num_cpu_blocks, 0)
        _require_bool("enable_prefix_caching", self.enable_prefix_caching)
        _require_bool("enable_kv_events", self.enable_kv_events)
        _require_bool("record_evictions", self.record_evictions)
        _require_bool("tenants", self.tenants)
        if self.eviction not in EVICTIONS:
            raise InvalidArgumentError(
                f"eviction must be one of {', '.join(EVICTIONS)}, got {self.eviction!r}"
            )
        if self.hash_algo not in HASH_ALGOS:
            raise InvalidArgumentError(
                f"hash_algo must be one of {', '.join(HASH_ALGOS)}, got {self.hash_algo!r}"
            )
        _require_int("hash_seed", self.hash_seed, 0, _U64_LIMIT)
        w: object = self.watermark
        if not isinstance(w, int | float) or isinstance(w, bool):
            raise InvalidArgumentError(f"watermark must be a float, got {type(w).__name__}")
        if not (math.isfinite(w) and 0.0 <= w < 1.0):
            raise InvalidArgumentError(f"watermark must be in [0, 1), got {w}")
        if self.groups is not None:
            # Frozen: set the validated tuple through object.__setattr__.
            object.__setattr__(self, "groups", check_groups(self.groups, self.block_size))
        self._check_retention_interval()

    def _check_retention_interval(self) -> None:
        """As the constructor checks it (docs/semantics.md, "Window retention")."""
        r = self.prefix_cache_retention_interval
        if r is None:
            return
        _require_int("prefix_cache_retention_interval", r, 0, 1 << 31)
        if not any(g.kind == "sliding_window" for g in self.groups or ()):
            if r:
                raise InvalidArgumentError(
                    f"prefix_cache_retention_interval {r} applies to sliding-window groups "
                    "and this layout has none: give 0 or None"
                )
        elif r % self.block_size:
            raise InvalidArgumentError(
                f"prefix_cache_retention_interval {r} must be 0, None or a multiple of the "
                f"block size {self.block_size}"
            )

    def constructor_kwargs(self) -> dict[str, Any]:
        """The keyword arguments (all but `num_blocks` and `block_size`) for the constructor."""
        skip = ("num_blocks", "block_size")
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name not in skip}


__all__ = ["EVICTIONS", "HASH_ALGOS", "BlockManagerConfig", "Eviction", "HashAlgo"]
