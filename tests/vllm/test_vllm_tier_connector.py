"""vLLM 0.33's own scheduler with its OffloadingConnector, configured by
``kv_transfer_config`` alone to put PagedKVTier (Redis) below its CPU tier: engine A runs a
prompt, its chunks are offloaded and cascade into Redis; engine B, with nothing cached,
gets the same prompt, finds the chunks in Redis, promotes them into its CPU tier with A's
bytes, and schedules their load onto the GPU instead of computing them.

Only the scheduler side runs: the connector's worker side copies between GPU and CPU with
CUDA (vllm/v1/kv_offload/cpu/gpu_worker.py asserts CUDA or XPU KV tensors and copies with
``ops.swap_blocks_batch`` on a device stream), so this test plays the worker: it writes
each store job's chunks into the CPU rows and reports every job done, as the worker's
metadata would."""

from __future__ import annotations

import secrets
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from vllm.config import CacheConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
    OffloadingWorkerMetadata,
)
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

from pagedkv.vllm import PagedKVTier
from redis_fixtures import ServerProcess, running_server, server_binary
from vllm_runner_output import runner_output

BLOCK = 16
BLOCKS = 64
PROMPT = list(range(1, 1 + 4 * BLOCK + 5))  # four full blocks and a tail


@pytest.fixture
def server(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[ServerProcess]:
    monkeypatch.setenv("PAGEDKV_TIER_SECRET", secrets.token_hex(32))
    with running_server(server_binary("redis"), tmp_path / "redis") as s:
        yield s


def engine(url: str) -> Scheduler:
    """vLLM's scheduler, its connector built from this kv_transfer_config alone."""
    transfer = KVTransferConfig(
        kv_connector="OffloadingConnector",
        kv_role="kv_both",
        kv_connector_extra_config={
            "spec_name": "TieringOffloadingSpec",
            "cpu_bytes_to_use": 32 * 8192,
            "secondary_tiers": [
                {"type": "PagedKVTier", "module_path": "pagedkv.vllm", "redis_url": url}
            ],
        },
    )
    model = ModelConfig(model="facebook/opt-125m", dtype="float16", seed=0, max_model_len=2048)
    sched = SchedulerConfig(
        max_num_seqs=8,
        max_num_batched_tokens=2048,
        max_model_len=2048,
        enable_chunked_prefill=True,
        is_encoder_decoder=False,
        watermark=0.0,
    )
    cache = CacheConfig(block_size=BLOCK, cache_dtype="auto", enable_prefix_caching=True)
    cache.num_gpu_blocks = BLOCKS
    config = VllmConfig(
        scheduler_config=sched, model_config=model, cache_config=cache, kv_transfer_config=transfer
    )
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=64, dtype=torch.float16)
    kv = KVCacheConfig(
        num_blocks=BLOCKS, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["layer"], spec)]
    )
    return Scheduler(
        vllm_config=config,
        kv_cache_config=kv,
        block_size=BLOCK,
        log_stats=False,
        structured_output_manager=StructuredOutputManager(config),
    )


def rows_of(s: Scheduler) -> np.ndarray:
    view = s.connector.connector_scheduler.manager.primary_tier.get_kv_memoryview()
    return np.asarray(view).view(np.uint8)


def tier_of(s: Scheduler) -> PagedKVTier:
    (tier,) = s.connector.connector_scheduler.manager.secondary_tiers
    assert isinstance(tier, PagedKVTier)
    return tier


def step(s: Scheduler, on_store: Any = None) -> Any:
    """One step with fake model output; the worker's part: each store job's chunks are
    written by `on_store(dst_chunk_ids)`, and every job is reported done."""
    out = s.schedule()
    meta = out.kv_connector_metadata
    done = OffloadingWorkerMetadata()
    for job_id, job in meta.store_jobs.items():
        if on_store is not None:
            on_store(job.dst_spec.block_ids)
        done.mark_completed(job_id)
    for job_id in meta.load_jobs:
        done.mark_completed(job_id)
    ids = list(out.num_scheduled_tokens)
    sampled = [
        [7] if s.requests[r].num_computed_tokens >= s.requests[r].num_tokens else [] for r in ids
    ]
    result = runner_output(
        ids, sampled, kv_connector_output=KVConnectorOutput(kv_connector_worker_meta=done)
    )
    s.update_from_output(out, result)
    return out


def test_engine_b_loads_engine_a_prompt_from_redis(server):
    init_none_hash(sha256)
    hasher = get_request_block_hasher(BLOCK, sha256)
    a, b = engine(server.url), engine(server.url)
    try:
        # Engine A computes the prompt; the "worker" offloads each chunk with bytes of its own.
        rows_a = rows_of(a)
        rng = np.random.default_rng(0)

        def offload(cids: np.ndarray) -> None:
            for c in cids:
                rows_a[c] = rng.integers(0, 256, rows_a.shape[1], dtype=np.uint8)

        a.add_request(Request("a", PROMPT, SamplingParams(max_tokens=2), None, block_hasher=hasher))
        # A's first look-ups wait (RETRY) for Redis's answer: a miss. Bounded by time, so that
        # a loaded machine only makes it slower.
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            step(a, offload)
            if not a.requests:
                break
            time.sleep(0.002)
        assert not a.requests, "engine A never finished its request"
        tier_a = tier_of(a)
        tier_a.drain_jobs()
        stats_a = tier_a.tier_stats()
        assert stats_a.puts == 4 and stats_a.dropped_puts == 0
        sent = {rows_a[c].tobytes() for c in range(len(rows_a)) if rows_a[c].any()}
        assert len(sent) == 4

        # Engine B: the same prompt; its look-ups find the chunks in Redis and promote them.
        b.add_request(Request("b", PROMPT, SamplingParams(max_tokens=2), None, block_hasher=hasher))
        rows_b = rows_of(b)
        loads = {}
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            out = step(b)
            loads.update(out.kv_connector_metadata.load_jobs)
            if loads:
                break
            time.sleep(0.002)
        assert loads, "engine B never scheduled a load from the offloaded chunks"
        (job,) = loads.values()
        assert job.req_id == "b"
        got = {rows_b[c].tobytes() for c in job.src_spec.block_ids}
        assert got == sent  # A's bytes, promoted from Redis into B's CPU tier
        assert tier_of(b).tier_stats().hits == 4
    finally:
        a.shutdown()
        b.shutdown()
