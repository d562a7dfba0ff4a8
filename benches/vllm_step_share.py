"""How much of vLLM's scheduler step is the KV-cache manager, for vLLM's and pagedkv's.

    python benches/vllm_step_share.py [--running 64 256 1024] [--steps 50]

Builds the same running batch as `test_bench_vllm_step.py` (shared 512-token system prompts,
64 tokens each of their own, all prefilled), then times decode steps, alternating the two
managers step by step so that both see the same machine load, and accumulates the time
spent inside the manager's methods (every public method, wrapped with a timer). It prints,
per size and manager, the median step, the median time inside the manager and the rest
(vLLM's scheduler itself): the rest is the floor no manager can go below.
"""

from __future__ import annotations

import argparse
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
from vllm_scheduler import step  # noqa: E402

METHODS = (
    "allocate_slots",
    "get_computed_blocks",
    "free",
    "cache_blocks",
    "get_blocks",
    "get_block_ids",
    "take_events",
    "new_step_starts",
    "remove_skipped_blocks",
    "take_kv_cache_block_copies",
    "take_new_block_ids",
    "take_boundary_state_offloads",
    "make_prefix_cache_stats",
)


def _timed(manager: Any, spent: list[float]) -> None:
    for name in METHODS:
        fn = getattr(manager, name, None)
        if fn is None:
            continue

        def wrapper(*args: Any, _fn: Any = fn, **kwargs: Any) -> Any:
            t = time.perf_counter()
            try:
                return _fn(*args, **kwargs)
            finally:
                spent[0] += time.perf_counter() - t

        setattr(manager, name, wrapper)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--running", type=int, nargs="+", default=[64, 256, 1024])
    parser.add_argument("--steps", type=int, default=50)
    args = parser.parse_args()
    print(f"{'running':>8} {'manager':>8} {'step ms':>9} {'in manager ms':>14} {'rest ms':>8}")
    for n in args.running:
        runs = {}
        for which in ("vllm", "pagedkv"):
            scheduler = bench._running(which, n)
            spent = [0.0]
            _timed(scheduler.kv_cache_manager, spent)
            runs[which] = (scheduler, spent, [], [])
        for _ in range(args.steps):
            for scheduler, spent, steps, inside in runs.values():
                before = spent[0]
                t = time.perf_counter()
                step(scheduler)
                steps.append(time.perf_counter() - t)
                inside.append(spent[0] - before)
        for which, (_, _, steps, inside) in runs.items():
            s = statistics.median(steps) * 1e3
            m = statistics.median(inside) * 1e3
            print(f"{n:>8} {which:>8} {s:>9.2f} {m:>14.2f} {s - m:>8.2f}")


if __name__ == "__main__":
    main()
