"""vLLM objects (0.32 to 0.34) for the `tests/vllm` room: KV-cache configs, requests with
vLLM's own block hasher, and both managers built the way vLLM's scheduler builds them."""

from __future__ import annotations

from typing import Any

import torch
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_manager import KVCacheManager as VllmKVCacheManager
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    SlidingWindowSpec,
)
from vllm.v1.request import Request

from pagedkv.vllm import KVCacheManager

init_none_hash(sha256)


def full_spec(block_size: int = 16) -> FullAttentionSpec:
    return FullAttentionSpec(
        block_size=block_size, num_kv_heads=1, head_size=8, dtype=torch.float16
    )


def window_spec(window: int, block_size: int = 16) -> SlidingWindowSpec:
    return SlidingWindowSpec(
        block_size=block_size,
        num_kv_heads=1,
        head_size=8,
        dtype=torch.float16,
        sliding_window=window,
    )


def kv_cache_config(num_blocks: int, specs: list[KVCacheSpec]) -> KVCacheConfig:
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec([f"layer.{i}"], s) for i, s in enumerate(specs)],
    )


def make_manager(
    cls: type[Any],
    num_blocks: int,
    specs: list[KVCacheSpec] | None = None,
    *,
    max_model_len: int = 8192,
    **kwargs: Any,
) -> Any:
    """A manager of `cls` (vLLM's or pagedkv's) with the keywords vLLM's scheduler passes."""
    specs = specs or [full_spec()]
    bs = specs[0].block_size
    return cls(
        kv_cache_config=kv_cache_config(num_blocks, specs),
        max_model_len=max_model_len,
        scheduler_block_size=bs,
        hash_block_size=kwargs.pop("hash_block_size", bs),
        **kwargs,
    )


def make_request(
    rid: str, tokens: list[int], *, block_size: int = 16, max_tokens: int = 64
) -> Request:
    return Request(
        request_id=rid,
        prompt_token_ids=list(tokens),
        sampling_params=SamplingParams(max_tokens=max_tokens, ignore_eos=True),
        pooling_params=None,
        block_hasher=get_request_block_hasher(block_size, sha256),
    )


__all__ = [
    "KVCacheManager",
    "VllmKVCacheManager",
    "full_spec",
    "kv_cache_config",
    "make_manager",
    "make_request",
    "window_spec",
]
