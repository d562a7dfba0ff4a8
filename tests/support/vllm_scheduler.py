"""A vLLM 0.33 scheduler built from vLLM's public configs, with either KV-cache manager,
and one engine step driven with fake model output (for tests and the step benchmark)."""

from __future__ import annotations

from typing import Any

import torch
from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.v1.core.sched.scheduler import Scheduler as VllmScheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.structured_output import StructuredOutputManager

from pagedkv.vllm import Scheduler as PagedScheduler

SCHEDULERS: dict[str, type[VllmScheduler]] = {"vllm": VllmScheduler, "pagedkv": PagedScheduler}


def build_scheduler(
    which: str,
    *,
    num_blocks: int,
    block_size: int = 16,
    max_num_seqs: int = 256,
    max_num_batched_tokens: int = 8192,
    max_model_len: int = 2048,
    enable_prefix_caching: bool = True,
    model: str = "facebook/opt-125m",
) -> VllmScheduler:
    """`which`: "vllm" (vLLM's own manager) or "pagedkv" (`pagedkv.vllm.Scheduler`)."""
    model_config = ModelConfig(model=model, dtype="float16", seed=0, max_model_len=max_model_len)
    scheduler_config = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        enable_chunked_prefill=True,
        is_encoder_decoder=False,
        watermark=0.0,
    )
    cache_config = CacheConfig(
        block_size=block_size,
        gpu_memory_utilization=0.9,
        cache_dtype="auto",
        enable_prefix_caching=enable_prefix_caching,
    )
    cache_config.num_gpu_blocks = num_blocks
    vllm_config = VllmConfig(
        scheduler_config=scheduler_config, model_config=model_config, cache_config=cache_config
    )
    spec = FullAttentionSpec(
        block_size=block_size, num_kv_heads=1, head_size=1, dtype=torch.float32
    )
    kv_cache_config = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["layer"], spec)],
    )
    return SCHEDULERS[which](
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        block_size=block_size,
        log_stats=False,
        structured_output_manager=StructuredOutputManager(vllm_config),
    )


def step(scheduler: VllmScheduler, token: int = 7) -> Any:
    """One engine step: `schedule()`, then `update_from_output()` with one sampled token per
    scheduled request (a prefill chunk that ends inside the prompt samples nothing)."""
    out = scheduler.schedule()
    ids = list(out.num_scheduled_tokens)
    sampled: list[list[int]] = []
    for rid in ids:
        req = scheduler.requests[rid]
        # schedule() has already counted this step's tokens as computed.
        sampled.append([token] if req.num_computed_tokens >= req.num_tokens else [])
    output = ModelRunnerOutput(
        req_ids=ids,
        req_id_to_index={r: i for i, r in enumerate(ids)},
        sampled_token_ids=sampled,
        logprobs=None,
        prompt_logprobs_dict={},
        pooler_output=[],
    )
    return scheduler.update_from_output(out, output)


__all__ = ["SCHEDULERS", "build_scheduler", "step"]
