"""`BlockManager`: the Rust manager plus a few pure-Python conveniences.

All the work happens in `pagedkv._core.BlockManager`; this subclass adds no state
(`__slots__ = ()`) and no per-call overhead to the inherited methods.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Self, TextIO

from pagedkv import _core
from pagedkv.stats import TenantStats

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt

    from pagedkv.config import BlockManagerConfig


class BlockManager(_core.BlockManager):
    """Paged KV-cache block manager (see `docs/semantics.md` for the full contract).

    `BlockManager(num_blocks, block_size=16, *, num_cpu_blocks=0, enable_prefix_caching=True,
    hash_algo="sha256", hash_seed=0, watermark=0.01, enable_kv_events=False, record_evictions=False,
    eviction="lru", tenants=False, groups=None, prefix_cache_retention_interval=None)`.
    With `groups=[KVCacheGroup(...), ...]` each sequence holds one block table per group
    (hybrid models; docs/semantics.md, "KV-cache groups").
    Every method is safe to call from many threads at once.
    """

    __slots__ = ()

    @classmethod
    def from_config(cls, config: BlockManagerConfig) -> Self:
        """Build a manager from a validated `BlockManagerConfig`."""
        return cls(
            config.num_blocks,
            config.block_size,
            num_cpu_blocks=config.num_cpu_blocks,
            enable_prefix_caching=config.enable_prefix_caching,
            hash_algo=config.hash_algo,
            hash_seed=config.hash_seed,
            watermark=config.watermark,
            enable_kv_events=config.enable_kv_events,
            record_evictions=config.record_evictions,
            eviction=config.eviction,
            tenants=config.tenants,
            groups=None if config.groups is None else list(config.groups),
            prefix_cache_retention_interval=config.prefix_cache_retention_interval,
        )

    def tenant_stats(self) -> list[TenantStats]:
        """Per tenant present (a live sequence, a CACHED block or a quota; None first for
        requests without a salt, then in the order they entered): blocks held and cached,
        prefix queries and hits, quota. Needs `tenants=True`. Does not stall other calls."""
        return [TenantStats(*row) for row in self._tenant_stats()]

    def lookup_many(
        self,
        prompts: Iterable[list[int] | tuple[int, ...] | range | npt.NDArray[np.integer[Any]]],
        *,
        cache_salt: str | bytes | None = None,
        lora_id: int | None = None,
    ) -> list[int]:
        """`lookup` of each prompt (same salt and LoRA id): the tokens each would hit now."""
        return [self.lookup(p, cache_salt=cache_salt, lora_id=lora_id) for p in prompts]

    def print_memory_stats(self, file: TextIO | None = None) -> None:
        """Print a human-readable summary of `stats()` (to stdout by default)."""
        print(self.stats(), file=sys.stdout if file is None else file)


__all__ = ["BlockManager"]
