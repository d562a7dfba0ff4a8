"""Microbenchmarks of the block manager, each beside the pure-Python reference doing the same work.

Every round of a benchmark does the same work: state that a round consumes is restored in an
untimed `setup` (pytest-benchmark's pedantic mode), so the mean is a steady-state number.

The main number is `decode-step`: one `append_batch` of one token for each of 256 running
sequences (about 16 of them cross a block boundary every step and get a new block, as in a
real batch). Target: under 20 us, and at least 20x faster than the reference.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from pagedkv import BlockManager
from pagedkv.simulate import (
    bind_trace,
    generate_workload,
    replay_trace,
    run_workload,
    same_result,
)

B = 16


def _rounds(impl: str, rust: int, reference: int) -> int:
    return rust if impl == "rust" else reference


def _tokens(rng: np.random.Generator, n: int) -> list[int]:
    return rng.integers(0, 2**31, size=n).tolist()  # type: ignore[no-any-return]


def _as(kind: str, tokens: list[int]) -> Any:
    """Token ids as the caller would pass them: a list of ints or a uint32 array."""
    return tokens if kind == "list" else np.asarray(tokens, dtype=np.uint32)


TOKEN_KINDS = pytest.mark.parametrize("kind", ["list", "numpy"])


# --------------------------------------------------------------------------------------------
# allocate


@TOKEN_KINDS
def test_allocate_prefix_hit(
    benchmark: Any, impl: str, kind: str, new_manager: Any, record: Any
) -> None:
    """32 allocations of a 1,041-token prompt whose first 65 blocks are cached (1 new block)."""
    group = f"allocate-hit ({kind}): 32 x 1041 tokens, 65 blocks hit"
    benchmark.group = group
    rng = np.random.default_rng(1)
    shared = _tokens(rng, 64 * B)
    prompts = [_as(kind, shared + _tokens(rng, B + 1)) for _ in range(32)]
    m = new_manager(impl, 4096, B)
    ids = list(range(32))
    for i in ids:  # warm the cache: every full block of every prompt is now CACHED
        m.allocate(i, prompts[i])
    m.free_batch(ids)

    def setup() -> None:
        if len(m):
            m.free_batch(ids)

    def run() -> None:
        for i in ids:
            m.allocate(i, prompts[i])

    benchmark.pedantic(run, setup=setup, rounds=_rounds(impl, 300, 20), warmup_rounds=1)
    assert m.allocate(99, prompts[0]) == 65 * B
    record(benchmark, group, impl)


@TOKEN_KINDS
def test_allocate_miss(benchmark: Any, impl: str, kind: str, new_manager: Any, record: Any) -> None:
    """32 allocations of fresh 1,041-token prompts into a pool full of cached blocks.

    Every block is hashed and registered, and every new block evicts the oldest cached one.
    """
    group = f"allocate-miss ({kind}): 32 x 1041 tokens, all evicting"
    benchmark.group = group
    rng = np.random.default_rng(2)
    num_blocks = 4096
    m = new_manager(impl, num_blocks, B)
    m.allocate(10_000, _tokens(rng, num_blocks * B))
    m.free(10_000)  # now every block is CACHED
    ids = list(range(32))
    prompts: list[Any] = []

    def setup() -> None:
        if len(m):
            m.free_batch(ids)
        prompts[:] = [_as(kind, _tokens(rng, 64 * B + 17)) for _ in ids]

    def run() -> None:
        for i in ids:
            m.allocate(i, prompts[i])

    benchmark.pedantic(run, setup=setup, rounds=_rounds(impl, 200, 10), warmup_rounds=1)
    assert m.num_free_blocks == 0
    assert m.stats().evictions > 0
    record(benchmark, group, impl)


# --------------------------------------------------------------------------------------------
# decode step: the main number


def _decode_bench(
    benchmark: Any, impl: str, new_manager: Any, steps: int, rounds: tuple[int, int]
) -> None:
    """Rounds of `steps` append_batch calls over 256 sequences, restored every 64 steps."""
    n = 256
    reset_every = max(1, 4 * B // steps)  # rounds between untimed resets (64 steps)
    rng = np.random.default_rng(3)
    # Lengths 100..355: every step, 16 of the 256 sequences start a new block.
    prompts = [_tokens(rng, 100 + i) for i in range(n)]
    m = new_manager(impl, 8192, B)
    ids = np.arange(n, dtype=np.int64)
    toks = np.full(n, 7, dtype=np.int64)
    state = {"rounds": reset_every}

    def setup() -> None:
        if state["rounds"] == reset_every:
            if len(m):
                m.free_batch(ids)
            for i in range(n):
                m.allocate(i, prompts[i])
            state["rounds"] = 0
        state["rounds"] += 1

    def run() -> None:
        for _ in range(steps):
            m.append_batch(ids, toks)

    benchmark.pedantic(run, setup=setup, rounds=_rounds(impl, *rounds), warmup_rounds=2)
    out = m.append_batch(ids, toks)
    assert out is not None
    assert len(out) == 0  # nothing shared: no copy-on-write


def test_decode_step_256(benchmark: Any, impl: str, new_manager: Any, record: Any) -> None:
    """THE number: one scheduler step, append_batch of one token for each of 256 sequences.

    Each round times a single step after untimed Python work (the setup), so caches are as
    cold as between two steps of a real engine.
    """
    group = "decode-step: append_batch, 256 seqs x 1 token"
    benchmark.group = group
    _decode_bench(benchmark, impl, new_manager, steps=1, rounds=(3000, 150))
    record(benchmark, group, impl)


def test_decode_16_steps_256(benchmark: Any, impl: str, new_manager: Any, record: Any) -> None:
    """16 back-to-back steps over the same 256 sequences (hot caches); divide by 16 per step."""
    group = "decode-16-steps: 16 x append_batch, 256 seqs"
    benchmark.group = group
    _decode_bench(benchmark, impl, new_manager, steps=16, rounds=(400, 10))
    record(benchmark, group, impl)


# --------------------------------------------------------------------------------------------
# free and fork


def _allocate_64(m: Any, prompts: list[list[int]]) -> None:
    for i, p in enumerate(prompts):
        m.allocate(i, p)


def test_free(benchmark: Any, impl: str, new_manager: Any, record: Any) -> None:
    """64 `free` calls of 9-block sequences (their full blocks go to the cached LRU queue)."""
    group = "free: 64 x free, 9 blocks each"
    benchmark.group = group
    rng = np.random.default_rng(4)
    prompts = [_tokens(rng, 8 * B + 5) for _ in range(64)]
    m = new_manager(impl, 2048, B)

    def setup() -> None:
        _allocate_64(m, prompts)

    def run() -> None:
        for i in range(64):
            m.free(i)

    benchmark.pedantic(run, setup=setup, rounds=_rounds(impl, 500, 50), warmup_rounds=1)
    assert len(m) == 0
    record(benchmark, group, impl)


def test_free_batch(benchmark: Any, impl: str, new_manager: Any, record: Any) -> None:
    """One `free_batch` of the same 64 sequences."""
    group = "free_batch: 64 seqs, 9 blocks each"
    benchmark.group = group
    rng = np.random.default_rng(4)
    prompts = [_tokens(rng, 8 * B + 5) for _ in range(64)]
    m = new_manager(impl, 2048, B)
    ids = np.arange(64, dtype=np.int64)

    def setup() -> None:
        _allocate_64(m, prompts)

    def run() -> None:
        m.free_batch(ids)

    benchmark.pedantic(run, setup=setup, rounds=_rounds(impl, 500, 50), warmup_rounds=1)
    assert len(m) == 0
    record(benchmark, group, impl)


def test_fork(benchmark: Any, impl: str, new_manager: Any, record: Any) -> None:
    """32 forks of one 65-block parent (parallel sampling)."""
    group = "fork: 32 children of a 65-block parent"
    benchmark.group = group
    rng = np.random.default_rng(5)
    m = new_manager(impl, 1024, B)
    m.allocate(0, _tokens(rng, 64 * B + 3))
    children = list(range(1, 33))

    def setup() -> None:
        if len(m) > 1:
            m.free_batch(children)

    def run() -> None:
        for c in children:
            m.fork(0, c)

    benchmark.pedantic(run, setup=setup, rounds=_rounds(impl, 500, 50), warmup_rounds=1)
    assert m.block_table(32) == m.block_table(0)
    record(benchmark, group, impl)


# --------------------------------------------------------------------------------------------
# the simulate workload


@pytest.fixture(scope="module")
def sim_trace() -> tuple[Any, Any]:
    """The `python -m pagedkv simulate` workload, recorded once through the Rust manager."""
    workload = generate_workload(300, seed=0)
    m = BlockManager(1024, B, num_cpu_blocks=256)
    result = run_workload(m, workload, record=True)
    assert result.trace is not None
    return result, m.stats()


def test_simulate_trace_replay(
    benchmark: Any, impl: str, sim_trace: tuple[Any, Any], new_manager: Any, record: Any
) -> None:
    """Every manager call of the simulate workload, replayed without the scheduler around it."""
    group = "simulate: trace replay, 300 requests"
    benchmark.group = group
    result, rust_stats = sim_trace
    holder: list[Any] = []

    def setup() -> tuple[tuple[Any, ...], dict[str, Any]]:
        m = new_manager(impl, 1024, B, num_cpu_blocks=256)
        holder[:] = [m]
        return (bind_trace(m, result.trace),), {}

    benchmark.pedantic(replay_trace, setup=setup, rounds=_rounds(impl, 10, 2))
    benchmark.extra_info["tokens"] = result.tokens
    # The same calls give the same state: same hits, evictions, copies, swaps.
    assert holder[0].stats() == rust_stats
    record(benchmark, group, impl)


def test_simulate_results_agree(sim_trace: tuple[Any, Any], new_manager: Any) -> None:
    """The reference answers every call of the recorded trace exactly as the Rust manager did."""
    result, _ = sim_trace
    ref = new_manager("reference", 1024, B, num_cpu_blocks=256)
    for i, ((fn, args, kwargs), want) in enumerate(
        zip(bind_trace(ref, result.trace), result.results, strict=True)
    ):
        got = fn(*args, **kwargs)
        assert same_result(got, want), (i, result.trace[i][0], got, want)


def test_simulate_full(benchmark: Any, impl: str, new_manager: Any, record: Any) -> None:
    """The whole simulate run, scheduler included (what `python -m pagedkv simulate` times)."""
    group = "simulate: full run with scheduler, 300 requests"
    benchmark.group = group
    workload = generate_workload(300, seed=0)

    def setup() -> tuple[tuple[Any, ...], dict[str, Any]]:
        return (new_manager(impl, 1024, B, num_cpu_blocks=256), workload), {}

    benchmark.pedantic(run_workload, setup=setup, rounds=_rounds(impl, 5, 1))
    record(benchmark, group, impl)
