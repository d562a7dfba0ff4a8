"""The Rust scheduling loop (`sim.rust_loop`, pagedkv-sim's `sched_loop`) against the Python
scheduler, the reference: on built-in workloads, the shared trace's first requests and random
workloads (preemption by recompute and by swap, chunked prefill under a per-request cap,
salts, parallel samples, chat follow-ups), both make the same manager calls with the same
arguments, in the same order, and get the same answers; their `SimResult` figures and
per-step series agree (time aside); a sizing check's stop rule stops both at the same step,
and the miss-ratio curves fed from Rust equal those the Python loop feeds."""

from __future__ import annotations

import dataclasses
import random
from typing import Any

import numpy as np
import pytest

from mooncake_trace import trace_path
from pagedkv import BlockManager, BlockManagerConfig, _core
from pagedkv.groups import KVCacheGroup
from pagedkv.sim import build_workload, read_trace, run_workload
from pagedkv.sim.calls import same_result
from pagedkv.sim.check_bound import StopRule
from pagedkv.sim.factory import make_manager
from pagedkv.sim.fan_out import FanOut
from pagedkv.sim.mrc_fast import FastMRCRecorder
from pagedkv.sim.requests import Request, Workload
from pagedkv.sim.scheduler import SimResult

# Figures that are times, or compared on their own below.
UNCOMPARED = {"wall_s", "manager_ns", "trace", "results", "series", "final_stats", "loop"}


def _same_arg(a: Any, b: Any) -> bool:
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return type(a) is type(b) and a.dtype == b.dtype and same_result(a, b)
    return type(a) is type(b) and same_result(a, b)


def assert_same_calls(py: SimResult, rs: SimResult) -> None:
    """The same manager calls, arguments and answers, in the same order."""
    assert py.trace is not None and rs.trace is not None
    assert py.results is not None and rs.results is not None
    for i, ((n1, a1, k1), (n2, a2, k2)) in enumerate(zip(py.trace, rs.trace, strict=False)):
        where = f"call {i}: python {n1}{a1[:1]!r} {k1}, rust {n2}{a2[:1]!r} {k2}"
        assert n1 == n2, where
        assert len(a1) == len(a2), where
        assert all(_same_arg(x, y) for x, y in zip(a1, a2, strict=True)), where
        assert k1.keys() == k2.keys(), where
        assert all(_same_arg(k1[k], k2[k]) for k in k1), where
        assert same_result(py.results[i], rs.results[i]), f"{where}: answers differ"
    assert len(py.trace) == len(rs.trace)


def assert_same_figures(py: SimResult, rs: SimResult) -> None:
    assert (py.loop, rs.loop) == ("python", "rust")
    for f in dataclasses.fields(SimResult):
        if f.name not in UNCOMPARED:
            assert getattr(py, f.name) == getattr(rs, f.name), f.name
    for name, values in py.series.as_dict().items():
        if name != "manager_ns":
            assert values == getattr(rs.series, name), name
    assert len(rs.series.manager_ns) == rs.steps
    assert py.final_stats == rs.final_stats


def both(
    workload: Workload, config: BlockManagerConfig, **options: Any
) -> tuple[SimResult, SimResult]:
    """The replay on each loop, each on a fresh manager, calls recorded."""
    out = [
        run_workload(make_manager(config), workload, record=True, loop=loop, **options)
        for loop in ("python", "rust")
    ]
    return out[0], out[1]


def check_identical(workload: Workload, config: BlockManagerConfig, **options: Any) -> SimResult:
    py, rs = both(workload, config, **options)
    assert_same_calls(py, rs)
    assert_same_figures(py, rs)
    return rs


# (num_blocks, num_cpu_blocks, max_num_batched_tokens, long_prefill_token_threshold, max_batch)
CONFIGS = [
    (4096, 0, 2048, 0, 256),  # room for all: no preemption
    (160, 0, 512, 0, 256),  # recompute
    (160, 96, 512, 64, 256),  # swap, chunks capped per request
    (300, 40, 256, 0, 5),  # swap space that fills; few running at once
]


@pytest.mark.parametrize("kind", ["chat", "sampling", "shared-prefix", "long-doc"])
@pytest.mark.parametrize("shape", CONFIGS, ids=lambda c: "-".join(map(str, c)))
def test_builtin_workloads_identical(kind: str, shape: tuple[int, ...]) -> None:
    nb, cpu, budget, cap, batch = shape
    config = BlockManagerConfig(num_blocks=nb, block_size=16, num_cpu_blocks=cpu)
    check_identical(
        build_workload(kind, 40, seed=5),
        config,
        max_num_batched_tokens=budget,
        long_prefill_token_threshold=cap,
        max_batch=batch,
    )


