"""Prefix hits that differ per KV-cache group, for a KV connector that restores Mamba states.

Under eviction a hybrid model's groups stop agreeing on a prefix: a full-attention tail is
evicted while a deeper Mamba state survives, or the states between the ends are evicted
while every full-attention block stays. The hybrid hit (`get_computed_blocks`) is the
boundary every group serves. A connector with `supports_divergent_local_hybrid_hits`
transfers the Mamba state at the boundary it loads to, so vLLM's scheduler asks
`get_computed_blocks_for_connector` for the full-attention hit instead, flagged as diverged
when some group lags it, and takes it only when the connector loads tokens past it (else it
falls back to the hybrid hit). pagedkv's `allocate` then takes that hit with the loaded
tokens (`loaded_tokens`): a state group whose state arrives with the load holds none of the
hit, as vLLM's Mamba manager holds only nulls below the loaded boundary.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from pagedkv.vllm.blocks import PagedKVCacheBlocks

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.request import Request

    from pagedkv.vllm.manager import KVCacheManager


def serves_divergent_hits(manager: KVCacheManager) -> bool:
    """Whether vLLM's manager would take a per-group hit for this layout: a Mamba group and
    a full-attention group, prefix caching on (vLLM's hybrid coordinator). With EAGLE the
    hybrid hit is kept (pagedkv's drop of the last hit block is per hybrid hit only)."""
    kinds = [g.kind for g in manager.layout.groups]
    return manager.enable_caching and not manager.use_eagle and "state" in kinds and "full" in kinds


def hits_per_group(
    manager: KVCacheManager, block_hashes: Sequence[bytes], max_cache_hit_length: int
) -> tuple[tuple[list[int], ...], tuple[int, ...], list[bytes]]:
    """Each vLLM group's own longest hit of at most `max_cache_hit_length` tokens (vLLM's
    `find_longest_cache_hit_per_group`): its block ids (vLLM's, 0 where it needs no block),
    its hit in tokens, and the keys of the blocks of the longest hit."""
    layout = manager.layout
    bs = manager.block_size
    limit = max(max_cache_hit_length, 0)
    # A prompt one token past the cap: the core's own cap (one token computed) is then it.
    n = limit + 1
    r = layout.hash_ratio
    count = min(len(block_hashes) // r, n // bs)
    keys = [block_hashes[(i + 1) * r - 1] for i in range(count)]
    found = manager.core.lookup_blocks_per_group(range(n), block_hashes=keys)
    off = manager.offset
    ids: list[list[int]] = []
    hits: list[int] = []
    for c in layout.core_index:
        if c is None:  # cross-attention: never hit
            ids.append([])
            hits.append(0)
            continue
        hit, blocks = found[c]
        ids.append([b + off for b in blocks])
        hits.append(int(hit))
    longest = max(hits, default=0) // bs
    return tuple(ids), tuple(hits), keys[:longest]


def computed_blocks_for_connector(
    manager: KVCacheManager, request: Request, max_cache_hit_length: int | None
) -> tuple[KVCacheBlocks, int, int, bool]:
    """vLLM's `get_computed_blocks_for_connector`: the full-attention hit with every group's
    own hit blocks and whether a group lags it; the hybrid hit when some group runs deeper
    than full attention (its full-attention blocks were evicted) or the layout has no
    per-group hit."""
    if not serves_divergent_hits(manager):
        return (*manager.get_computed_blocks(request, max_cache_hit_length), False)
    if not manager.prefix_cache_lookup_enabled(request):
        return manager.empty_kv_cache_blocks, 0, 0, False
    if max_cache_hit_length is None:
        max_cache_hit_length = request.num_tokens - 1
    ids, hits, keys = hits_per_group(manager, request.block_hashes, max_cache_hit_length)
    fa = manager.coordinator.full_attention_group_id
    if any(hit > hits[fa] for hit in hits):
        return (*manager.get_computed_blocks(request, max_cache_hit_length), False)
    local = hits[fa]
    if not local:
        return manager.empty_kv_cache_blocks, 0, 0, False
    blocks = PagedKVCacheBlocks(ids, lambda: manager._views(ids, keys, 0))
    # As vLLM's: per-group lookups report no uncached shared prefix (boundary 0).
    return blocks, local, 0, min(hits) < local


__all__ = ["computed_blocks_for_connector", "hits_per_group", "serves_divergent_hits"]
