"""Mooncake-format traces: reading, pseudo-tokens, and the hit rate checked against a count
made from the hash ids alone (a tiny trace written here; the shared trace where present)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from pagedkv import BlockManager
from pagedkv.sim import (
    TRACE_BLOCK_TOKENS,
    bind_trace,
    expected_hit_tokens,
    read_trace,
    run_workload,
    same_result,
)
from pagedkv_reference import ReferenceBlockManager

# (timestamp ms, hash ids, output length): every prompt is whole 512-token blocks, and none
# repeats an earlier prompt entirely, so with a cache that never evicts the hit rate is exactly
# the fraction of blocks whose id prefix was seen before: 6 of 15.
TINY = [
    (0, [1, 2], 3),
    (30, [1, 2, 3], 2),
    (50, [1, 4], 1),
    (100, [5, 6, 7], 4),
    (100, [5, 8], 0),
    (2000, [1, 2, 9], 2),
]


def _write(path: Path, rows: list[dict[str, object]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


@pytest.fixture
def tiny_trace(tmp_path: Path) -> Path:
    rows: list[dict[str, object]] = [
        {
            "timestamp": ts,
            "input_length": len(ids) * TRACE_BLOCK_TOKENS,
            "output_length": out,
            "hash_ids": ids,
        }
        for ts, ids, out in TINY
    ]
    return _write(tmp_path / "tiny.jsonl", rows)


def _repeated_block_fraction() -> float:
    seen: set[tuple[int, ...]] = set()
    repeated = total = 0
    for _, ids, _ in TINY:
        for j in range(len(ids)):
            repeated += tuple(ids[: j + 1]) in seen
            seen.add(tuple(ids[: j + 1]))
            total += 1
    return repeated / total


def test_read_trace(tiny_trace: Path) -> None:
    w = read_trace(tiny_trace, ms_per_step=20)
    assert [r.arrival_step for r in w.requests] == [0, 1, 2, 5, 5, 100]
    assert [r.max_new_tokens for r in w.requests] == [3, 2, 1, 4, 1, 2]  # 0 decodes one
    assert w.prompt_tokens == 15 * TRACE_BLOCK_TOKENS
    a, b, c = (r.prompt for r in w.requests[:3])
    assert a.dtype == np.uint32 and len(b) == 3 * TRACE_BLOCK_TOKENS
    assert int(a.max()) < 2**31
    assert np.array_equal(b[: len(a)], a)  # same ids at the same positions: same tokens
    assert np.array_equal(c[:512], a[:512]) and not np.array_equal(c[512:], a[512:])
    assert len(set(a[:512].tolist())) > 500  # pseudo-tokens vary within a block
    assert len(read_trace(tiny_trace, limit=3).requests) == 3


@pytest.mark.parametrize("block_size", [16, 64, 512])
def test_hit_rate_equals_repeated_block_fraction(tiny_trace: Path, block_size: int) -> None:
    w = read_trace(tiny_trace)
    m = BlockManager(4096, block_size)
    result = run_workload(m, w, check=True)
    assert m.stats().evictions == 0
    assert result.hit_rate == pytest.approx(_repeated_block_fraction())
    assert result.hit_rate == pytest.approx(6 / 15)
    assert expected_hit_tokens(w.requests, block_size) == (
        result.prefix_hit_tokens,
        result.prompt_tokens,
    )


@pytest.mark.parametrize("block_size", [1, 16, 100, 512, 1000])
def test_partial_blocks_and_the_cap(tmp_path: Path, block_size: int) -> None:
    """Partial last blocks and whole-prompt repeats: the independent count still matches."""
    rows: list[dict[str, object]] = [
        {"timestamp": 0, "input_length": 700, "output_length": 2, "hash_ids": [1, 2]},
        {"timestamp": 0, "input_length": 900, "output_length": 2, "hash_ids": [1, 2]},
        {"timestamp": 10, "input_length": 1024, "output_length": 1, "hash_ids": [1, 2]},
        {"timestamp": 10, "input_length": 1024, "output_length": 1, "hash_ids": [1, 2]},
        {"timestamp": 20, "input_length": 1300, "output_length": 1, "hash_ids": [1, 2, 3]},
        {"timestamp": 20, "input_length": 5, "output_length": 1, "hash_ids": [1]},
    ]
    w = read_trace(_write(tmp_path / "partial.jsonl", rows))
    m = BlockManager(8192, block_size)
    result = run_workload(m, w)
    assert m.stats().evictions == 0
    hits, total = expected_hit_tokens(w.requests, block_size)
    assert (result.prefix_hit_tokens, result.prompt_tokens) == (hits, total)
    assert hits > 0


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ({"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [1]}, "match"),
        ({"timestamp": 0, "input_length": 0, "output_length": 1, "hash_ids": []}, "match"),
        ({"timestamp": -1, "input_length": 5, "output_length": 1, "hash_ids": [1]}, "timestamp"),
        ({"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": ["a"]}, "hash_ids"),
        ({"timestamp": 0, "output_length": 1, "hash_ids": [1]}, "input_length"),
    ],
)
def test_bad_trace_lines(tmp_path: Path, row: dict[str, object], message: str) -> None:
    path = _write(tmp_path / "bad.jsonl", [row])
    with pytest.raises(ValueError, match=message):
        read_trace(path)
    path.write_text("{not json\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"bad.jsonl:1: not JSON"):
        read_trace(path)


@pytest.mark.parametrize("block_size", [16, 512])
def test_shared_trace_hit_rate_matches_the_count(block_size: int, mooncake_trace: Path) -> None:
    """The first 300 requests of the shared trace, a cache that never evicts."""
    w = read_trace(mooncake_trace, limit=300)
    m = BlockManager(w.prompt_tokens // block_size + 4096, block_size)
    result = run_workload(m, w)
    assert m.stats().evictions == 0
    assert expected_hit_tokens(w.requests, block_size) == (
        result.prefix_hit_tokens,
        result.prompt_tokens,
    )
    assert result.prefix_hit_tokens > 0


def test_shared_trace_with_eviction_agrees_with_reference(mooncake_trace: Path) -> None:
    w = read_trace(mooncake_trace, limit=25)
    rust = BlockManager(2048, 16, num_cpu_blocks=64)
    result = run_workload(rust, w, record=True)
    assert rust.stats().evictions > 0
    assert result.trace is not None and result.results is not None
    ref = ReferenceBlockManager(2048, 16, num_cpu_blocks=64)
    for (fn, args, kw), want in zip(bind_trace(ref, result.trace), result.results, strict=True):
        assert same_result(fn(*args, **kw), want)
    assert ref.stats() == rust.stats()
