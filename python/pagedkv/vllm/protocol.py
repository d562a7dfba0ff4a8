"""What each supported vLLM release's scheduler calls on its KV-cache manager, pinned.

`SchedulerKVCacheManager` is vLLM 0.33.0's interface, read from its
`vllm/v1/core/sched/scheduler.py` and `kv_cache_manager.py`; `Interface032` and
`Interface034` are 0.32.0's and 0.34.0's, written as their differences from it (`REMOVED`:
methods a release dropped). tests/vllm/test_protocol.py compares every method's parameters
(names, kinds, defaults) of the installed release's pin with the installed vLLM's
`KVCacheManager` (equal, or drift) and with `pagedkv.vllm.KVCacheManager` (callable the same
way), so a release that changes one fails there first. A new release is one more class here
and an entry in `PINNED`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.kv_cache_utils import KVCacheBlockCopy
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.metrics.stats import PrefixCacheStats
    from vllm.v1.request import Request

# Attributes the scheduler (and vLLM's scheduler tests) read on the manager.
ATTRIBUTES = (
    "block_pool",
    "coordinator",
    "empty_kv_cache_blocks",
    "enable_caching",
    "kv_cache_config",
    "mamba_shared_prefix_checkpoint",
    "max_model_len",
    "num_kv_cache_groups",
    "prefix_cache_stats",
    "usage",
)


class SchedulerKVCacheManager(Protocol):
    kv_cache_config: KVCacheConfig
    max_model_len: int
    enable_caching: bool
    num_kv_cache_groups: int
    mamba_shared_prefix_checkpoint: bool
    prefix_cache_stats: PrefixCacheStats | None
    empty_kv_cache_blocks: KVCacheBlocks
    block_pool: Any
    coordinator: Any

    def __init__(
        self,
        kv_cache_config: KVCacheConfig,
        max_model_len: int,
        scheduler_block_size: int,
        hash_block_size: int,
        max_in_flight_tokens: int | None = None,
        enable_caching: bool = True,
        use_eagle: bool = False,
        num_hash_lookahead_tokens: int = 0,
        num_prefill_lookahead: int = 0,
        log_stats: bool = False,
        enable_kv_cache_events: bool = False,
        dcp_world_size: int = 1,
        pcp_world_size: int = 1,
        metrics_collector: Any | None = None,
        watermark: float = 0.0,
        enable_mamba_shared_prefix_checkpoint: bool = False,
    ) -> None: ...
    @property
    def usage(self) -> float: ...
    def make_prefix_cache_stats(self) -> PrefixCacheStats | None: ...
    def prefix_cache_lookup_enabled(self, request: Request) -> bool: ...
    def record_prefix_cache_stats(self, request: Request, num_hits: int) -> None: ...
    def get_computed_blocks(
        self, request: Request, max_cache_hit_length: int | None = None
    ) -> tuple[KVCacheBlocks, int, int]: ...
    def get_computed_blocks_for_connector(
        self, request: Request, max_cache_hit_length: int | None = None
    ) -> tuple[KVCacheBlocks, int, int, bool]: ...
    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: KVCacheBlocks | None = None,
        num_lookahead_tokens: int = 0,
        num_external_computed_tokens: int = 0,
        delay_cache_blocks: bool = False,
        num_encoder_tokens: int = 0,
        full_sequence_must_fit: bool = False,
        reserved_blocks: int = 0,
        has_scheduled_reqs: bool = True,
        skip_zeroing_group_ids: tuple[int, ...] = (),
    ) -> KVCacheBlocks | None: ...
    def free(self, request: Request) -> None: ...
    def remove_skipped_blocks(
        self,
        request_id: str,
        processed_computed_tokens: int,
        num_prompt_tokens: int | None = None,
    ) -> None: ...
    def pop_blocks_for_free(self, request: Request) -> list[Any]: ...
    def evict_blocks(self, block_ids: set[int]) -> None: ...
    def reset_prefix_cache(self) -> bool: ...
    def get_num_common_prefix_blocks(self, running_request_id: str) -> list[int]: ...
    def take_events(self) -> list[KVCacheEvent]: ...
    def get_blocks(self, request_id: str) -> KVCacheBlocks: ...
    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]: ...
    def get_block_ids_for_computed_tokens(
        self, request_id: str, num_computed_tokens: int
    ) -> tuple[list[int], ...]: ...
    def estimate_cached_tokens(self, request: Request) -> int: ...
    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None: ...
    def create_kv_cache_blocks(self, blocks: tuple[Sequence[Any], ...]) -> KVCacheBlocks: ...
    def truncate_computed_blocks(
        self, blocks: KVCacheBlocks, num_computed_tokens: int
    ) -> KVCacheBlocks: ...
    def take_new_block_ids(self) -> list[int]: ...
    def record_blocks_for_zeroing(self, request_id: str, start_token: int) -> None: ...
    def take_kv_cache_block_copies(self) -> tuple[list[KVCacheBlockCopy], list[Any]]: ...
    def take_boundary_state_offloads(self) -> dict[str, list[tuple[int, int, int]]]: ...
    def finalize_partial_tail_offloads(self, request: Request) -> list[tuple[int, int, int]]: ...
    def new_step_starts(self) -> None: ...


class Interface032(SchedulerKVCacheManager, Protocol):
    """vLLM 0.32.0: no `num_hash_lookahead_tokens`, no `max_cache_hit_length` bound. (An older
    release's methods take fewer parameters: as types they narrow 0.33.0's, hence the
    `override` ignores; as pins they are what 0.32.0 declares.)"""

    def __init__(
        self,
        kv_cache_config: KVCacheConfig,
        max_model_len: int,
        scheduler_block_size: int,
        hash_block_size: int,
        max_in_flight_tokens: int | None = None,
        enable_caching: bool = True,
        use_eagle: bool = False,
        num_prefill_lookahead: int = 0,
        log_stats: bool = False,
        enable_kv_cache_events: bool = False,
        dcp_world_size: int = 1,
        pcp_world_size: int = 1,
        metrics_collector: Any | None = None,
        watermark: float = 0.0,
        enable_mamba_shared_prefix_checkpoint: bool = False,
    ) -> None: ...
    def get_computed_blocks(  # type: ignore[override]
        self, request: Request
    ) -> tuple[KVCacheBlocks, int, int]: ...
    def get_computed_blocks_for_connector(  # type: ignore[override]
        self, request: Request
    ) -> tuple[KVCacheBlocks, int, int, bool]: ...


class Interface034(SchedulerKVCacheManager, Protocol):
    """vLLM 0.34.0: `get_num_cached_tokens` added (the cache-aware ordering of waiting
    requests probes it), `get_num_common_prefix_blocks` removed (`REMOVED`)."""

    def get_num_cached_tokens(self, request: Request) -> int: ...


# The pinned interface of each release tested, and the methods it removed from 0.33.0's.
PINNED: dict[str, type[Any]] = {
    "0.32.0": Interface032,
    "0.33.0": SchedulerKVCacheManager,
    "0.34.0": Interface034,
}
REMOVED: dict[str, frozenset[str]] = {
    "0.34.0": frozenset({"get_num_common_prefix_blocks"}),
}


__all__ = [
    "ATTRIBUTES",
    "PINNED",
    "REMOVED",
    "Interface032",
    "Interface034",
    "SchedulerKVCacheManager",
]
