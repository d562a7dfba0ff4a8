"""Read-only views of the manager shaped like the vLLM internals its scheduler and tests read.

vLLM's scheduler reaches into `coordinator.single_type_managers[i]` (block size, spec) and
`block_pool` (free blocks, usage, deferred frees); its tests read `req_to_blocks`,
`num_cached_block`, `free_block_queue.num_free_blocks` and every block's `ref_cnt`. These
views answer from pagedkv on demand: none of them costs anything on the per-step path.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from vllm.v1.core.kv_cache_coordinator import HybridKVCacheCoordinator
from vllm.v1.core.kv_cache_utils import KVCacheBlock
from vllm.v1.core.single_type_kv_cache_manager import CrossAttentionManager

from pagedkv.vllm.divergent import hits_per_group

if TYPE_CHECKING:
    from vllm.v1.kv_cache_interface import KVCacheSpec

    from pagedkv.vllm.manager import KVCacheManager


class _FreeQueueView:
    def __init__(self, pool: BlockPoolView) -> None:
        self._pool = pool

    @property
    def num_free_blocks(self) -> int:
        return self._pool.get_num_free_blocks()


class BlockPoolView:
    """vLLM's `BlockPool` as the scheduler and tests read it."""

    def __init__(self, manager: KVCacheManager) -> None:
        self._m = manager
        self.num_gpu_blocks = manager.layout.num_vllm_blocks
        self.enable_caching = manager.enable_caching
        self.hash_block_size = manager.layout.hash_block_size
        self.free_block_queue = _FreeQueueView(self)
        self.null_block = KVCacheBlock(block_id=0, is_null=True)

    def get_num_free_blocks(self) -> int:
        """Blocks no request holds (free or cached), vLLM's null block aside."""
        # Deferred steps take no block: no settling needed (nor wanted: vLLM reads it often).
        return int(self._m._core_mgr.num_available_blocks)

    def get_usage(self) -> float:
        usable = self.num_gpu_blocks - 1
        if not usable:
            return 0.0
        return 1.0 - self.get_num_free_blocks() / int(usable)

    def free_blocks(self, ordered_blocks: Iterable[Any]) -> None:
        """Give back blocks `pop_blocks_for_free` handed out (vLLM's deferred frees)."""
        self._m.free_popped(ordered_blocks)

    def evict_blocks(self, block_ids: set[int]) -> None:
        self._m.evict_blocks(block_ids)

    def reset_prefix_cache(self) -> bool:
        return self._m.reset_prefix_cache()

    def get_cached_block(
        self, block_hash: bytes, kv_cache_group_ids: list[int]
    ) -> list[KVCacheBlock] | None:
        """The cached block of `block_hash` in each group, or None on a miss in any."""
        m = self._m
        bs = m.block_size
        hit, ids = m.core.lookup_blocks(range(bs + 1), block_hashes=[block_hash])
        if hit < bs:
            return None
        off = m.offset
        return [KVCacheBlock(block_id=ids[g][0] + off) for g in kv_cache_group_ids]

    @property
    def blocks(self) -> list[KVCacheBlock]:
        """Every block with its reference count (the requests' tables that hold it)."""
        counts = [0] * self.num_gpu_blocks
        for rid in self._m.request_ids():
            for group in self._m.get_block_ids(rid):
                for b in group:
                    if b:
                        counts[b] += 1
        return [KVCacheBlock(block_id=i, ref_cnt=c, is_null=i == 0) for i, c in enumerate(counts)]


class _ReqToBlocks(Mapping[str, list[KVCacheBlock]]):
    def __init__(self, manager: KVCacheManager, group: int, null: KVCacheBlock) -> None:
        self._m = manager
        self._g = group
        self._null = null

    def __getitem__(self, rid: str) -> list[KVCacheBlock]:
        if rid not in self._m.request_ids():
            raise KeyError(rid)
        ids = self._m.get_block_ids(rid)[self._g]
        # vLLM's tables hold its one null block object: tests compare entries with it.
        return [self._null if b == 0 else KVCacheBlock(block_id=b) for b in ids]

    def __iter__(self) -> Iterator[str]:
        return iter(self._m.request_ids())

    def __len__(self) -> int:
        return len(self._m.request_ids())


class _NumCachedBlock(Mapping[str, int]):
    def __init__(self, manager: KVCacheManager) -> None:
        self._m = manager

    def __getitem__(self, rid: str) -> int:
        if rid not in self._m.request_ids():
            raise KeyError(rid)
        return self._m.num_cached_blocks(rid)

    def __iter__(self) -> Iterator[str]:
        return iter(self._m.request_ids())

    def __len__(self) -> int:
        return len(self._m.request_ids())


