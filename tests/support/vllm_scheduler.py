"""A vLLM 0.33 scheduler built from vLLM's public configs, with either KV-cache manager,
and one engine step driven with fake model output (for tests and the step benchmark)."""

from __future__ import annotations

from typing import Any

import torch
from vllm.config import (
    CacheConfig,
    ModelConfig,
    SchedulerConfig,
    SpeculativeConfig,
    VllmConfig,
)
from vllm.v1.core.sched.async_scheduler import AsyncScheduler as VllmAsyncScheduler
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler as VllmScheduler
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
)
from vllm.v1.outputs import DraftTokenIds
from vllm.v1.structured_output import StructuredOutputManager

from pagedkv.vllm import AsyncScheduler as PagedAsyncScheduler
from pagedkv.vllm import Scheduler as PagedScheduler
from vllm_runner_output import runner_output

SCHEDULERS: dict[str, type[VllmScheduler]] = {"vllm": VllmScheduler, "pagedkv": PagedScheduler}
ASYNC_SCHEDULERS: dict[str, type[VllmScheduler]] = {
    "vllm": VllmAsyncScheduler,
    "pagedkv": PagedAsyncScheduler,
}


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
    specs: list[KVCacheSpec] | None = None,
    num_speculative_tokens: int | None = None,
    async_scheduling: bool = False,
    retention_interval: int | None = None,
) -> VllmScheduler:
    """`which`: "vllm" (vLLM's own manager) or "pagedkv" (`pagedkv.vllm.Scheduler`).
    `specs`: the KV-cache groups (default one full-attention group); with
    `num_speculative_tokens` the scheduler runs speculative decoding (drafts come from
    `give_drafts`, their acceptance from `run_step`); `async_scheduling`: vLLM's
    asynchronous scheduler (the next step is scheduled before the last one's output);
    `retention_interval`: the `KVCacheConfig`'s `prefix_cache_retention_interval` (None, its
    own default: window groups cache every full block; 0, what vLLM's engine passes from
    `CacheConfig`: they cache only the blocks a later hit can reach)."""
    model_config = ModelConfig(model=model, dtype="float16", seed=0, max_model_len=max_model_len)
    scheduler_config = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        enable_chunked_prefill=True,
        is_encoder_decoder=False,
        watermark=0.0,
        async_scheduling=async_scheduling,
    )
    cache_config = CacheConfig(
        block_size=block_size,
        gpu_memory_utilization=0.9,
        cache_dtype="auto",
        enable_prefix_caching=enable_prefix_caching,
    )
    cache_config.num_gpu_blocks = num_blocks
    speculative_config = None
    if num_speculative_tokens is not None:
        speculative_config = SpeculativeConfig(
            model="ngram", num_speculative_tokens=num_speculative_tokens
        )
    vllm_config = VllmConfig(
        scheduler_config=scheduler_config,
        model_config=model_config,
        cache_config=cache_config,
        speculative_config=speculative_config,
    )
    if specs is None:
        specs = [
            FullAttentionSpec(
                block_size=block_size, num_kv_heads=1, head_size=1, dtype=torch.float32
            )
        ]
    kv_cache_config = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec([f"layer.{i}"], s) for i, s in enumerate(specs)],
        prefix_cache_retention_interval=retention_interval,
    )
    classes = ASYNC_SCHEDULERS if async_scheduling else SCHEDULERS
    return classes[which](
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        block_size=block_size,
        log_stats=False,
        structured_output_manager=StructuredOutputManager(vllm_config),
    )


def step(scheduler: VllmScheduler, token: int = 7) -> Any:
    """One engine step: `schedule()`, then `update_from_output()` with one sampled token per
    scheduled request (a prefill chunk that ends inside the prompt samples nothing)."""
    return run_step(scheduler, token)[1]


def run_step(
    scheduler: VllmScheduler, token: int = 7, *, accepted: dict[str, int] | None = None
) -> tuple[SchedulerOutput, Any]:
    """`step`, returning the scheduler's output with the update's. With speculative
    decoding, `accepted[rid]` of the request's scheduled drafts are accepted (default none):
    they are sampled before the step's own token."""
    accepted = accepted or {}
    out = scheduler.schedule()
    ids = list(out.num_scheduled_tokens)
    sampled: list[list[int]] = []
    for rid in ids:
        req = scheduler.requests[rid]
        # schedule() has already counted this step's tokens as computed.
        if req.num_computed_tokens < req.num_tokens:
            sampled.append([])
            continue
        spec = out.scheduled_spec_decode_tokens.get(rid, [])
        n = min(accepted.get(rid, 0), len(spec))
        sampled.append([*spec[:n], token])
    output = runner_output(ids, sampled)
    return out, scheduler.update_from_output(out, output)


def give_drafts(scheduler: VllmScheduler, drafts: dict[str, list[int]]) -> None:
    """The drafter's proposals for the next step (after the update, as the engine does)."""
    ids = sorted(drafts)
    scheduler.update_draft_token_ids(DraftTokenIds(ids, [drafts[r] for r in ids]))


__all__ = ["SCHEDULERS", "build_scheduler", "give_drafts", "run_step", "step"]
