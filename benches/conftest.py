"""Shared helpers for the benchmarks: manager factory and a Rust-vs-reference ratio summary.

Run: `pytest benches` (timed), or `pytest benches --benchmark-disable` (each once, as tests).
Every benchmark that has a pure-Python twin runs with `impl` = "rust" and "reference" in the
same `group`, so pytest-benchmark prints the pair side by side; at the end of the session a
short table gives, per group, the reference's mean time over the Rust manager's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

import vllm_env
from pagedkv import BlockManager
from pagedkv_reference import ReferenceBlockManager

IMPLS = ("rust", "reference")

# vLLM (test_bench_vllm_step) needs its offline environment before it is first imported.
vllm_env.prepare()

# group -> impl -> mean seconds per round
_MEANS: dict[str, dict[str, float]] = {}


def make_manager(impl: str, num_blocks: int, block_size: int = 16, **kwargs: Any) -> Any:
    """A manager of either implementation, with the same arguments."""
    if impl == "rust":
        return BlockManager(num_blocks, block_size, **kwargs)
    if impl == "reference":
        return ReferenceBlockManager(num_blocks, block_size, **kwargs)
    raise ValueError(impl)


def record_mean(benchmark: Any, group: str, impl: str) -> None:
    """Remember a finished benchmark's mean (nothing when benchmarks are disabled)."""
    meta = getattr(benchmark, "stats", None)
    stats = getattr(meta, "stats", None)
    mean = getattr(stats, "mean", None)
    if mean:
        _MEANS.setdefault(group, {})[impl] = float(mean)


@pytest.fixture
def new_manager() -> Callable[..., Any]:
    """`new_manager(impl, num_blocks, block_size=16, **kwargs)`: see `make_manager`."""
    return make_manager


@pytest.fixture
def record() -> Callable[[Any, str, str], None]:
    """`record(benchmark, group, impl)`: add the benchmark to the speedup summary."""
    return record_mean


@pytest.fixture(params=IMPLS)
def impl(request: pytest.FixtureRequest) -> str:
    """Which implementation a benchmark drives: the Rust manager or the reference model."""
    return str(request.param)


def _fmt(seconds: float) -> str:
    if seconds < 1e-3:
        return f"{seconds * 1e6:10.2f} us"
    if seconds < 1:
        return f"{seconds * 1e3:10.2f} ms"
    return f"{seconds:10.3f} s "


def pytest_terminal_summary(terminalreporter: Any) -> None:
    _router_summary(terminalreporter)
    _vllm_summary(terminalreporter)
    _events_summary(terminalreporter)
    _eviction_summary(terminalreporter)
    pairs = {g: m for g, m in _MEANS.items() if "rust" in m and "reference" in m}
    if not pairs:
        return
    tr = terminalreporter
    tr.section("pagedkv: Rust manager vs pure-Python reference (mean per round)")
    width = max(len(g) for g in pairs)
    for group, m in sorted(pairs.items()):
        tr.write_line(
            f"{group:<{width}}  rust {_fmt(m['rust'])}  reference {_fmt(m['reference'])}"
            f"  speedup {m['reference'] / m['rust']:8.1f}x"
        )


def _router_summary(tr: Any) -> None:
    """pagedkv's and Dynamo's router indexes on the same stream (test_bench_router)."""
    import sys

    mod = sys.modules.get("test_bench_router")
    lines = mod.summary() if mod is not None else []
    if lines:
        tr.section("router indexes: pagedkv.router and Dynamo's RadixTree, the same stream")
        for line in lines:
            tr.write_line(line)


def _events_summary(tr: Any) -> None:
    """The hot path with the KV-event publisher off and on (test_bench_events_publisher)."""
    pairs = {g: m for g, m in _MEANS.items() if "off" in m and "on" in m}
    if not pairs:
        return
    tr.section("KV-event publisher: the hot path off, with events only, and on (mean per round)")
    width = max(len(g) for g in pairs)
    for group, m in sorted(pairs.items()):
        events = f"  events {_fmt(m['events'])}" if "events" in m else ""
        tr.write_line(
            f"{group:<{width}}  off {_fmt(m['off'])}{events}  on {_fmt(m['on'])}"
            f"  on/off {m['on'] / m['off']:6.2f}"
        )


def _eviction_summary(tr: Any) -> None:
    """Each eviction policy's mean against LRU's (test_bench_eviction)."""
    from pagedkv.config import EVICTIONS

    others = [p for p in EVICTIONS if p != "lru"]
    groups = {g: m for g, m in _MEANS.items() if "lru" in m and any(p in m for p in others)}
    if not groups:
        return
    tr.section("eviction policies: mean per round, and against LRU")
    width = max(len(g) for g in groups)
    for group, m in sorted(groups.items()):
        cells = [f"lru {_fmt(m['lru'])}"]
        cells += [f"{p} {_fmt(m[p])} ({m[p] / m['lru']:.2f}x)" for p in others if p in m]
        tr.write_line(f"{group:<{width}}  " + "  ".join(cells))


def _vllm_summary(tr: Any) -> None:
    """vLLM's scheduler step with vLLM's manager against pagedkv's (test_bench_vllm_step)."""
    pairs = {g: m for g, m in _MEANS.items() if "vllm" in m and "pagedkv" in m}
    if not pairs:
        return
    tr.section("vLLM scheduler step: vLLM's KV-cache manager vs pagedkv's (mean per step)")
    width = max(len(g) for g in pairs)
    for group, m in sorted(pairs.items()):
        tr.write_line(
            f"{group:<{width}}  vllm {_fmt(m['vllm'])}  pagedkv {_fmt(m['pagedkv'])}"
            f"  pagedkv/vllm {m['pagedkv'] / m['vllm']:6.2f}"
        )
