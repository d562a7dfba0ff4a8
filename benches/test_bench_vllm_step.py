"""vLLM 0.33's scheduler step with vLLM's KV-cache manager and with pagedkv's, side by side.

One step is `schedule()` plus `update_from_output()` with fake model output (one sampled
token per request), at 64, 256 and 1,024 running requests that share prefixes: four system
prompts of 512 tokens, each request adding 64 tokens of its own. All requests are admitted
and prefilled before timing, so the timed steps are decode steps of the whole batch (the
steady state of a serving engine); `max_tokens` (1,024) is large enough that none finishes.

    pytest benches/test_bench_vllm_step.py

`benches/vllm_step_share.py` alternates the two managers step by step (the steadier figure on
a shared machine) and splits each step into the time inside the manager and the rest.

The two managers of a size are in one pytest-benchmark group; the ratio table at the end of
the session (benches/conftest.py) gives pagedkv's mean over vLLM's per size.
"""

from __future__ import annotations

import gc
import random
from typing import Any

import pytest

pytest.importorskip("vllm")  # benches/conftest.py prepared vLLM's offline environment

from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.request import Request

from vllm_scheduler import build_scheduler, step

BLOCK = 16
SYSTEM = 512
OWN = 64


def _prompts(n: int) -> list[list[int]]:
    rng = random.Random(0)
    systems = [[rng.randrange(1, 50_000) for _ in range(SYSTEM)] for _ in range(4)]
    return [systems[i % 4] + [rng.randrange(1, 50_000) for _ in range(OWN)] for i in range(n)]


def _request(request_id: str, prompt: list[int]) -> Request:
    """A request of the benchmark (vLLM's block hashes, 1,024 tokens to generate)."""
    return Request(
        request_id=request_id,
        prompt_token_ids=prompt,
        sampling_params=SamplingParams(max_tokens=1024, ignore_eos=True),
        pooling_params=None,
        block_hasher=get_request_block_hasher(BLOCK, sha256),
    )


def _running(which: str, n: int) -> Any:
    init_none_hash(sha256)
    blocks_each = 2048 // BLOCK  # max_model_len (opt-125m's 2,048) in blocks
    scheduler = build_scheduler(
        which,
        num_blocks=n * blocks_each + 64,
        max_num_seqs=n,
        max_num_batched_tokens=max(8192, n * 2),
    )
    for i, prompt in enumerate(_prompts(n)):
        scheduler.add_request(_request(str(i), prompt))
    while len(scheduler.running) < n or any(
        r.num_computed_tokens < r.num_tokens - 1 for r in scheduler.running
    ):
        step(scheduler)
    return scheduler


@pytest.mark.parametrize("impl", ["vllm", "pagedkv"])
@pytest.mark.parametrize("running", [64, 256, 1024])
def test_scheduler_step(benchmark: Any, record: Any, impl: str, running: int) -> None:
    scheduler = _running(impl, running)
    # The previous test's scheduler (up to 130,000 vLLM block objects) must not be what the
    # collector walks during this one.
    gc.collect()
    benchmark.group = f"vllm scheduler step, {running} running"
    benchmark.pedantic(step, args=(scheduler,), rounds=30, warmup_rounds=3)
    out = step(scheduler)
    assert len(scheduler.running) == running
    assert out is not None
    record(benchmark, benchmark.group, impl)