def random_workload(seed: int, n: int = 60) -> Workload:
    """Shared prefixes, salts, parallel samples, chat follow-ups, bursts and gaps."""
    rng = random.Random(seed)
    prefixes = [rng.choices(range(32_000), k=rng.randint(8, 200)) for _ in range(4)]
    reqs: list[Request] = []
    t = 0
    for i in range(n):
        t += rng.choice([0, 0, 1, 3, 20])
        prompt = rng.choice(prefixes) + rng.choices(range(32_000), k=rng.randint(1, 300))
        after = None
        if reqs and rng.random() < 0.3:
            parent = rng.choice(reqs)
            after = parent.request_id
            prompt = parent.prompt.tolist() + prompt[: rng.randint(1, 60)]
        reqs.append(
            Request(
                request_id=i * 3 + 1,
                prompt_len=len(prompt),
                max_new_tokens=rng.randint(1, 60),
                num_samples=rng.choice([1, 1, 1, 2, 3]),
                cache_salt=rng.choice([None, None, "tenant-a", "tenant-b"]),
                arrival_step=t,
                after=after,
                delay=rng.randint(0, 5),
                prompt_tokens=np.asarray(prompt, dtype=np.uint32),
            )
        )
    return Workload(tuple(reqs), seed, name="random")


def random_shape(seed: int) -> tuple[BlockManagerConfig, dict[str, int]]:
    rng = random.Random(1000 + seed)
    config = BlockManagerConfig(
        num_blocks=rng.choice([64, 120, 400]),
        block_size=rng.choice([8, 16]),
        num_cpu_blocks=rng.choice([0, 32, 200]),
    )
    options = {
        "max_num_batched_tokens": rng.choice([64, 256, 1024]),
        "long_prefill_token_threshold": rng.choice([0, 0, 48]),
        "max_batch": rng.choice([3, 256]),
    }
    return config, options


SEEDS = range(8)


@pytest.mark.parametrize("seed", SEEDS)
def test_random_workloads_identical(seed: int) -> None:
    config, options = random_shape(seed)
    rs = check_identical(random_workload(seed), config, **options)
    assert rs.finished_requests == rs.requests


def test_random_workloads_cover_the_paths() -> None:
    """The random shapes above do preempt both ways, swap back in, fork, chunk and follow."""
    seen = dict.fromkeys(["recompute", "swap", "swap_ins", "forks", "chunked", "follow"], 0)
    for seed in SEEDS:
        config, options = random_shape(seed)
        wl = random_workload(seed)
        res = run_workload(make_manager(config), wl, **options)
        assert res.loop == "rust"
        seen["recompute"] += res.preempted_recompute
        seen["swap"] += res.preempted_swap
        seen["swap_ins"] += res.swap_ins
        seen["forks"] += res.forks
        seen["chunked"] += res.chunked_prompts
        seen["follow"] += sum(r.after is not None for r in wl.requests)
    assert all(v > 0 for v in seen.values()), seen


GROUPS = {
    "window": [KVCacheGroup("full"), KVCacheGroup("sliding_window", window=64)],
    "chunked": [KVCacheGroup("full"), KVCacheGroup("chunked_local", chunk=128)],
    "state": [KVCacheGroup("full"), KVCacheGroup("state")],
}


@pytest.mark.parametrize("groups", list(GROUPS))
@pytest.mark.parametrize(("num_blocks", "cpu"), [(2000, 0), (200, 0), (200, 100)])
def test_hybrid_groups_identical(groups: str, num_blocks: int, cpu: int) -> None:
    """A manager with one block table per group: the hit-aware check is asked every time."""
    config = BlockManagerConfig(num_blocks=num_blocks, block_size=16, num_cpu_blocks=cpu)
    for workload in (build_workload("sampling", 30, seed=5), random_workload(3, n=40)):
        out = [
            run_workload(
                make_manager(config, groups=GROUPS[groups]),
                workload,
                record=True,
                loop=loop,
                max_num_batched_tokens=256,
            )
            for loop in ("python", "rust")
        ]
        assert_same_calls(*out)
        assert_same_figures(*out)


@pytest.fixture(scope="module")
def trace_workload(tmp_path_factory: pytest.TempPathFactory) -> Workload:
    return read_trace(trace_path(tmp_path_factory.mktemp("trace")), limit=300)


