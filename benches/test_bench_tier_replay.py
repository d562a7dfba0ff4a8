"""The simulator's tier run against the same replay without tiers (docs/tiers.md, "In the
simulator"): the claim is that a tiered replay costs at most a few times the untiered one,
and the tiers' part a few microseconds per demoted block when counting.

Three runs of one evicting workload (the first `LIMIT` requests of the shared Mooncake trace
where `../shared/traces/` has it, else the built-in mixed workload), each in the group
"tier replay": `none` (no tiers), `count` (count-only host tier) and `real` (real bytes
through a raw host tier: the data pool's KV written every step, demoted and loaded). Each
round's `extra_info` holds the blocks demoted and promoted; the per-block cost is
`(mean of count - mean of none) / blocks_demoted`. Not a timed test: `--benchmark-disable`
runs each once as a test of the figures (count and real agree).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from pagedkv import BlockManager
from pagedkv.sim import Workload, build_workload, read_trace, run_workload
from pagedkv.sim.kv_bytes import from_model
from pagedkv.sim.tier_run import TierDriver, TierOptions

SHARED_TRACE = (
    Path(__file__).resolve().parents[2] / "shared" / "traces" / "mooncake_synthetic_trace.jsonl"
)
LIMIT = 300
B = 16


def _workload() -> tuple[Workload, int]:
    """(workload, GPU blocks): a cache that evicts throughout."""
    if SHARED_TRACE.exists():
        return read_trace(SHARED_TRACE, limit=LIMIT), 8192
    return build_workload("mixed", 300, seed=0), 1024


@pytest.fixture(scope="module")
def workload() -> tuple[Workload, int]:
    return _workload()


_FIGURES: dict[str, tuple[int, int, int]] = {}


@pytest.mark.parametrize("data", ["none", "count", "real"])
def test_tier_replay(benchmark: Any, workload: tuple[Workload, int], data: str) -> None:
    benchmark.group = "tier replay"
    w, blocks = workload
    kv = from_model("llama-3-8b")

    def once() -> tuple[int, int, int]:
        m = BlockManager(blocks, B, record_evictions=data != "none")
        driver = None
        if data != "none":
            options = TierOptions(kv=kv, host_bytes=64 << 30, data=data)
            driver = TierDriver(m, options, num_cpu_blocks=0, hash_algo="sha256")
        result = run_workload(m, w, tiers=driver)
        if driver is None:
            return result.prefix_hit_tokens, 0, 0
        f = driver.close()
        return result.prefix_hit_tokens, f["blocks_demoted"], f["blocks_promoted"]

    rounds = 1 if data == "real" else 3  # a real-bytes round takes minutes here
    hits, demoted, promoted = benchmark.pedantic(once, rounds=rounds, iterations=1)
    benchmark.extra_info.update(
        {"prefix_hit_tokens": hits, "blocks_demoted": demoted, "blocks_promoted": promoted}
    )
    _FIGURES[data] = (hits, demoted, promoted)
    if data != "none":
        assert demoted > 0, "the workload must evict"
    if "count" in _FIGURES and "real" in _FIGURES:
        assert _FIGURES["count"] == _FIGURES["real"]
