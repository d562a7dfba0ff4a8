"""vLLM's sparse prefix-cache retention for sliding-window groups, as the adapter passes it
to the core (docs/vllm.md, "Window retention").

`KVCacheConfig.prefix_cache_retention_interval` (the engine's `CacheConfig` default is 0;
`KVCacheConfig`'s own default None): with a sliding-window group vLLM caches only the window
blocks a later hit can read, the tail before each request's replay boundary (its prompt
less one token) and before the shared-prefix junction its lookup reported
(`get_computed_blocks`' third value: the longest hit one group serves alone, where it runs
past the hybrid hit). The core decides which blocks (`policy::reach`); this module checks
the setting as vLLM does, gives the core its interval, computes the junction and a new
request's reachable positions. Same in vLLM 0.32, 0.33 and 0.34.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from vllm.v1.kv_cache_interface import KVCacheConfig, MambaSpec, SlidingWindowSpec
from vllm.v1.request import Request

if TYPE_CHECKING:
    from pagedkv.vllm.manager import KVCacheManager

log = logging.getLogger(__name__)


def core_interval(config: KVCacheConfig, scheduler_block_size: int, use_eagle: bool) -> int | None:
    """The interval the core applies, after checking the setting as vLLM's coordinator does
    (the same message). None (dense) where vLLM's setting is None, where no group is a
    `SlidingWindowSpec` (vLLM's sparse Mamba checkpoints are not implemented: state groups
    stay dense), and with EAGLE (its shifted window tails are not implemented)."""
    interval = getattr(config, "prefix_cache_retention_interval", None)
    if interval is None:
        return None
    specs = [g.kv_cache_spec for g in config.kv_cache_groups]
    windows = any(isinstance(s, SlidingWindowSpec) for s in specs)
    if not windows and not any(isinstance(s, MambaSpec) for s in specs):
        if interval == 0:
            return None
        raise ValueError(
            "prefix_cache_retention_interval is set but this model has no sliding-window or "
            "Mamba KV cache group, so retention has no effect. Set it to 0 (it only applies "
            "to sliding-window and Mamba attention)."
        )
    if interval < 0 or interval % scheduler_block_size != 0:
        raise ValueError(
            f"prefix_cache_retention_interval ({interval}) must be non-negative and a "
            f"multiple of scheduler_block_size ({scheduler_block_size})."
        )
    if any(isinstance(s, MambaSpec) for s in specs) or use_eagle:
        # Gaps (docs/vllm.md, "Deliberate differences"): said once per manager built.
        log.warning(
            "pagedkv.vllm: prefix_cache_retention_interval=%s: %s stay dense (cache every "
            "full block), so prefix hits may differ from vLLM's",
            interval,
            "window groups with EAGLE" if use_eagle and windows else "Mamba state groups",
        )
    if not windows or use_eagle:
        return None
    return int(interval)


def junction(manager: KVCacheManager, request: Request, max_hit: int, hit: int) -> int:
    """vLLM's shared-prefix junction of a lookup capped at `max_hit` tokens whose hybrid hit
    is `hit`: the hit of the group its coordinator looks up first (full attention, else the
    first group), where it is longer; 0 otherwise. Only the sparse mask reads it, so it is
    0 when the core caches windows densely."""
    bs = manager.block_size
    if manager.retention_interval is None or hit >= max_hit // bs * bs:
        return 0  # dense, or no group serves more than the cap the hybrid hit reached
    n = request.num_tokens
    keys = manager._keys(request, 0, min(manager._num_keys(request), n // bs))
    per_group = manager.core.lookup_blocks_per_group(
        range(n), block_hashes=keys, max_hit_tokens=max(max_hit, 0)
    )
    kinds = [g.kind for g in manager.layout.groups]
    first = kinds.index("full") if "full" in kinds else 0
    longest = int(per_group[first][0])
    return longest if longest > hit else 0


def reachable(manager: KVCacheManager, request: Request) -> list[int] | None:
    """A new request's positions where a later hit can resume (vLLM's replay boundary, its
    prompt less one token, and the junction the scheduler took from the lookup), or None
    when the core caches windows densely."""
    if manager.retention_interval is None:
        return None
    out = [request.num_prompt_tokens - 1]
    boundary = getattr(request, "shared_prefix_boundary", 0)
    if boundary:
        out.append(int(boundary))
    return out


__all__ = ["core_interval", "junction", "reachable"]
