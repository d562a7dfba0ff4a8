"""`python -m pagedkv simulate` workloads, the Rust manager beside the pure-Python reference.

Two sources: the first `LIMIT` requests of the shared Mooncake trace (where
`../shared/traces/` has it; constant eviction at 16 K blocks of 16 tokens) and the built-in
mixed workload. For each, the scheduler's manager calls are recorded once through the Rust
manager, then:

- `manager calls`: the recorded calls replayed on a fresh manager, nothing else timed: the
  mean per round over the number of steps is the manager's time per step (target: the Rust
  manager at least 20x below the reference), and both end in the same state (same hit rate);
- `full run`: the whole simulation, scheduler included, on each manager; same hit rate.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from pagedkv import BlockManager
from pagedkv.sim import (
    SimResult,
    Workload,
    bind_trace,
    build_workload,
    read_trace,
    replay_trace,
    run_workload,
)

SHARED_TRACE = (
    Path(__file__).resolve().parents[2] / "shared" / "traces" / "mooncake_synthetic_trace.jsonl"
)
LIMIT = 200
B = 16
# source -> (num_blocks, num_cpu_blocks)
SIZES = {"mooncake": (16384, 512), "mixed": (2048, 256)}


def _workload(source: str) -> Workload:
    if source == "mooncake":
        if not SHARED_TRACE.exists():
            pytest.skip(f"shared trace {SHARED_TRACE} not present")
        return read_trace(SHARED_TRACE, limit=LIMIT)
    return build_workload("mixed", 300, seed=0)


@pytest.fixture(scope="module", params=list(SIZES))
def recorded(request: pytest.FixtureRequest) -> tuple[str, Workload, SimResult, Any]:
    """(source, workload, the Rust run with every call recorded, its final stats)."""
    source = str(request.param)
    workload = _workload(source)
    nb, cpu = SIZES[source]
    m = BlockManager(nb, B, num_cpu_blocks=cpu)
    result = run_workload(m, workload, record=True)
    assert m.stats().evictions > 0
    return source, workload, result, m.stats()


def _label(source: str, result: SimResult) -> str:
    what = f"Mooncake trace, first {LIMIT} requests" if source == "mooncake" else "mixed, 300"
    return f"{what}, {result.steps} steps"


def test_simulate_manager_calls(
    benchmark: Any,
    impl: str,
    recorded: tuple[str, Workload, SimResult, Any],
    new_manager: Any,
    record: Any,
) -> None:
    """The recorded manager calls only: mean / steps = the manager's time per step."""
    source, _, result, rust_stats = recorded
    group = f"simulate {source}: manager calls ({_label(source, result)})"
    benchmark.group = group
    nb, cpu = SIZES[source]
    holder: list[Any] = []

    def setup() -> tuple[tuple[Any, ...], dict[str, Any]]:
        m = new_manager(impl, nb, B, num_cpu_blocks=cpu)
        holder[:] = [m]
        assert result.trace is not None
        return (bind_trace(m, result.trace),), {}

    # Three reference rounds: one alone makes the ratio as noisy as a single timing.
    rounds = {"rust": 5, "reference": 3}[impl]
    benchmark.pedantic(replay_trace, setup=setup, rounds=rounds)
    st = holder[0].stats()
    assert st == rust_stats  # same hits, evictions, copies, swaps
    benchmark.extra_info.update(steps=result.steps, hit_rate=st.hit_rate, tokens=result.tokens)
    mean = getattr(getattr(getattr(benchmark, "stats", None), "stats", None), "mean", None)
    if mean:
        benchmark.extra_info["manager_us_per_step"] = mean / result.steps * 1e6
    record(benchmark, group, impl)


def test_simulate_full_run(
    benchmark: Any,
    impl: str,
    recorded: tuple[str, Workload, SimResult, Any],
    new_manager: Any,
    record: Any,
) -> None:
    """The whole simulation, scheduler included; the same hit rate on either manager."""
    source, workload, result, _ = recorded
    group = f"simulate {source}: full run ({_label(source, result)})"
    benchmark.group = group
    nb, cpu = SIZES[source]
    out: list[SimResult] = []

    def setup() -> tuple[tuple[Any, ...], dict[str, Any]]:
        return (new_manager(impl, nb, B, num_cpu_blocks=cpu), workload), {}

    def run(m: Any, w: Workload) -> None:
        out[:] = [run_workload(m, w)]

    benchmark.pedantic(run, setup=setup, rounds={"rust": 3, "reference": 1}[impl])
    got = out[0]
    assert got.prefix_hit_tokens == result.prefix_hit_tokens
    assert got.hit_rate == result.hit_rate
    assert got.steps == result.steps
    benchmark.extra_info.update(
        hit_rate=got.hit_rate,
        manager_us_per_step=got.manager_ns / got.steps / 1e3,
        manager_p99_us_per_step=sorted(got.series.manager_ns)[
            min(len(got.series.manager_ns) - 1, int(0.99 * len(got.series.manager_ns)))
        ]
        / 1e3,
    )
    record(benchmark, group, impl)