@pytest.mark.parametrize(
    ("num_blocks", "cpu"), [(65536, 0), (12000, 0), (12000, 4000)], ids=["roomy", "tight", "swap"]
)
def test_shared_trace_identical(trace_workload: Workload, num_blocks: int, cpu: int) -> None:
    config = BlockManagerConfig(num_blocks=num_blocks, block_size=16, num_cpu_blocks=cpu)
    rs = check_identical(trace_workload, config, max_num_batched_tokens=2048)
    assert rs.prefix_hit_tokens > 0


@pytest.mark.parametrize("target", [0.9, 0.0])
def test_stop_rule_stops_both_at_the_same_step(trace_workload: Workload, target: float) -> None:
    """0.9: the hit bound ends the run at once; 0.0: the first preemption ends it (the tight
    pool preempts on the shared trace)."""
    config = BlockManagerConfig(num_blocks=12000, block_size=16)
    results, reasons = [], []
    for loop in ("python", "rust"):
        rule = StopRule.build(trace_workload, 16, target, aborts=False)
        res = run_workload(
            make_manager(config),
            trace_workload,
            max_num_batched_tokens=2048,
            until=rule,
            record=True,
            loop=loop,
        )
        results.append(res)
        reasons.append(rule.reason)
    py, rs = results
    assert py.stopped_early == rs.stopped_early
    assert reasons[0] == reasons[1]
    assert_same_calls(py, rs)
    assert_same_figures(py, rs)
    if target > 0:
        assert rs.stopped_early and rs.finished_requests < rs.requests and reasons[1]
    elif rs.stopped_early:
        assert rs.preemptions > 0 and "preemption" in reasons[1]


def test_curves_fed_from_rust_equal_the_python_loops(trace_workload: Workload) -> None:
    config = BlockManagerConfig(num_blocks=12000, block_size=16, num_cpu_blocks=2000)
    curves = []
    for loop in ("python", "rust"):
        own, other = FastMRCRecorder(16), FastMRCRecorder(32, 0.5)
        res = run_workload(
            make_manager(config),
            trace_workload,
            max_num_batched_tokens=2048,
            watch=FanOut([own, other]),
            loop=loop,
        )
        assert res.loop == loop
        curves.append((own.curve(), other.curve()))
    for a, b in zip(curves[0], curves[1], strict=True):
        assert a.lookups == b.lookups > 0
        assert a.prompt_tokens == b.prompt_tokens
        assert (a.touches, a.distinct_blocks) == (b.touches, b.distinct_blocks)
        assert np.array_equal(a.thresholds, b.thresholds)


def test_a_reordered_call_fails_the_comparison() -> None:
    """The comparison sees one step's calls in another order (two calls swapped)."""
    config = BlockManagerConfig(num_blocks=120, block_size=16)
    py, rs = both(build_workload("sampling", 20, seed=2), config, max_num_batched_tokens=256)
    assert_same_calls(py, rs)
    assert rs.trace is not None and rs.results is not None
    i = next(i for i in range(len(rs.trace) - 1) if rs.trace[i][0] != rs.trace[i + 1][0])
    rs.trace[i], rs.trace[i + 1] = rs.trace[i + 1], rs.trace[i]
    rs.results[i], rs.results[i + 1] = rs.results[i + 1], rs.results[i]
    with pytest.raises(AssertionError, match=f"call {i}:"):
        assert_same_calls(py, rs)


class _PythonObserver:
    def __getattr__(self, name: str) -> Any:
        return lambda *args, **kwargs: None


class _Wrapper:
    def __init__(self, m: Any) -> None:
        self.m = m

    def __getattr__(self, name: str) -> Any:
        return getattr(self.m, name)


def test_auto_picks_the_rust_loop_only_in_scope() -> None:
    wl = build_workload("chat", 10, seed=1)
    config = BlockManagerConfig(num_blocks=512, block_size=16)
    assert run_workload(make_manager(config), wl, max_num_batched_tokens=256).loop == "rust"
    out_of_scope: list[tuple[dict[str, Any], str]] = [
        ({"max_num_batched_tokens": None}, "whole prompts"),
        ({"spec_tokens": 2}, "speculative decoding"),
        ({"abort_rate": 0.1}, "aborts"),
        ({"check": True}, "--check"),
        ({"observe": lambda: None}, "observe"),
        ({"until": lambda res: False}, "until"),
        ({"watch": FanOut([FastMRCRecorder(16), _PythonObserver()])}, "observer"),
    ]
    for options, why in out_of_scope:
        kw: dict[str, Any] = {"max_num_batched_tokens": 256, **options}
        assert run_workload(make_manager(config), wl, **kw).loop == "python", why
        with pytest.raises(ValueError, match=why):
            run_workload(make_manager(config), wl, loop="rust", **kw)
    beams = build_workload("beam", 6, seed=1)
    assert run_workload(make_manager(config), beams, max_num_batched_tokens=256).loop == "python"
    with pytest.raises(ValueError, match="beam search"):
        run_workload(make_manager(config), beams, max_num_batched_tokens=256, loop="rust")
    wrapped: Any = _Wrapper(make_manager(config))
    with pytest.raises(ValueError, match="not the Rust BlockManager"):
        run_workload(wrapped, wl, max_num_batched_tokens=256, loop="rust")
    with pytest.raises(ValueError, match="loop must be"):
        run_workload(make_manager(config), wl, max_num_batched_tokens=256, loop="c")


