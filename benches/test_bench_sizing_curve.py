"""Issue 35: a trace's miss-ratio curve two ways, side by side in one run (pytest-benchmark).

On the shared Mooncake trace (or one of its shape, `tests/support/mooncake_trace.py`), in
blocks of 512 tokens (the trace's own):

- `cache replay`: `mrc_blocks.block_curve`, the pure cache replay of the hash ids at block
  granularity (what `simulate --mrc-only` now does on such a trace);
- `scheduled replay`: the first `SCHEDULED` requests through the scheduler and the manager
  with `mrc_fast.FastMRCRecorder` (what it did before, and what the full answer still does),
  the trace's reading not timed.

The kvcache-simulator comparison, a separate install, is `benches/sizing_vs_kvsim.py`.
"""

from __future__ import annotations

from typing import Any

import pytest

from mooncake_trace import trace_path  # tests/support, on pytest's path
from pagedkv import BlockManager
from pagedkv.sim.mrc_blocks import block_curve, block_replay
from pagedkv.sim.mrc_fast import FastMRCRecorder
from pagedkv.sim.scheduler import run_workload
from pagedkv.sim.trace import read_trace

B = 512
SCHEDULED = 1000  # requests of the scheduled replay (the whole trace takes seconds a round)


@pytest.fixture(scope="module")
def workload(tmp_path_factory: pytest.TempPathFactory) -> Any:
    path = trace_path(tmp_path_factory.mktemp("trace"))
    return read_trace(path, limit=None, ms_per_step=20.0, trace_format="auto")


def test_cache_replay_curve(benchmark: Any, workload: Any) -> None:
    benchmark.group = "sizing curve, blocks of 512"
    curve = benchmark(lambda: block_curve(workload, B))
    # The curve's hit count at a size is LRU's replayed at that size.
    n = curve.largest_useful_size // 4
    (hits,) = block_replay(workload, B).hits([n], "lru", 0)
    assert hits * B == round(curve.hit_rate(n) * curve.prompt_tokens)


def test_scheduled_replay_curve(benchmark: Any, workload: Any) -> None:
    benchmark.group = "sizing curve, blocks of 512"
    from pagedkv.sim.requests import Workload

    w = Workload(workload.requests[:SCHEDULED], 0, name="trace", ms_per_step=20.0)

    def run() -> Any:
        rec = FastMRCRecorder(B)
        run_workload(BlockManager(65536, B), w, max_num_batched_tokens=2048, watch=rec)
        return rec.curve()

    curve = benchmark.pedantic(run, rounds=3, iterations=1)
    assert curve.lookups == len(w.requests) and curve.unbounded_hit_rate > 0
