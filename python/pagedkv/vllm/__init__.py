"""pagedkv inside vLLM 0.33: a `KVCacheManager` and a `Scheduler` for `--scheduler-cls`.

`--scheduler-cls pagedkv.vllm.Scheduler` runs vLLM's own v1 scheduler with pagedkv's block
manager in place of vLLM's (docs/vllm.md). Importing this package imports vLLM.
"""

from __future__ import annotations

from pagedkv.vllm.blocks import PagedKVCacheBlocks
from pagedkv.vllm.manager import KVCacheManager
from pagedkv.vllm.scheduler import AsyncScheduler, Scheduler

__all__ = ["AsyncScheduler", "KVCacheManager", "PagedKVCacheBlocks", "Scheduler"]