def test_progress_is_called_and_its_exception_stops_the_run() -> None:
    wl = build_workload("chat", 12, seed=4)
    config = BlockManagerConfig(num_blocks=512, block_size=16)
    calls: list[tuple[int, int]] = []
    res = run_workload(
        make_manager(config),
        wl,
        max_num_batched_tokens=256,
        progress=lambda done, total: calls.append((done, total)),
    )
    assert res.loop == "rust" and len(calls) == res.steps
    assert calls[-1] == (res.requests, res.requests)

    def interrupt(done: int, total: int) -> None:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_workload(make_manager(config), wl, max_num_batched_tokens=256, progress=interrupt)


OPTIONS: dict[str, Any] = {
    "max_batch": 8,
    "max_num_batched_tokens": 64,
    "long_prefill_token_threshold": 0,
    "skip_sure_checks": True,
    "record": False,
    "watches": [],
    "progress": None,
    "stop": None,
}


def test_bad_requests_are_refused_before_any_call() -> None:
    m = BlockManager(num_blocks=64, block_size=16)
    tokens = np.arange(10, dtype=np.uint32)
    good = (1, tokens, None, 512, 10, 4, 1, None, 0, 0, None, 0)
    short = (2, tokens, None, 512, 12, 4, 1, None, 0, 0, None, 0)
    few_ids = (3, None, np.asarray([7, 8], dtype=np.int64), 16, 40, 4, 1, None, 0, 0, None, 0)
    with pytest.raises(ValueError, match="request 2: prompt_len is 12 but its prompt has 10"):
        _core.schedule_replay(m, [good, short], **OPTIONS)
    with pytest.raises(ValueError, match="request 3: prompt_len is 40 but its prompt has 32"):
        _core.schedule_replay(m, [good, few_ids], **OPTIONS)
    with pytest.raises(ValueError, match="appears twice"):
        _core.schedule_replay(m, [good, good], **OPTIONS)
    with pytest.raises(ValueError, match="12-tuple"):
        _core.schedule_replay(m, [good[:5]], **OPTIONS)
    assert len(m) == 0 and m.num_free_blocks == 64 and m.stats().prefix_queries == 0


def test_other_threads_run_while_the_loop_runs() -> None:
    """The loop releases the GIL (taking it back only between steps): a Python thread runs
    inside the call's time span, which it could not if the GIL were held throughout."""
    import threading
    import time

    stamps: list[float] = []
    stop = threading.Event()

    def tick() -> None:
        while not stop.is_set():
            stamps.append(time.perf_counter())
            time.sleep(0.0005)

    rng = np.random.default_rng(0)

    def request(i: int) -> tuple[Any, ...]:
        tokens = rng.integers(0, 32_000, 4000, dtype=np.uint32)
        return (i, tokens, None, 512, 4000, 8, 1, None, 0, 0, None, 0)

    requests = [request(i) for i in range(200)]
    t = threading.Thread(target=tick)
    t.start()
    try:
        while not stamps:
            time.sleep(0.001)
        t0 = time.perf_counter()
        out = _core.schedule_replay(
            BlockManager(num_blocks=8192, block_size=16), requests, **OPTIONS
        )
        t1 = time.perf_counter()
    finally:
        stop.set()
        t.join()
    assert out["counters"]["finished_requests"] == 200
    inside = [x for x in stamps if t0 < x < t1]
    assert t1 - t0 > 0.01, "the call is long enough for the thread to tick"
    # Released: dozens of ticks in the call's 40-80 ms here; held: at most the one or two at
    # its edges (the thread takes the GIL as the call ends, before `t1` is read).
    assert len(inside) >= 10, (len(inside), t1 - t0)
