"""Issue 13's operation benchmarks, the Rust manager beside the pure-Python reference.

Each benchmark stores its per-unit figure in `extra_info` (ns per prompt token, per sequence,
per block) so that `--benchmark-json` carries it; the session summary gives reference/Rust
ratios. Both implementations use the same sizes; the reference runs fewer rounds (its decode
benchmark also grows its sequences less, since rounds are not undone: see `_decode_pool`).

- allocate of one 8,197-token prompt (512 full blocks and one partial), SHA-256: a miss into
  free blocks, a hit on 512 cached blocks, and a miss under a full cache (each block evicts);
- one `append_batch` step of one token to 256 sequences of about 2,000 tokens (the replay's
  prompt length), on a pool with free blocks, on a full cache (each new block evicts), and on
  a full cache with the CPU caches flushed before each step;
- `free` of the 513-block sequence;
- the replay of `replay.py` (100 requests, at most 64 running): same hits on both managers.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import replay  # benches/ is on sys.path: pytest puts the test file's folder there

B = replay.BLOCK_SIZE
LONG = 512 * B + 5


def _rounds(impl: str, rust: int, reference: int) -> int:
    return rust if impl == "rust" else reference


def _per_unit(benchmark: Any, units: int, unit: str) -> None:
    """Record the mean in ns per `unit` (nothing when benchmarks are disabled)."""
    mean = getattr(getattr(getattr(benchmark, "stats", None), "stats", None), "mean", None)
    if mean:
        benchmark.extra_info[f"ns_per_{unit}"] = mean * 1e9 / units


def _prompt(rng: np.random.Generator, n: int = LONG) -> Any:
    return rng.integers(0, replay.VOCAB, n, dtype=np.uint32)


def _fill_cache(m: Any, num_blocks: int, seq_id: int = 10**9) -> None:
    """Make every block of `m` CACHED (a free stack that is empty: each new block evicts)."""
    m.allocate(seq_id, np.arange(num_blocks * B, dtype=np.uint32))
    m.free(seq_id)
    assert m.num_free_blocks == 0


@pytest.mark.parametrize("case", ["miss", "hit", "evict"])
def test_allocate_long(benchmark: Any, impl: str, case: str, new_manager: Any, record: Any) -> None:
    """One allocate of an 8,197-token prompt: miss (free pool), hit, or miss that evicts."""
    group = f"allocate-long ({case}): 1 x {LONG} tokens"
    benchmark.group = group
    rng = np.random.default_rng(13)
    m = new_manager(impl, 1024, B)
    prompt = [_prompt(rng)]
    if case == "hit":
        m.allocate(1, prompt[0])
    if case == "evict":
        _fill_cache(m, 1024)
    evictions = m.stats().evictions

    def setup() -> None:
        if 1 in m:
            m.free(1)
        if case == "miss":
            assert m.reset_prefix_cache()
        if case == "evict":
            prompt[0] = _prompt(rng)

    def run() -> None:
        hit = m.allocate(1, prompt[0])
        assert hit == (512 * B if case == "hit" else 0)

    benchmark.pedantic(run, setup=setup, rounds=_rounds(impl, 300, 20), warmup_rounds=1)
    assert (m.stats().evictions > evictions) == (case == "evict")
    _per_unit(benchmark, LONG, "token")
    record(benchmark, group, impl)


def _decode_pool(steps: int) -> int:
    """Blocks for 256 sequences of 1,900..2,155 tokens growing by `steps` tokens."""
    return 256 * (2155 // B + 2 + steps // B)


COLD_BYTES = 48 << 20  # more than this machine's 32 MiB L3
COLD_WORDS = COLD_BYTES // 8


@pytest.mark.parametrize("call", ["append_batch", "running_batch"])
@pytest.mark.parametrize("pool", ["free", "full", "cold"])
def test_decode_step_256_long(
    benchmark: Any, impl: str, pool: str, call: str, new_manager: Any, record: Any
) -> None:
    """One append_batch of one token to 256 sequences of about 2,000 tokens; with
    `running_batch`, one `RunningBatch.step` of the same sequences, which also returns the
    new tokens' slots (an engine's `append_batch` is followed by a `slot_mapping`).

    Prompts of 1,900..2,155 tokens, so 16 sequences fill a block (hashed, registered) and 16
    take a new one each step. Rounds are not undone: the pool is sized for the growth. With
    `full`, every block is CACHED before the sequences arrive, so each new block evicts;
    `cold` is `full` with 48 MiB read (untimed) before each step, as an engine's other work
    between two steps would, so the manager's state comes from memory, not from cache (read,
    not written: no dirty lines are left for the step to write back).
    """
    group = f"decode-step-long ({pool}): {call}, 256 seqs x ~2,000 tokens"
    benchmark.group = group
    rounds = _rounds(impl, 300, 30) if pool == "cold" else _rounds(impl, 2000, 100)
    num_blocks = _decode_pool(rounds + 2)
    m = new_manager(impl, num_blocks, B)
    if pool != "free":
        _fill_cache(m, num_blocks)
    rng = np.random.default_rng(14)
    for i in range(256):
        m.allocate(i, _prompt(rng, 1900 + i))
    ids = np.arange(256, dtype=np.int64)
    toks = np.full(256, 7, dtype=np.uint32)
    evictions = m.stats().evictions
    junk = np.ones(COLD_WORDS if pool == "cold" else 0, dtype=np.uint64)

    def setup() -> None:
        if junk.size:
            junk.max()

    batch = m.running_batch(ids) if call == "running_batch" else None

    def run() -> None:
        if batch is not None:
            step = batch.step(toks)
            assert step is not None
            out = step[1]
        else:
            out = m.append_batch(ids, toks)
            assert out is not None
        assert len(out) == 0

    benchmark.pedantic(run, setup=setup, rounds=rounds, warmup_rounds=1)
    assert (m.stats().evictions > evictions) == (pool != "free")
    _per_unit(benchmark, 256, "seq")
    record(benchmark, group, impl)


def test_free_long(benchmark: Any, impl: str, new_manager: Any, record: Any) -> None:
    """free of one 8,197-token sequence: 512 full blocks go to the cached LRU, one to free."""
    group = f"free-long: 1 x {LONG // B + 1} blocks"
    benchmark.group = group
    m = new_manager(impl, 1024, B)
    prompt = _prompt(np.random.default_rng(15))

    def setup() -> None:
        m.allocate(1, prompt)

    benchmark.pedantic(m.free, args=(1,), setup=setup, rounds=_rounds(impl, 500, 50))
    assert len(m) == 0
    assert m.num_cached_blocks == 512
    _per_unit(benchmark, LONG // B + 1, "block")
    record(benchmark, group, impl)


SMALL, SMALL_RUNNING = 100, 64


@pytest.fixture(scope="module")
def small() -> tuple[replay.Workload, int, replay.ReplayResult]:
    """The small replay's workload, pool, and the Rust manager's result."""
    w = replay.generate(SMALL)
    num_blocks = replay.size_pool(w, max_running=SMALL_RUNNING)
    rust = replay.replay(replay.make("rust", num_blocks), w, max_running=SMALL_RUNNING)
    return w, num_blocks, rust


def test_replay_small(benchmark: Any, impl: str, small: Any, record: Any) -> None:
    """The whole replay (driver included) of 100 requests; both managers give the same hits."""
    group = f"replay: {SMALL} requests, at most {SMALL_RUNNING} running"
    benchmark.group = group
    w, num_blocks, rust = small
    results: list[replay.ReplayResult] = []

    def setup() -> tuple[tuple[Any, ...], dict[str, Any]]:
        return (replay.make(impl, num_blocks), w), {"max_running": SMALL_RUNNING}

    def run(m: Any, w: replay.Workload, max_running: int) -> None:
        results.append(replay.replay(m, w, impl=impl, max_running=max_running))

    benchmark.pedantic(run, setup=setup, rounds=_rounds(impl, 5, 1))
    r = results[-1]
    assert (r.hits_each, r.evictions, r.steps) == (rust.hits_each, rust.evictions, rust.steps)
    assert r.evictions > 0
    benchmark.extra_info["manager_s"] = r.manager_ns / 1e9
    record(benchmark, group, impl)


def test_workload_shape() -> None:
    """The full workload is issue 13's: about 3.9 M prompt and 0.55 M generated tokens."""
    w = replay.generate()
    assert len(w.prompts) == 2000
    assert 3.7e6 < w.prompt_tokens < 4.1e6
    assert 0.5e6 < w.generated_tokens < 0.6e6
    again = replay.generate()
    assert all(np.array_equal(a, b) for a, b in zip(w.prompts, again.prompts, strict=True))
