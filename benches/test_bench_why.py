"""The cost of `simulate --why` (`sim.why`): the built-in mixed workload (500 requests, the
command's defaults: 4096 blocks of 16, 512 CPU blocks, 2048 tokens per step) replayed
without and with the miss attribution, side by side in one run.

The attribution turns the manager's KV events on, drains them every step and before every
allocation, and hashes the missed part of each prompt again; the replay's own figures are
the same either way (checked).
"""

from __future__ import annotations

from typing import Any

import pytest

from pagedkv import BlockManager
from pagedkv.sim import build_workload, run_workload
from pagedkv.sim.why import MissWhy

WORKLOAD = build_workload("mixed", 500, seed=0)
BUDGET = 2048  # tokens per step (chunked prefill)


def _plain() -> tuple[int, int]:
    m = BlockManager(4096, 16, num_cpu_blocks=512)
    r = run_workload(m, WORKLOAD, max_num_batched_tokens=BUDGET)
    return r.prompt_tokens, r.prefix_hit_tokens


def _why() -> tuple[int, int]:
    m = BlockManager(4096, 16, num_cpu_blocks=512, enable_kv_events=True)
    why = MissWhy()
    r = run_workload(
        why.watch(m),
        WORKLOAD,
        watch=why,
        before_step=why.before_step,
        max_num_batched_tokens=BUDGET,
    )
    assert sum(t.misses for t in why.tenants.values()) == r.prompt_tokens - r.prefix_hit_tokens
    return r.prompt_tokens, r.prefix_hit_tokens


@pytest.mark.parametrize("mode", ["plain", "why"])
def test_replay_with_and_without_why(benchmark: Any, mode: str) -> None:
    benchmark.group = "simulate --why: mixed workload, 500 requests"
    got = benchmark.pedantic(_plain if mode == "plain" else _why, rounds=5, iterations=1)
    assert got == _plain()
