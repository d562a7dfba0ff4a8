"""Throughput against thread count: one shared manager, 1 to 16 Python threads.

Two workloads, each thread on its own sequences:

- decode: 64 sequences per thread, 256 `append_batch` steps of one token each (a scheduler
  step; batches of 64 release the GIL, so the Rust core runs on several cores at once);
- churn: allocate a 64-token prompt (sharing a 48-token prefix with every other thread) and
  free it again, one sequence at a time (small calls that keep the GIL: the honest worst case);
- hybrid decode: the decode workload on a hybrid layout (gpt-oss's: one full-attention group
  and one sliding-window group of 128 tokens), the same lock-free manager with two tables per
  sequence and window releases every few steps.

As pytest-benchmark tests (`pytest benches/test_bench_threads.py`), or, for the table in
`benches/results/`, as a script on the machine to measure:

    python benches/test_bench_threads.py [--out benches/results/thread_scaling-<machine>.md]

It prints (and writes) tokens/s for decode, operations/s for churn and tokens/s for hybrid
decode at 1, 2, 4, 8 and 16 threads, with the machine's CPU count and model. A machine with N
cores can scale to N threads at most; CI's 2 vCPUs behave like about one core.
"""

from __future__ import annotations

import argparse
import os
import platform
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pagedkv import BlockManager, KVCacheGroup

B = 16
PER_THREAD = 64
THREADS = (1, 2, 4, 8, 16)


class _Crew:
    """N persistent threads that each run `work(thread_index)` once per round."""

    def __init__(self, n: int, work: Callable[[int], None]) -> None:
        self._go = threading.Barrier(n + 1, timeout=300)
        self._done = threading.Barrier(n + 1, timeout=300)
        self._stop = False
        self._errors: list[BaseException] = []
        self._work = work
        self._threads = [threading.Thread(target=self._loop, args=(i,)) for i in range(n)]
        for t in self._threads:
            t.start()

    def _loop(self, i: int) -> None:
        while True:
            self._go.wait()
            if self._stop:
                return
            try:
                self._work(i)
            except BaseException as exc:  # reported by round()
                self._errors.append(exc)
            self._done.wait()

    def round(self) -> None:
        self._go.wait()
        self._done.wait()
        if self._errors:
            raise self._errors[0]

    def close(self) -> None:
        self._stop = True
        self._go.wait()
        for t in self._threads:
            t.join()


HYBRID = [KVCacheGroup("full"), KVCacheGroup("sliding_window", window=128)]


