"""`sim.hit_limits`: which KV-cache group cut a hybrid model's prefix hits.

A hand-made cache where the window group lost the last block of a cached prompt: the probe
must see that the full-attention group had the whole prefix, that the window group alone
cut one block, and agree with the manager's hit. Then every hybrid preset on a small
workload: the probe's copy of the cache agrees with the manager on every allocation, and
its totals are the run's workload figures.
"""

from __future__ import annotations

import numpy as np
import pytest

from pagedkv.config import BlockManagerConfig
from pagedkv.groups import KVCacheGroup
from pagedkv.manager import BlockManager
from pagedkv.sim.hit_limits import HitLimitProbe, longest_served, runs_of
from pagedkv.sim.model_run import compare
from pagedkv.sim.models import get_model
from pagedkv.sim.workloads import build_workload

FULL = KVCacheGroup("full")
WINDOW = KVCacheGroup("sliding_window", window=8)


def test_the_window_group_that_lost_a_block_is_named() -> None:
    groups = [FULL, WINDOW]
    m = BlockManager(64, 4, enable_kv_events=True, groups=groups)
    probe = HitLimitProbe(m, groups)
    tokens = np.arange(25, dtype=np.uint32)  # 6 full blocks; the hit can reach 24 tokens
    assert probe.allocate(1, tokens) == 0
    last = m.block_table(1, group=1)[5]  # the window group's block of tokens 20..23
    assert last != 0
    m.free(1)
    assert m.evict_blocks([last]) == 1
    hit = probe.allocate(2, tokens)
    # A hit of 6 blocks needs the window's blocks 4 and 5; 5 is gone, so 5 blocks (the
    # window's blocks 3 and 4 are there), while the full group had all 6.
    assert hit == 20
    f = probe.figures()
    assert f["disagreements"] == 0
    assert f["prompt_tokens"] == 50 and f["hit_tokens"] == 20
    assert f["full_hit_tokens"] == 24
    assert f["cut_tokens"] == [0, 4]


def test_a_recompute_and_a_forks_allocation_are_left_out() -> None:
    groups = [FULL, WINDOW]
    m = BlockManager(64, 4, enable_kv_events=True, groups=groups)
    probe = HitLimitProbe(m, groups)
    tokens = np.arange(13, dtype=np.uint32)
    probe.allocate(1, tokens)
    probe.fork(1, 2)
    m.free(1)
    m.free(2)
    probe.allocate(1, tokens)  # seq 1 again: a recompute
    probe.allocate(2, tokens)  # the fork's child again: a recompute too
    assert probe.figures()["prompt_tokens"] == 13


def test_the_window_rule() -> None:
    run = runs_of([True, True, False, True, True])
    assert run == [1, 2, 0, 1, 2]
    assert longest_served(WINDOW, run, 5, 4) == 5  # needs blocks 3 and 4
    assert longest_served(WINDOW, runs_of([True, True, True, False, True]), 5, 4) == 3


@pytest.mark.parametrize(
    "name", ["gemma-3-12b", "gpt-oss-20b", "llama-4-scout", "qwen3-next-80b-a3b"]
)
def test_the_probe_agrees_with_every_hybrid_preset(name: str) -> None:
    workload = build_workload("mixed", 30, seed=0, doc_tokens=2048)
    config = BlockManagerConfig(num_blocks=256, block_size=16, num_cpu_blocks=0)
    schedule = {"max_batch": 256, "max_num_batched_tokens": 2048}
    section, runs = compare(get_model(name), workload, config, schedule)
    m = section["model"]
    limits = m["hit_limits"]
    assert runs[0]["recomputed_tokens"] > 0  # preemptions recomputed: the probe leaves them out
    assert limits["disagreements"] == 0
    # The probe counts the workload's prompts as the scheduler does.
    assert (
        limits["prompt_tokens"] == runs[0]["workload_prompt_tokens"] == m["workload_prompt_tokens"]
    )
    assert limits["hit_tokens"] == m["workload_hit_tokens"]
    # Full-attention groups cut nothing; together the others cut at least what each cut.
    for g, cut in zip(m["groups"], limits["cut_tokens"], strict=True):
        if g["kind"] == "full":
            assert cut == 0
        assert cut <= limits["full_hit_tokens"] - limits["hit_tokens"]
    assert "hit_limits" not in section["all_full"]
