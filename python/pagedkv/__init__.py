"""pagedkv: a paged KV-cache block manager for LLM inference.

The block pool, block tables, prefix cache, copy-on-write and swap bookkeeping live in a
Rust core (`pagedkv._core`), safe to call from many threads; this package adds the typed
Python surface around it. `import pagedkv` needs numpy only.

    >>> import pagedkv
    >>> m = pagedkv.BlockManager(num_blocks=1024, block_size=16)
    >>> m.allocate(0, list(range(40)))   # number of prompt tokens served from the cache
    0
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pagedkv._core import RunningBatch, __version__, hash_blocks
from pagedkv.alloc_status import AllocStatus
from pagedkv.config import BlockManagerConfig
from pagedkv.errors import (
    DuplicateSequenceError,
    EvictionsNotDeliveredError,
    InvalidArgumentError,
    InvalidArgumentTypeError,
    InvariantError,
    ManagerBrokenError,
    PagedKVError,
    RefcountOverflowError,
    SequenceNotSwappedError,
    SequenceSwappedError,
    UnknownSequenceError,
)
from pagedkv.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from pagedkv.groups import KVCacheGroup
from pagedkv.manager import BlockManager
from pagedkv.stats import GroupStats, Stats, TenantStats

# The GPU pool and its kernels (pagedkv.device) need torch (and cupy on "cuda"): imported on
# first use only, so that `import pagedkv` stays numpy-only.
if TYPE_CHECKING:
    from pagedkv.device.pool import KVCachePool, paged_decode_attention, swap_blocks

_POOL_NAMES = ("KVCachePool", "paged_decode_attention", "swap_blocks")


def __getattr__(name: str) -> object:
    if name in _POOL_NAMES:
        from pagedkv.device import pool

        return getattr(pool, name)
    raise AttributeError(f"module 'pagedkv' has no attribute {name!r}")


def __dir__() -> list[str]:
    # The public names only: not the module's own imports (TYPE_CHECKING, annotations).
    return sorted(__all__)


__all__ = [
    "AllBlocksCleared",
    "AllocStatus",
    "BlockManager",
    "BlockManagerConfig",
    "BlockRemoved",
    "BlockStored",
    "DuplicateSequenceError",
    "EvictionsNotDeliveredError",
    "GroupStats",
    "InvalidArgumentError",
    "InvalidArgumentTypeError",
    "InvariantError",
    "KVCacheGroup",
    "KVCachePool",
    "KVEvent",
    "ManagerBrokenError",
    "PagedKVError",
    "RefcountOverflowError",
    "RunningBatch",
    "SequenceNotSwappedError",
    "SequenceSwappedError",
    "Stats",
    "TenantStats",
    "UnknownSequenceError",
    "__version__",
    "hash_blocks",
    "paged_decode_attention",
    "swap_blocks",
]
