"""Plain reference eviction policies over a block manager's CACHED blocks.

The oracles of the Rust core's model-based tests for issue 25 (docs/eviction.md): one
module per policy, each implementing the `EvictionPolicy` interface of `base`.

- `lru.Lru`: least recently released first, today's order (the default)
- `s3fifo.S3Fifo`: S3-FIFO (SOSP'23)
- `arc.Arc`: ARC (FAST'03)
- `lfu.LfuAging`: LFU with dynamic aging (LFU-DA)
- `slru.Slru`: segmented LRU
- `priority.Priority`: TensorRT-LLM's retention priorities and durations, and pins
- `quotas.TenantQuotas`: per-tenant caps and reserved shares around any of them
"""

from __future__ import annotations

from pagedkv_reference.eviction.arc import Arc
from pagedkv_reference.eviction.base import EvictionPolicy
from pagedkv_reference.eviction.lfu import LfuAging
from pagedkv_reference.eviction.lru import Lru
from pagedkv_reference.eviction.priority import Priority
from pagedkv_reference.eviction.quotas import Quota, TenantQuotas
from pagedkv_reference.eviction.s3fifo import S3Fifo
from pagedkv_reference.eviction.slru import Slru

__all__ = [
    "POLICIES",
    "Arc",
    "EvictionPolicy",
    "LfuAging",
    "Lru",
    "Priority",
    "Quota",
    "S3Fifo",
    "Slru",
    "TenantQuotas",
    "make_policy",
]

POLICIES = ("lru", "s3fifo", "arc", "lfu", "slru", "priority")
"""The names `make_policy` (and, later, `BlockManager(eviction=...)`) accepts."""


def make_policy(name: str, num_blocks: int) -> EvictionPolicy:
    """A fresh policy by name, for a manager of `num_blocks` blocks."""
    if name == "lru":
        return Lru()
    if name == "s3fifo":
        return S3Fifo(num_blocks)
    if name == "arc":
        return Arc(num_blocks)
    if name == "lfu":
        return LfuAging()
    if name == "slru":
        return Slru(num_blocks)
    if name == "priority":
        return Priority()
    raise ValueError(f"unknown eviction policy {name!r}; expected one of {', '.join(POLICIES)}")
