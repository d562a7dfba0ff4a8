"""`mrc_fast.FastMRCRecorder` (the stream in Rust) against `mrc.MRCRecorder` (the Python
reference): both watch the same replay, and their curves must be identical, threshold for
threshold, exact or sampled, on every workload shape (chats, forks, beams, salts, long
documents, speculative decoding), under preemption by swapping and by recomputing, and on a
hash-id trace. Sampling keeps a key by its top bits, so equal sampled curves also mean equal
keys."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pagedkv import BlockManager
from pagedkv._core import MrcStream, trace_tokens
from pagedkv.errors import InvalidArgumentError, UnknownSequenceError
from pagedkv.sim import WORKLOADS, build_workload, read_trace, run_workload
from pagedkv.sim.mrc import MRCRecorder
from pagedkv.sim.mrc_curve import MissRatioCurve
from pagedkv.sim.mrc_fast import FastMRCRecorder
from pagedkv.sim.requests import TRACE_BLOCK_TOKENS, Request, Workload, hash_id_tokens

BUDGET = 2048


class _Both:
    """One observer that tells every recorder of `recorders` each call."""

    def __init__(self, recorders: list[Any]) -> None:
        self.recorders = recorders

    def __getattr__(self, name: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> None:
            for r in self.recorders:
                getattr(r, name)(*args, **kwargs)

        return call


def _same(a: MissRatioCurve, b: MissRatioCurve) -> None:
    assert a.block_size == b.block_size
    assert a.sample_rate == b.sample_rate
    assert a.prompt_tokens == b.prompt_tokens
    assert a.lookups == b.lookups
    assert a.touches == b.touches
    assert a.distinct_blocks == b.distinct_blocks
    assert a.thresholds.dtype == b.thresholds.dtype == np.float64
    np.testing.assert_array_equal(a.thresholds, b.thresholds)


def _replay(workload: Workload, rates: tuple[float, ...], **kw: Any) -> list[Any]:
    block_size = kw.pop("block_size", 16)
    num_blocks = kw.pop("num_blocks", 4096)
    recorders: list[Any] = []
    for rate in rates:
        for bs in (block_size, 2 * block_size):
            recorders += [MRCRecorder(bs, rate), FastMRCRecorder(bs, rate)]
    result = run_workload(
        BlockManager(num_blocks, block_size, num_cpu_blocks=kw.pop("num_cpu_blocks", 512)),
        workload,
        max_num_batched_tokens=kw.pop("budget", BUDGET),
        watch=_Both(recorders),
        **kw,
    )
    for ref, fast in zip(recorders[::2], recorders[1::2], strict=True):
        _same(ref.curve(), fast.curve())
    return [result, recorders]


@pytest.mark.parametrize("kind", WORKLOADS)
def test_every_workload_gives_the_reference_curve(kind: str) -> None:
    workload = build_workload(kind, 60, seed=3, doc_tokens=2048)
    result, recorders = _replay(workload, (1.0, 0.5, 0.125))
    curve = recorders[1].curve()
    assert curve.lookups > 0 and curve.touches > 0
    if kind != "beam":  # 60 beam requests share no prefix: no hit to compare
        assert len(curve.thresholds) > 0
    assert result.finished_requests == result.requests


def test_speculative_decoding_gives_the_reference_curve() -> None:
    workload = build_workload("chat", 60, seed=5)
    result, _ = _replay(workload, (1.0, 0.25), spec_tokens=3)
    assert result.accepted_drafts > 0  # drafts were appended through `append`


@pytest.mark.parametrize("cpu_blocks", [512, 0])
def test_preemption_gives_the_reference_curve(cpu_blocks: int) -> None:
    """A pool too small for the load: sequences are swapped out and in (512 CPU blocks) or
    freed and allocated again (0: recomputed, touched but not looked up again)."""
    workload = build_workload("mixed", 80, seed=7, arrival_rate=0)
    result, recorders = _replay(
        workload, (1.0, 0.5), num_blocks=160, num_cpu_blocks=cpu_blocks, budget=512
    )
    assert result.preemptions > 0
    if cpu_blocks:
        assert result.swap_ins > 0
    else:
        assert result.recomputed_tokens > 0
    # A rejected request is never allocated; a recomputed one is looked up once only.
    assert recorders[1].curve().lookups == result.requests - result.rejected_requests


def test_a_shared_prefix_trace_gives_the_reference_curve(tmp_path: Path) -> None:
    """Mooncake-style hash ids: prompts reading prefixes of a few shared documents."""
    rng = random.Random(11)
    docs = [[d * 1000 + j for j in range(rng.randrange(4, 30))] for d in range(6)]
    rows = []
    for i in range(150):
        ids = rng.choice(docs)
        ids = [*ids[: rng.randrange(1, len(ids) + 1)], 10**6 + i]
        rows.append(
            {
                "timestamp": 30 * i,
                "input_length": len(ids) * TRACE_BLOCK_TOKENS - rng.randrange(100),
                "output_length": rng.randrange(1, 40),
                "hash_ids": ids,
            }
        )
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    result, recorders = _replay(read_trace(path), (1.0, 0.5), num_blocks=20000)
    assert recorders[1].curve().unbounded_hit_rate > 0.2
    assert result.finished_requests == 150


def test_bad_calls_raise_and_change_nothing() -> None:
    s = MrcStream(4, 1 << 24)
    s.allocate(1, np.arange(10, dtype=np.uint32), 10, 7)
    before = len(s)
    with pytest.raises(UnknownSequenceError):
        s.decode([1, 2], [5, 6])  # 2 is unknown: nothing is appended to 1 either
    with pytest.raises(UnknownSequenceError):
        s.free(9)
    with pytest.raises(UnknownSequenceError):
        s.fork(9, 10)
    with pytest.raises(InvalidArgumentError, match="2 seq_ids but 1 token_ids"):
        s.decode([1, 1], [5])
    with pytest.raises(InvalidArgumentError, match="scheduled"):
        s.allocate(3, [1, 2, 3], 4, 0)
    with pytest.raises(InvalidArgumentError, match="block_size"):
        MrcStream(0, 1)
    with pytest.raises(InvalidArgumentError, match="sample_threshold"):
        MrcStream(16, 0)
    with pytest.raises(InvalidArgumentError, match="sample_rate"):
        s.curve(0.0)
    assert len(s) == before
    # The first decode above changed nothing: two more tokens fill block 3 (tokens 8..11).
    s.decode([1], [5])
    assert len(s) == before
    s.decode([1], [6])
    assert len(s) == before + 1
    with pytest.raises(ValueError, match="sample_rate"):
        FastMRCRecorder(16, 1.5)


@pytest.mark.parametrize("block_tokens", [16, 512])
def test_trace_tokens_equal_the_numpy_reference(block_tokens: int) -> None:
    """`Request.prompt` builds a trace prompt's tokens in Rust; `hash_id_tokens` (numpy) is
    the definition: equal for every length, short of, at and past the ids' tokens."""
    rng = np.random.default_rng(4)
    for _ in range(30):
        ids = rng.integers(0, 2**40, rng.integers(1, 12), dtype=np.int64)
        full = len(ids) * block_tokens
        for length in (1, full - 1, full, full + 5, int(rng.integers(1, full + 1))):
            want = hash_id_tokens(ids, length, block_tokens)
            got = trace_tokens(ids, length, block_tokens)
            assert got.dtype == np.uint32
            np.testing.assert_array_equal(got, want)
    r = Request(0, 700, 1, hash_ids=np.array([5, 6], dtype=np.int64), hash_block_tokens=512)
    np.testing.assert_array_equal(r.prompt, hash_id_tokens(np.array([5, 6]), 700, 512))
    with pytest.raises(InvalidArgumentError, match="block_tokens"):
        trace_tokens([1], 4, 0)
