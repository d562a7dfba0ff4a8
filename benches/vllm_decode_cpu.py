"""CPU time of the decode step's `allocate_slots` calls, vLLM's manager and pagedkv's, side by
side in one process.

    python benches/vllm_decode_cpu.py [--running 64 256 1024] [--steps 20] [--rounds 7]

`vllm_step_share.py` times each manager call with the wall clock, which on a shared machine
also counts the time other processes held the CPU. This script builds the same running batches
(`test_bench_vllm_step.py`: shared 512-token system prompts, 64 tokens each of their own, all
prefilled), then per round and manager runs `--steps` decode steps the way vLLM's scheduler
makes them: each request gets its sampled token (`append_output_token_ids`, untimed), then
`new_step_starts()` and `allocate_slots(request, 1, num_lookahead_tokens=0)` for every request,
the whole batch timed with the thread's CPU clock (one clock read per batch, not per call).
Rounds alternate the managers; it prints each round's microseconds per call and the median
ratio.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "benches"), str(ROOT / "tests" / "support"), str(ROOT / "testing")]

import vllm_env  # noqa: E402

vllm_env.prepare()

import test_bench_vllm_step as bench  # noqa: E402


def _round(scheduler: Any, steps: int) -> float:
    """Microseconds of thread CPU time per `allocate_slots` call over `steps` steps."""
    manager = scheduler.kv_cache_manager
    requests = list(scheduler.running)
    spent = 0.0
    for _ in range(steps):
        for r in requests:
            r.num_computed_tokens = r.num_tokens
            r.append_output_token_ids(7)
        t = time.thread_time()
        # vLLM's scheduler starts every step with this (pagedkv plans the step's decodes
        # and applies the last step's deferred ones there: manager time, so timed).
        manager.new_step_starts()
        for r in requests:
            if manager.allocate_slots(r, 1, num_lookahead_tokens=0) is None:
                raise RuntimeError("the pool is too small for the steps asked for")
        spent += time.thread_time() - t
    # The last step's deferred tokens are applied by the next start: timed too (its planning
    # is one step more than the round's, charged to pagedkv).
    t = time.thread_time()
    manager.new_step_starts()
    spent += time.thread_time() - t
    return spent / (steps * len(requests)) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--running", type=int, nargs="+", default=[64, 256, 1024])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    print(f"{'running':>8} {'manager':>8}  us per call (each round)")
    for n in args.running:
        schedulers = {which: bench._running(which, n) for which in ("vllm", "pagedkv")}
        gc.collect()
        per_call: dict[str, list[float]] = {which: [] for which in schedulers}
        for _ in range(args.rounds):
            for which, scheduler in schedulers.items():
                per_call[which].append(_round(scheduler, args.steps))
        for which, xs in per_call.items():
            print(f"{n:>8} {which:>8}  " + " ".join(f"{x:.2f}" for x in xs))
        ratios = [p / v for p, v in zip(per_call["pagedkv"], per_call["vllm"], strict=True)]
        v, p = statistics.median(per_call["vllm"]), statistics.median(per_call["pagedkv"])
        print(
            f"{n:>8}   median vLLM {v:.2f} us, pagedkv {p:.2f} us; "
            f"pagedkv/vLLM per round: median {statistics.median(ratios):.3f}, "
            f"max {max(ratios):.3f}"
        )
        del schedulers
        gc.collect()


if __name__ == "__main__":
    main()
