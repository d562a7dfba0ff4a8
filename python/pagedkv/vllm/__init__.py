"""pagedkv inside vLLM (0.32, 0.33, 0.34): a `KVCacheManager` and a `Scheduler` for
`--scheduler-cls`, and `PagedKVTier`, pagedkv's tier stores as a secondary tier of vLLM's CPU
offloading.

`--scheduler-cls pagedkv.vllm.Scheduler` runs vLLM's own v1 scheduler with pagedkv's block
manager in place of vLLM's (docs/vllm.md); ``{"type": "PagedKVTier", "module_path":
"pagedkv.vllm", ...}`` in ``secondary_tiers`` keeps offloaded chunks in a pagedkv store
(docs/tiers.md). Importing this package imports vLLM; `import pagedkv` does not. Another vLLM
release is refused at import with an `ImportError` naming it (pagedkv.vllm.compat).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

# First: refuses an unsupported vLLM before anything else of vLLM is imported.
from pagedkv.vllm.compat import RELEASE  # noqa: F401

# isort: split
from pagedkv.vllm.blocks import PagedKVCacheBlocks
from pagedkv.vllm.manager import KVCacheManager
from pagedkv.vllm.scheduler import AsyncScheduler, Scheduler

if TYPE_CHECKING:
    from pagedkv.vllm.tier import PagedKVTier


def __getattr__(name: str) -> Any:
    """`PagedKVTier` on first use (vLLM's factory asks for it by name): a scheduler that
    only uses `--scheduler-cls` does not load vLLM's offloading stack through pagedkv."""
    if name == "PagedKVTier":
        from pagedkv.vllm.tier import PagedKVTier

        return PagedKVTier
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["AsyncScheduler", "KVCacheManager", "PagedKVCacheBlocks", "PagedKVTier", "Scheduler"]
