"""The CPU engine's window model and scenarios (testing/vllm_engine/offline.py) as vLLM
scheduler programs: its KV-cache layout (a full and a window-64 group, block 32, 48 blocks,
256-token steps) and its request streams, replayed under vLLM's scheduler without the
engine (`vllm_batches.replay`). Hits do not depend on the tokens generated: later prompts
share only prompt blocks."""

from __future__ import annotations

from typing import Any

from vllm_batches import Replay, replay
from vllm_engine import prompts
from vllm_engine.duplicate_rule import duplicate_rule
from vllm_objects import full_spec, window_spec

BLOCK = prompts.BLOCK
CONFIG: dict[str, Any] = {
    "num_blocks": 48,
    "block_size": BLOCK,
    "max_num_seqs": 32,
    "max_num_batched_tokens": 256,
    "max_model_len": 1024,
    "specs": [full_spec(BLOCK), window_spec(64, BLOCK)],
}
DENSE = None  # KVCacheConfig's own default: every full window block is hashed
ENGINE_DEFAULT = 0  # CacheConfig's default, what vLLM's engine runs with


def window_shared() -> tuple[list[list[list[int]]], int]:
    batch = prompts.shared_prefixes(seed=1, groups=3, per_group=4, prefix=3 * BLOCK)
    return [batch, batch], 12


def window_preempt() -> tuple[list[list[list[int]]], int]:
    return [prompts.distinct(seed=2, count=40, lo=80, hi=120)], 32


SCENARIOS = {"window_shared": window_shared, "window_preempt": window_preempt}


def hits(which: str, scenario: str, retention: int | None, *, dedup: bool = False) -> Replay:
    """`scenario` under `which` ("vllm" or "pagedkv") with `retention` as the
    `prefix_cache_retention_interval`; `dedup`: vLLM's manager with pagedkv's rule that a
    block computed twice is cached once."""
    batches, max_tokens = SCENARIOS[scenario]()
    if not dedup:
        return replay(which, batches, max_tokens, retention_interval=retention, **CONFIG)
    with duplicate_rule():
        return replay(which, batches, max_tokens, retention_interval=retention, **CONFIG)


__all__ = ["CONFIG", "DENSE", "ENGINE_DEFAULT", "SCENARIOS", "hits"]
