"""pagedkv inside vLLM 0.33: a `KVCacheManager` and a `Scheduler` for `--scheduler-cls`,
and `PagedKVTier`, pagedkv's tier stores as a secondary tier of vLLM's CPU offloading.

`--scheduler-cls pagedkv.vllm.Scheduler` runs vLLM's own v1 scheduler with pagedkv's block
manager in place of vLLM's (docs/vllm.md); ``{"type": "PagedKVTier", "module_path":
"pagedkv.vllm", ...}`` in ``secondary_tiers`` keeps offloaded chunks in a pagedkv store
(docs/tiers.md). Importing this package imports vLLM; `import pagedkv` does not.
"""

from __future__ import annotations

from pagedkv.vllm.blocks import PagedKVCacheBlocks
from pagedkv.vllm.manager import KVCacheManager
from pagedkv.vllm.scheduler import AsyncScheduler, Scheduler
from pagedkv.vllm.tier import PagedKVTier

__all__ = ["AsyncScheduler", "KVCacheManager", "PagedKVCacheBlocks", "PagedKVTier", "Scheduler"]
