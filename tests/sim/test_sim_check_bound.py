"""Sizing check runs that stop once they cannot pass (`sim.check_bound`): the per-request hit
bounds of a trace hold in every run, and stopping early never changes a check's verdict."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pagedkv import BlockManager
from pagedkv.sim import SimResult, build_workload, read_trace, run_workload
from pagedkv.sim.check_bound import StopRule, trace_hit_bounds
from pagedkv.sim.requests import TRACE_BLOCK_TOKENS, Workload
from pagedkv.sim.sizing import Trial
from pagedkv.sim.trace import expected_hit_tokens

BUDGET = 2048


def small_trace(path: Path, *, requests: int, seed: int) -> Path:
    """Chats that grow turn by turn over shared documents: each request extends an earlier
    request's hash ids (or starts a document), with a partial last block."""
    rng = random.Random(seed)
    made: list[list[int]] = []
    fresh = 0
    t = 0
    rows = []
    for _ in range(requests):
        if made and rng.random() < 0.7:
            base = list(rng.choice(made))
            base = base[: rng.randrange(1, len(base) + 1)]
        else:
            base = []
        for _ in range(rng.randrange(1, 4)):
            base.append(fresh)
            fresh += 1
        made.append(base)
        t += int(rng.expovariate(1 / 30))
        rows.append(
            {
                "timestamp": t,
                "input_length": len(base) * TRACE_BLOCK_TOKENS - rng.randrange(TRACE_BLOCK_TOKENS),
                "output_length": rng.randrange(1, 40),
                "hash_ids": base,
            }
        )
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


class _Hits:
    """Observer: each first admission's hit, by request id (= the first sequence's id)."""

    def __init__(self) -> None:
        self.hits: dict[int, int] = {}

    def allocate(
        self, seq_id: int, token_ids: Any, hit_tokens: int, scheduled: int, **_: Any
    ) -> None:
        self.hits.setdefault(seq_id, hit_tokens)

    def __getattr__(self, name: str) -> Any:
        return lambda *a, **k: None


def _order(w: Workload) -> list[int]:
    return [r.request_id for r in sorted(w.requests, key=lambda r: (r.arrival_step, r.request_id))]


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("block_size", [16, 32, 48])
def test_bounds_sum_to_the_never_evicting_cache(tmp_path: Path, seed: int, block_size: int) -> None:
    w = read_trace(small_trace(tmp_path / "t.jsonl", requests=150, seed=seed))
    bounds = trace_hit_bounds(w, block_size)
    assert bounds is not None and len(bounds) == len(w.requests)
    by_arrival = [w.requests[i] for i in _order(w)]
    hits, _ = expected_hit_tokens(by_arrival, block_size)
    assert int(bounds.sum()) == hits > 0


@pytest.mark.parametrize("seed", [0, 3])
@pytest.mark.parametrize("num_blocks", [300, 900, 4000])
def test_no_request_hits_more_than_its_bound(tmp_path: Path, seed: int, num_blocks: int) -> None:
    w = read_trace(small_trace(tmp_path / "t.jsonl", requests=150, seed=seed))
    bounds = trace_hit_bounds(w, 16)
    assert bounds is not None
    watch = _Hits()
    res = run_workload(
        BlockManager(num_blocks, 16, num_cpu_blocks=0),
        w,
        max_num_batched_tokens=BUDGET,
        watch=watch,
    )
    got = np.asarray([watch.hits.get(i, 0) for i in _order(w)])
    if res.preemptions == 0:  # the bound's premise: first come, first served
        assert (got <= bounds).all()
        assert got.sum() > 0


def test_bounds_need_a_trace_in_arrival_order() -> None:
    assert trace_hit_bounds(build_workload("shared-prefix", 20, seed=0), 16) is None


def _verdict(w: Workload, n: int, target: float, stop: bool) -> tuple[bool, SimResult]:
    rule = StopRule.build(w, 16, target, aborts=False)
    res = run_workload(
        BlockManager(n, 16, num_cpu_blocks=64),
        w,
        max_num_batched_tokens=BUDGET,
        until=rule if stop else None,
    )
    trial = Trial(
        n,
        res.workload_hit_rate,
        res.preemptions,
        res.rejected_requests,
        target,
        stopped=rule.reason if res.stopped_early else "",
    )
    return trial.passed, res


def _workloads(tmp_path: Path) -> list[Workload]:
    return [
        read_trace(small_trace(tmp_path / "a.jsonl", requests=120, seed=5)),
        read_trace(small_trace(tmp_path / "b.jsonl", requests=120, seed=6)),
        build_workload("shared-prefix", 80, seed=1),
        build_workload("mixed", 60, seed=2, doc_tokens=2048),
    ]


def _unbounded(w: Workload) -> float:
    res = run_workload(BlockManager(1 << 16, 16), w, max_num_batched_tokens=BUDGET)
    return res.workload_hit_rate


def test_stopping_early_keeps_every_verdict(tmp_path: Path) -> None:
    stopped = 0
    for w in _workloads(tmp_path):
        top = _unbounded(w)
        for frac in (0.8, 0.95, 1.0):
            target = frac * top
            for n in (200, 500, 1000, 2000, 4000):
                full, res_full = _verdict(w, n, target, stop=False)
                early, res = _verdict(w, n, target, stop=True)
                assert early == full, (w.name, n, target)
                assert not res_full.stopped_early
                if res.stopped_early:
                    stopped += 1
                    assert res.steps < res_full.steps or res.steps == res_full.steps
    assert stopped > 0  # the rule did stop runs, and they all failed as the full runs did


def test_a_trace_check_stops_on_the_hits_it_can_no_longer_reach(tmp_path: Path) -> None:
    """Without preemption, a run below the target stops early on the bound alone, well before
    the end; one that holds everything runs to the end and passes."""
    w = read_trace(small_trace(tmp_path / "t.jsonl", requests=200, seed=7))
    target = 0.99 * _unbounded(w)
    passed, res = _verdict(w, 1 << 14, target, stop=True)
    assert passed and not res.stopped_early
    for n in (400, 800, 1200):
        rule = StopRule.build(w, 16, target, aborts=False)
        res = run_workload(
            BlockManager(n, 16, num_cpu_blocks=64), w, max_num_batched_tokens=BUDGET, until=rule
        )
        if res.preemptions == 0 and res.stopped_early:
            assert rule.reason.startswith("hit rate at most")
            assert res.finished_requests < res.requests
            return
    raise AssertionError("no size stopped on the bound without preemption")


def test_the_trace_bound_follows_each_requests_tokens_per_id() -> None:
    """Bailian's ids cover 16 tokens, not Mooncake's 512: the second prompt shares two
    16-token blocks with the first, so it can hit 32 tokens and no more."""
    from pagedkv.sim.requests import Request

    def req(rid: int, ids: list[int]) -> Request:
        return Request(
            rid,
            64,
            2,
            arrival_step=rid,
            kind="trace",
            hash_ids=np.asarray(ids, dtype=np.int64),
            hash_block_tokens=16,
        )

    w = Workload((req(0, [1, 2, 3, 4]), req(1, [1, 2, 9, 9])), 0)
    bounds = trace_hit_bounds(w, 16)
    assert bounds is not None and bounds.tolist() == [0, 32]
