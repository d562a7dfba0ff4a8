"""`simulate --mrc`: the miss-ratio curve of one replay against full simulations.

Three claims, each with its own test:

- exact at the top: with a pool that never evicts, the curve's unbounded hit rate is the
  replay's own hit count, token for token (every workload shape: chats that hit earlier
  replies, forks, beams, salts, speculative decoding);
- close in between: at sizes where a full simulation runs without preemption, its hit rate is
  within `TOLERANCE` of the curve's (the manager pins running sequences' blocks, an LRU cache
  does not; measured differences are below 0.5 percentage points);
- sampling (SHARDS) stays within `SHARDS_TOLERANCE` of the exact curve.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pagedkv import BlockManager
from pagedkv.sim import WORKLOADS, SimResult, build_workload, read_trace, run_workload
from pagedkv.sim.block_keys import chain, contents, root
from pagedkv.sim.mrc import MRCRecorder
from pagedkv.sim.mrc_curve import MissRatioCurve
from pagedkv.sim.requests import TRACE_BLOCK_TOKENS, Workload

TOLERANCE = 0.01  # absolute hit rate, curve against a full simulation without preemption
SHARDS_TOLERANCE = 0.02  # absolute hit rate, a sampled curve against the exact one
BUDGET = 2048  # chunked prefill, as the command schedules


def synthetic_trace(path: Path, *, requests: int, documents: int, seed: int = 0) -> Path:
    """Requests reading a prefix of one of `documents` shared hash-id chains, plus up to two
    ids of their own; partial last blocks; Poisson arrivals, 40 ms apart on average."""
    rng = random.Random(seed)
    chains = [[d * 1000 + j for j in range(rng.randrange(4, 40))] for d in range(documents)]
    own = 10**6
    t = 0
    rows = []
    for _ in range(requests):
        chain_ids = chains[rng.randrange(documents)]
        ids = chain_ids[: rng.randrange(1, len(chain_ids) + 1)]
        for _ in range(rng.randrange(3)):
            ids = [*ids, own]
            own += 1
        t += int(rng.expovariate(1 / 40))
        rows.append(
            {
                "timestamp": t,
                "input_length": len(ids) * TRACE_BLOCK_TOKENS - rng.randrange(TRACE_BLOCK_TOKENS),
                "output_length": rng.randrange(1, 60),
                "hash_ids": ids,
            }
        )
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def trace(tmp_path_factory: pytest.TempPathFactory) -> Workload:
    path = tmp_path_factory.mktemp("mrc") / "synthetic.jsonl"
    return read_trace(synthetic_trace(path, requests=700, documents=150))


def _curve(
    workload: Workload, block_size: int, num_blocks: int, rate: float = 1.0, **kw: Any
) -> tuple[MissRatioCurve, SimResult]:
    rec = MRCRecorder(block_size, rate)
    result = run_workload(
        BlockManager(num_blocks, block_size),
        workload,
        max_num_batched_tokens=BUDGET,
        watch=rec,
        **kw,
    )
    return rec.curve(), result


# ------------------------------------------------------------------ block keys


def test_keys_follow_the_prefix_cache_rules() -> None:
    rng = np.random.default_rng(0)
    a = rng.integers(0, 32_000, size=160, dtype=np.uint32)
    b = a.copy()
    b[100] += 1  # block 6 of 16 tokens differs, and so does every block after it
    ka, _ = chain(root(None, None), contents(a, 16))
    kb, _ = chain(root(None, None), contents(b, 16))
    assert (ka[:6] == kb[:6]).all() and not (ka[6:] == kb[6:]).any()
    ks, _ = chain(root("tenant", None), contents(a, 16))
    kl, _ = chain(root(None, 3), contents(a, 16))
    assert not set(ks.tolist()) & set(ka.tolist()) and not set(kl.tolist()) & set(ka.tolist())
    # Chaining block by block gives the keys of chaining the whole prompt.
    head, state = chain(root(None, None), contents(a[:64], 16))
    tail, _ = chain(state, contents(a[64:], 16))
    assert np.array_equal(np.concatenate([head, tail]), ka)
    assert len(set(ka.tolist())) == len(ka)


# ------------------------------------------------------------------ exact at the top


@pytest.mark.slow
@pytest.mark.parametrize("name", WORKLOADS)
@pytest.mark.parametrize("spec_tokens", [0, 3])
def test_unbounded_curve_is_the_replays_hit_count(name: str, spec_tokens: int) -> None:
    w = build_workload(name, 150, seed=3)
    curve, result = _curve(w, 16, 200_000, spec_tokens=spec_tokens, check=True)
    assert result.final_stats is not None
    assert result.final_stats.evictions == 0 and result.preemptions == 0
    hits = curve.unbounded_hit_rate * curve.prompt_tokens
    assert curve.prompt_tokens == result.prompt_tokens
    assert round(hits) == result.prefix_hit_tokens
    assert curve.lookups == len(w.requests)


@pytest.mark.parametrize("block_size", [16, 64])
def test_unbounded_curve_on_a_trace(trace: Workload, block_size: int) -> None:
    curve, result = _curve(trace, block_size, 400_000)
    assert result.final_stats is not None
    assert result.final_stats.evictions == 0
    assert round(curve.unbounded_hit_rate * curve.prompt_tokens) == result.prefix_hit_tokens
    assert curve.unbounded_hit_rate > 0.3


# ------------------------------------------------------------------ close in between


@pytest.mark.slow
@pytest.mark.parametrize("block_size", [16, 32])
def test_curve_agrees_with_full_simulations(trace: Workload, block_size: int) -> None:
    curve, unbounded = _curve(trace, block_size, 400_000)
    top = curve.largest_useful_size
    # From just above the running set's peak (the blocks no LRU cache would evict) to the top.
    held = max(unbounded.series.usage) * 400_000
    sizes = [int(1.5 * held), int(3 * held), top // 2, int(0.9 * top)]
    compared = 0
    for n in sizes:
        result = run_workload(
            BlockManager(n, block_size, num_cpu_blocks=512), trace, max_num_batched_tokens=BUDGET
        )
        assert result.preemptions == 0, n  # the sizes compared are free of pressure
        assert result.final_stats is not None and result.final_stats.evictions > 0
        assert abs(result.hit_rate - curve.hit_rate(n)) <= TOLERANCE, (n, result.hit_rate)
        compared += 1
    assert compared == 4
    # And the curve does rise across them: a flat curve would pass the check above trivially.
    assert curve.hit_rate(sizes[-1]) - curve.hit_rate(sizes[0]) > 0.2


def test_sampled_curve_stays_near_the_exact_one(trace: Workload) -> None:
    exact, _ = _curve(trace, 16, 400_000)
    for rate in (0.5, 0.25):
        sampled, _ = _curve(trace, 16, 400_000, rate=rate)
        assert not sampled.exact and "SHARDS" in sampled.method()
        assert sampled.touches < exact.touches * (rate + 0.1)
        for share in (0.1, 0.3, 0.6, 1.0):
            n = int(exact.largest_useful_size * share)
            assert abs(sampled.hit_rate(n) - exact.hit_rate(n)) <= SHARDS_TOLERANCE, (rate, n)


# ------------------------------------------------------------------ the curve's own answers


def test_smallest_size_and_points(trace: Workload) -> None:
    curve, _ = _curve(trace, 16, 400_000)
    top = curve.unbounded_hit_rate
    for target in (0.1 * top, 0.5 * top, top):
        n = curve.smallest_size(target)
        assert n is not None
        assert curve.hit_rate(n) >= target - 1e-12 > curve.hit_rate(n - 1)
    assert curve.smallest_size(top + 0.01) is None
    pts = curve.points()
    sizes = [p[0] for p in pts]
    rates = [p[1] for p in pts]
    assert sizes == sorted(set(sizes)) and all(isinstance(s, int) for s in sizes)
    assert rates == sorted(rates)
    assert sizes[-1] == curve.largest_useful_size and rates[-1] == pytest.approx(top)
