"""How much of vLLM's scheduler step is the KV-cache manager, for vLLM's and pagedkv's.

    python benches/vllm_step_share.py [--running 64 256 1024] [--steps 50] [--churn K]

Builds the same running batch as `test_bench_vllm_step.py` (shared 512-token system prompts,
64 tokens each of their own, all prefilled), then times decode steps, alternating the two
managers step by step so that both see the same machine load, and accumulates the time
spent inside the manager's methods (every public method, wrapped with a timer). It prints,
per size and manager, the median step, the median time inside the manager and the rest
(vLLM's scheduler itself): the rest is the floor no manager can go below.

`--churn K`: before each step, K running requests (the same ones for both managers) are
aborted and K new ones arrive (a shared system prompt and 64 tokens of their own), so each
step also frees, looks up and admits, as a serving engine's steps do.

The timer's own cost inside the timed window (the wrapper's call of the method with `*args,
**kwargs` and the clock reads, about 0.2 us a call) is charged to the manager it wraps; both
managers make about one call per running request a step, so it weighs more on the faster
one. It is measured in the same process, the same wrapper timing a method that does nothing
(a hot no-op, the least of 15 rounds), and the corrected columns subtract it once per call. Both
the raw and the corrected ratios are printed.
"""

from __future__ import annotations

import argparse
import random
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
    """Wrap the manager's public methods: `spent[0]` adds their time, `spent[1]` counts calls."""
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
                spent[1] += 1

        setattr(manager, name, wrapper)


class _NoOp:
    """A manager whose one method does nothing: the timer's own cost per call."""

    def allocate_slots(self, *args: Any, **kwargs: Any) -> None:
        return None


def _timer_cost(calls: int = 20_000, rounds: int = 15) -> float:
    """Seconds the wrapper adds to a call's timed window, called as vLLM's scheduler calls
    `allocate_slots`: the least of `rounds` (other jobs on the machine only add to it, so the
    least is the surest not to overcorrect)."""
    noop = _NoOp()
    spent = [0.0, 0]
    _timed(noop, spent)
    fn = noop.allocate_slots
    costs = []
    for _ in range(rounds):
        spent[0], spent[1] = 0.0, 0
        for _ in range(calls):
            fn(noop, 1, num_lookahead_tokens=0)
        costs.append(spent[0] / spent[1])
    return min(costs)


def _churn(scheduler: Any, k: int, rng: random.Random, serial: list[int]) -> None:
    """Abort `k` running requests and add `k` new ones (the same for a same-seeded `rng`)."""
    from vllm.v1.request import RequestStatus

    running = sorted(r.request_id for r in scheduler.running)
    scheduler.finish_requests(
        rng.sample(running, min(k, len(running))), RequestStatus.FINISHED_ABORTED
    )
    systems = [p[: bench.SYSTEM] for p in bench._prompts(4)]
    for _ in range(k):
        serial[0] += 1
        own = [rng.randrange(1, 50_000) for _ in range(bench.OWN)]
        scheduler.add_request(bench._request(f"new-{serial[0]}", systems[serial[0] % 4] + own))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--running", type=int, nargs="+", default=[64, 256, 1024])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--churn", type=int, default=0)
    args = parser.parse_args()
    cost = _timer_cost()
    print(f"timer cost inside the window: {cost * 1e6:.3f} us a call (hot no-op, least of 15)")
    print(
        f"{'running':>8} {'manager':>8} {'step ms':>9} {'in manager ms':>14} {'rest ms':>8}"
        f" {'calls':>7} {'corrected ms':>13}"
    )
    for n in args.running:
        runs = {}
        for which in ("vllm", "pagedkv"):
            scheduler = bench._running(which, n)
            spent = [0.0, 0]
            _timed(scheduler.kv_cache_manager, spent)
            runs[which] = (scheduler, spent, [], [], [], random.Random(n), [0])
        for _ in range(args.steps):
            for scheduler, spent, steps, inside, calls, rng, serial in runs.values():
                before, called = spent[0], spent[1]
                t = time.perf_counter()
                if args.churn:
                    _churn(scheduler, args.churn, rng, serial)
                step(scheduler)
                steps.append(time.perf_counter() - t)
                inside.append(spent[0] - before)
                calls.append(spent[1] - called)
        med = {}
        for which, (_, _, steps, inside, calls, _, _) in runs.items():
            s = statistics.median(steps) * 1e3
            m = statistics.median(inside) * 1e3
            c = statistics.median(calls)
            corrected = statistics.median(i - k * cost for i, k in zip(inside, calls, strict=True))
            med[which] = (m, corrected * 1e3)
            print(
                f"{n:>8} {which:>8} {s:>9.2f} {m:>14.2f} {s - m:>8.2f} {c:>7.0f}"
                f" {corrected * 1e3:>13.2f}"
            )
        raw = med["pagedkv"][0] / med["vllm"][0]
        fixed = med["pagedkv"][1] / med["vllm"][1]
        print(f"{n:>8} pagedkv / vllm manager time: {raw:.3f} raw, {fixed:.3f} timer corrected")


if __name__ == "__main__":
    main()
