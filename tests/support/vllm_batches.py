"""Batches of requests through vLLM's scheduler as `LLM.generate` submits them (a batch all
at once, run to the end before the next), with either KV-cache manager: the schedule step by
step and each request's prefix hit (`num_cached_tokens`, from its prefill stats)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.request import Request

from vllm_scheduler import build_scheduler, run_step

init_none_hash(sha256)


@dataclass(frozen=True)
class Replay:
    hits: list[int]  # num_cached_tokens per request, in submission order
    # Per step: what it scheduled per request, whom it preempted, the free blocks after it.
    schedule: list[tuple[Any, ...]]


def replay(which: str, batches: list[list[list[int]]], max_tokens: int, **config: Any) -> Replay:
    """`batches` under `which` ("vllm" or "pagedkv"); `config`: `build_scheduler`'s keywords."""
    scheduler = build_scheduler(which, **config)
    hasher = get_request_block_hasher(config.get("block_size", 16), sha256)
    hits: dict[str, int] = {}
    rids: list[str] = []
    schedule: list[tuple[Any, ...]] = []
    for b, batch in enumerate(batches):
        for p in batch:
            rid = f"{b}-{len(rids)}"
            rids.append(rid)
            scheduler.add_request(
                Request(
                    request_id=rid,
                    prompt_token_ids=list(p),
                    sampling_params=SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                    pooling_params=None,
                    block_hasher=hasher,
                )
            )
        while scheduler.requests:
            out, outputs = run_step(scheduler, 7 + len(schedule) % 5)
            for engine_outputs in outputs.values():
                for o in engine_outputs.outputs:
                    if o.prefill_stats is not None:
                        hits[o.request_id] = o.prefill_stats.num_cached_tokens
            schedule.append(
                (
                    tuple(sorted(out.num_scheduled_tokens.items())),
                    tuple(sorted(out.preempted_req_ids or ())),
                    scheduler.kv_cache_manager.block_pool.get_num_free_blocks(),
                )
            )
    missing = [r for r in rids if r not in hits]
    assert not missing, f"no prefill stats for {missing}"
    return Replay([hits[r] for r in rids], schedule)


__all__ = ["Replay", "replay"]
