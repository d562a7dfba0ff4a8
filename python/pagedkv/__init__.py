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

from pagedkv._core import __version__, hash_blocks
from pagedkv.alloc_status import AllocStatus
from pagedkv.config import BlockManagerConfig
from pagedkv.errors import (
    DuplicateSequenceError,
    InvalidArgumentError,
    InvariantError,
    PagedKVError,
    SequenceSwappedError,
    UnknownSequenceError,
)
from pagedkv.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from pagedkv.manager import BlockManager
from pagedkv.stats import Stats

__all__ = [
    "AllBlocksCleared",
    "AllocStatus",
    "BlockManager",
    "BlockManagerConfig",
    "BlockRemoved",
    "BlockStored",
    "DuplicateSequenceError",
    "InvalidArgumentError",
    "InvariantError",
    "KVEvent",
    "PagedKVError",
    "SequenceSwappedError",
    "Stats",
    "UnknownSequenceError",
    "__version__",
    "hash_blocks",
]
