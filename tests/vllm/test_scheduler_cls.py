"""`--scheduler-cls pagedkv.vllm.Scheduler`: vLLM resolves the name and the scheduler runs
its steps on pagedkv's manager, leaving vLLM's own scheduler class untouched."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from vllm.config import SchedulerConfig
from vllm.v1.core.kv_cache_manager import KVCacheManager as VllmKVCacheManager
from vllm.v1.core.sched import scheduler as vllm_scheduler

import pagedkv.vllm
from vllm_scheduler import build_scheduler, step


def test_vllm_resolves_the_class_by_name() -> None:
    config = SchedulerConfig(
        max_model_len=2048, is_encoder_decoder=False, scheduler_cls="pagedkv.vllm.Scheduler"
    )
    assert config.get_scheduler_cls() is pagedkv.vllm.Scheduler


def test_steps_run_on_pagedkv_and_vllms_own_scheduler_keeps_its_manager() -> None:
    ours = build_scheduler("pagedkv", num_blocks=256, max_num_seqs=8)
    assert isinstance(ours.kv_cache_manager, pagedkv.vllm.KVCacheManager)
    assert vllm_scheduler.KVCacheManager is VllmKVCacheManager
    theirs = build_scheduler("vllm", num_blocks=256, max_num_seqs=8)
    assert isinstance(theirs.kv_cache_manager, VllmKVCacheManager)
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    init_none_hash(sha256)
    hasher = get_request_block_hasher(16, sha256)
    for s in (ours, theirs):
        for i in range(6):
            prompt = [*range(64), *range(1000 * i, 1000 * i + 36)]
            s.add_request(
                Request(
                    request_id=str(i),
                    prompt_token_ids=prompt,
                    sampling_params=SamplingParams(max_tokens=5, ignore_eos=True),
                    pooling_params=None,
                    block_hasher=hasher,
                )
            )
    for _ in range(8):
        step(ours)
        step(theirs)
    assert not ours.requests and not theirs.requests  # every request finished
    free = ours.kv_cache_manager.block_pool.get_num_free_blocks()
    assert free == theirs.kv_cache_manager.block_pool.get_num_free_blocks() == 255