class SingleTypeManagerView:
    """One KV-cache group, as vLLM's `SingleTypeKVCacheManager` is read."""

    retains_longer_hit = False
    records_new_block_ids = False

    def __init__(self, manager: KVCacheManager, group: int, spec: KVCacheSpec) -> None:
        self.kv_cache_group_id = group
        self.kv_cache_spec = spec
        self.block_pool = manager.block_pool
        self.block_size = spec.block_size
        self._null_block = manager.block_pool.null_block
        self.req_to_blocks = _ReqToBlocks(manager, group, self._null_block)
        self.num_cached_block = _NumCachedBlock(manager)

    def take_new_block_ids(self) -> list[int]:
        return []


class CrossAttentionView(CrossAttentionManager):
    """A cross-attention group's view. It is a `CrossAttentionManager` only so that code
    finding the group by its type finds it; none of vLLM's manager state is built (its
    `__init__` is not called) and only the view's attributes are read."""

    retains_longer_hit = False
    records_new_block_ids = False

    def __init__(self, manager: KVCacheManager, group: int, spec: KVCacheSpec) -> None:
        self.kv_cache_group_id = group
        self.kv_cache_spec = spec
        self.block_size = spec.block_size
        self.block_pool = manager.block_pool
        self._null_block = manager.block_pool.null_block
        self.req_to_blocks = _ReqToBlocks(manager, group, self._null_block)
        self.num_cached_block: dict[str, int] = {}

    def take_new_block_ids(self) -> list[int]:
        return []


class CoordinatorView:
    """vLLM's KV-cache coordinator as the scheduler reads it."""

    enable_partial_hash_hits = False
    num_reprefillable_tokens = 0
    eagle_group_ids: tuple[int, ...] = ()

    def __init__(self, manager: KVCacheManager) -> None:
        self._m = manager
        self.block_pool = manager.block_pool
        layout = manager.layout
        self.single_type_managers: Sequence[SingleTypeManagerView | CrossAttentionView] = [
            SingleTypeManagerView(manager, g, spec)
            if layout.core_index[g] is not None
            else CrossAttentionView(manager, g, spec)
            for g, spec in enumerate(layout.specs)
        ]
        self.full_attention_group_id = next(
            (
                g
                for g, c in enumerate(layout.core_index)
                if c is not None and layout.groups[c].kind == "full"
            ),
            0,
        )

    def get_num_blocks_to_allocate(
        self,
        request_id: str,
        num_tokens: int,
        new_computed_blocks: tuple[Sequence[Any], ...],
        num_encoder_tokens: int,
        total_computed_tokens: int,
        num_local_computed_tokens: int,
        num_tokens_main_model: int,
        apply_admission_cap: bool = False,
        prefill_end: int = 0,
    ) -> int:
        """Blocks the request still needs to hold `num_tokens` tokens: new table entries in
        every group, and its cross-attention blocks if it has none yet (the scheduler's
        admission estimate for a running request)."""
        m = self._m
        bs: int = m.block_size
        ids = m.get_block_ids(request_id)
        have = len(ids[self.full_attention_group_id])
        hit = len(new_computed_blocks[0]) if new_computed_blocks else 0
        want = -(-num_tokens // bs)
        need = max(want - have - hit, 0) * m.layout.num_core_groups
        if m.layout.has_cross and num_encoder_tokens:
            cross = next(g for g, c in enumerate(m.layout.core_index) if c is None)
            if not ids[cross]:
                need += -(-num_encoder_tokens // bs)
        return need


class HybridCoordinatorView(CoordinatorView, HybridKVCacheCoordinator):
    """The coordinator of a layout of several groups with prefix caching: vLLM builds a
    `HybridKVCacheCoordinator` there, and its manager and tests check for that type. None
    of vLLM's coordinator state is built (its `__init__` is not called); only the view's
    attributes and methods are read."""

    def __init__(self, manager: KVCacheManager) -> None:
        CoordinatorView.__init__(self, manager)

    def find_longest_cache_hit_per_group(
        self, block_hashes: Sequence[bytes], max_cache_hit_length: int
    ) -> tuple[tuple[list[KVCacheBlock], ...], tuple[int, ...]]:
        """Each group's own longest hit, looked up independently: its blocks and its hit in
        tokens (they diverge under eviction; the hybrid hit is where all agree)."""
        m = self._m
        ids, hits, keys = hits_per_group(m, block_hashes, max_cache_hit_length)
        return m._views(ids, keys, 0), hits


def coordinator_view(manager: KVCacheManager) -> CoordinatorView:
    """The view of the coordinator vLLM would build for the manager's layout."""
    if manager.enable_caching and manager.layout.num_groups > 1:
        return HybridCoordinatorView(manager)
    return CoordinatorView(manager)