def decode_workload(
    threads: int, steps: int, groups: list[KVCacheGroup] | None = None
) -> tuple[BlockManager, Callable[[int], None], int]:
    """(manager, per-thread work for one round, tokens appended per round)."""
    tables = 1 if groups is None else len(groups)
    m = BlockManager(
        tables * threads * PER_THREAD * (steps // B + 8) + 64,
        B,
        enable_prefix_caching=False,
        groups=groups,
    )
    rng = np.random.default_rng(6)
    id_sets = [
        np.arange(t * 10_000, t * 10_000 + PER_THREAD, dtype=np.int64) for t in range(threads)
    ]
    for ids in id_sets:
        for s in ids.tolist():
            m.allocate(s, rng.integers(0, 2**31, size=64 + s % 16, dtype=np.uint32))
    tok = np.ones(PER_THREAD, dtype=np.int64)

    def work(t: int) -> None:
        ids = id_sets[t]
        for _ in range(steps):
            if m.append_batch(ids, tok) is None:
                raise RuntimeError("pool too small for the benchmark")
        # Give the blocks back: the next round starts from the same state.
        m.free_batch(ids)
        for s in ids.tolist():
            m.allocate(s, [s, 1, 2])

    return m, work, threads * PER_THREAD * steps


def hybrid_decode_workload(
    threads: int, steps: int
) -> tuple[BlockManager, Callable[[int], None], int]:
    """`decode_workload` on the hybrid layout (`HYBRID`)."""
    return decode_workload(threads, steps, HYBRID)


def churn_workload(threads: int, rounds: int) -> tuple[BlockManager, Callable[[int], None], int]:
    """(manager, per-thread work for one round, operations per round)."""
    m = BlockManager(threads * PER_THREAD * 8 + 256, B)
    prefix = list(range(48))

    def work(t: int) -> None:
        base = t * 1_000_000
        for r in range(rounds):
            for j in range(PER_THREAD):
                sid = base + j
                if m.allocate(sid, [*prefix, *range(t * 100 + r, t * 100 + r + 16)]) is None:
                    raise RuntimeError("pool too small for the benchmark")
                m.free(sid)

    return m, work, threads * rounds * PER_THREAD * 2


def _bench(benchmark: Any, make: Callable[..., Any], threads: int, n: int, unit: str) -> None:
    m, work, per_round = make(threads, n)
    crew = _Crew(threads, work)
    try:
        benchmark.pedantic(crew.round, rounds=5, warmup_rounds=1)
    finally:
        crew.close()
    benchmark.extra_info[f"{unit}_per_round"] = per_round
    m.check_invariants()


@pytest.mark.parametrize("threads", THREADS[:4])
def test_decode_scaling(benchmark: Any, threads: int) -> None:
    """Per thread: 32 append_batch steps over 64 sequences."""
    benchmark.group = "threads: decode, per thread 64 seqs x 32 append_batch"
    _bench(benchmark, decode_workload, threads, 32, "tokens")


@pytest.mark.parametrize("threads", THREADS[:4])
def test_hybrid_decode_scaling(benchmark: Any, threads: int) -> None:
    """Per thread: 32 append_batch steps over 64 sequences of a full + sliding-window model."""
    benchmark.group = "threads: hybrid decode, per thread 64 seqs x 32 append_batch"
    _bench(benchmark, hybrid_decode_workload, threads, 32, "tokens")


@pytest.mark.parametrize("threads", THREADS[:4])
def test_churn_scaling(benchmark: Any, threads: int) -> None:
    """Per thread: 2 x 64 allocate + free of a prompt with a shared prefix."""
    benchmark.group = "threads: churn, per thread 128 allocate + free"
    _bench(benchmark, churn_workload, threads, 2, "ops")


def measure(make: Callable[..., Any], threads: int, n: int, seconds: float) -> float:
    """Work units per second over repeated rounds lasting about `seconds` in all."""
    m, work, per_round = make(threads, n)
    crew = _Crew(threads, work)
    try:
        crew.round()  # warm up
        done, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            crew.round()
            done += per_round
        rate = done / (time.perf_counter() - t0)
    finally:
        crew.close()
    m.check_invariants()
    return rate


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, help="also write the markdown table here")
    ap.add_argument("--seconds", type=float, default=2.0, help="per measurement")
    ap.add_argument("--threads", type=int, nargs="*", default=list(THREADS))
    args = ap.parse_args()
    rows = []
    base: dict[str, float] = {}
    for n in args.threads:
        dec = measure(decode_workload, n, 256, args.seconds)
        churn = measure(churn_workload, n, 2, args.seconds)
        hyb = measure(hybrid_decode_workload, n, 256, args.seconds)
        base.setdefault("d", dec)
        base.setdefault("c", churn)
        base.setdefault("h", hyb)
        rows.append(
            f"| {n} | {dec / 1e6:.2f} M | {dec / base['d']:.2f}x "
            f"| {churn / 1e6:.3f} M | {churn / base['c']:.2f}x "
            f"| {hyb / 1e6:.2f} M | {hyb / base['h']:.2f}x |"
        )
        print(rows[-1], flush=True)
    head = [
        f"Machine: {_cpu_model()}, {os.cpu_count()} logical CPUs ({platform.machine()}), "
        f"Python {platform.python_version()}.",
        "",
        "| threads | decode tokens/s | vs 1 thread | churn ops/s | vs 1 thread "
        "| hybrid decode tokens/s | vs 1 thread |",
        "|---|---|---|---|---|---|---|",
    ]
    table = "\n".join(head + rows) + "\n"
    print(table)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(table)


if __name__ == "__main__":
    main()
