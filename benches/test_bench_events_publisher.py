"""The hot path with the KV-event publisher on and off, side by side (pytest-benchmark groups),
and the cost of a snapshot of the described set.

"off": a manager without events. "events": events enabled, drained between rounds (untimed):
the cost of recording them. "on": events enabled and a `pagedkv.kv_events.Publisher`
draining them on its thread, encoding vLLM's payloads and sending them on a loopback PUB
socket (with a replay buffer). The manager's calls only append to its event queue; what the
publisher thread costs them is the GIL and cache traffic it takes while they run.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import pytest

from pagedkv import BlockManager
from pagedkv.kv_events import Publisher

B = 16
LOOP = "tcp://127.0.0.1:0"
MODES = ["off", "events", "on"]


@pytest.fixture(params=MODES)
def mode(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@contextmanager
def _manager(mode: str, num_blocks: int) -> Iterator[BlockManager]:
    m = BlockManager(num_blocks, B, enable_kv_events=mode != "off")
    pub = Publisher(m, endpoint=LOOP, replay_endpoint=LOOP, heartbeat=1.0) if mode == "on" else None
    try:
        yield m
    finally:
        if pub is not None:
            pub.close()
            assert pub.events > 0


def test_allocate_free_32_prompts(benchmark: Any, mode: str, record: Any) -> None:
    """32 allocations of new 1,041-token prompts (65 blocks registered each, and as many
    cached blocks evicted once the pool is warm), then their frees."""
    group = "events publisher: allocate+free 32 x 1041 new tokens"
    benchmark.group = group
    rng = np.random.default_rng(5)
    sets = [[rng.integers(0, 2**31, size=65 * B + 1).tolist() for _ in range(32)] for _ in range(8)]
    ids = list(range(32))
    state = {"round": 0}
    with _manager(mode, 3 * 32 * 66) as m:

        def run() -> None:
            prompts = sets[state["round"] % len(sets)]
            state["round"] += 1
            for i in ids:
                assert m.allocate(i, prompts[i]) is not None
            m.free_batch(ids)

        def setup() -> None:
            if mode == "events":
                m.drain_events()  # nobody else drains them

        benchmark.pedantic(run, setup=setup, rounds=200, warmup_rounds=4)
    record(benchmark, group, mode)


def test_decode_step_256(benchmark: Any, mode: str, record: Any) -> None:
    """One append_batch of one token for each of 256 running sequences (about 16 blocks fill
    and register per step)."""
    group = "events publisher: decode-step 256 seqs"
    benchmark.group = group
    n = 256
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, 2**31, size=100 + i).tolist() for i in range(n)]
    ids = np.arange(n, dtype=np.int64)
    toks = np.full(n, 7, dtype=np.int64)
    with _manager(mode, 50_000) as m:
        state = {"rounds": 64}

        def setup() -> None:
            if state["rounds"] == 64:
                if len(m):
                    m.free_batch(ids)
                for i in range(n):
                    m.allocate(i, prompts[i])
                state["rounds"] = 0
            state["rounds"] += 1
            if mode == "events":
                m.drain_events()

        def run() -> None:
            m.append_batch(ids, toks)

        benchmark.pedantic(run, setup=setup, rounds=1000, warmup_rounds=2)
    record(benchmark, group, mode)


@pytest.mark.parametrize("cached", [4_096, 65_536])
def test_kv_event_snapshot(benchmark: Any, cached: int) -> None:
    """`kv_event_snapshot()` of a cache of `cached` blocks in chains of 64 (what a publisher
    takes on an overflow or at its start), converted to Python events."""
    benchmark.group = "events: kv_event_snapshot"
    m = BlockManager(cached + 64, B, enable_kv_events=True)
    rng = np.random.default_rng(11)
    for i in range(cached // 64):
        assert m.allocate(i, rng.integers(0, 2**31, size=64 * B).tolist()) is not None
        m.free(i)
    m.drain_events()
    got = benchmark.pedantic(m.kv_event_snapshot, rounds=5, warmup_rounds=1)
    assert len(got) == cached
