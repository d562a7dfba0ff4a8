"""Where pagedkv's manager time goes inside vLLM's scheduler step, by kind of call.

    python benches/vllm_step_split.py [--running 1024] [--steps 60]

Builds the running batch of `test_bench_vllm_step.py` (all decoding), then times decode steps
with pagedkv's manager only, each call's wall time added to its kind:

- `planned`: `allocate_slots` of a step planned at the step's start (answered from Python);
- `general, none new`: `allocate_slots` on the general path that added no block;
- `general, new block`: `allocate_slots` on the general path that added a block;
- `step start`: `new_step_starts` (the taken steps moved on, the runs that ended applied,
  the records without a run planned: `DeferredDecodes.prime`);
- `other`: every other public method.

The garbage collector is off while timing. Per kind: milliseconds a step, calls a step and
microseconds a call. The split is for finding the cost, not for comparing with vLLM: the
ratio to vLLM's manager is `vllm_step_share.py`'s.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "benches"), str(ROOT / "tests" / "support"), str(ROOT / "testing")]

import vllm_env  # noqa: E402

vllm_env.prepare()

import test_bench_vllm_step as bench  # noqa: E402
from vllm_scheduler import step  # noqa: E402
from vllm_step_share import METHODS  # noqa: E402

# The methods timed as "other": every one `vllm_step_share.py` times but the two split out.
OTHER = tuple(m for m in METHODS if m not in ("allocate_slots", "new_step_starts"))


def _instrument(cls: type, spent: dict[str, list[float]]) -> None:
    """Wrap the class's methods so that each call's time is added to its kind."""

    def add(kind: str, seconds: float) -> None:
        spent[kind][0] += seconds
        spent[kind][1] += 1

    allocate = cls.allocate_slots  # type: ignore[attr-defined]

    def allocate_slots(self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
        planned = request.request_id in self._planned
        t = time.perf_counter()
        out = allocate(self, request, *args, **kwargs)
        seconds = time.perf_counter() - t
        if planned:
            add("planned", seconds)
        elif out is self.empty_kv_cache_blocks:
            add("general, none new", seconds)
        else:
            add("general, new block", seconds)
        return out

    starts = cls.new_step_starts  # type: ignore[attr-defined]

    def new_step_starts(self: Any) -> None:
        t = time.perf_counter()
        starts(self)
        add("step start", time.perf_counter() - t)

    cls.allocate_slots = allocate_slots  # type: ignore[attr-defined]
    cls.new_step_starts = new_step_starts  # type: ignore[attr-defined]
    for name in OTHER:
        fn = getattr(cls, name, None)
        if fn is None:
            continue

        def other(self: Any, *args: Any, _fn: Any = fn, **kwargs: Any) -> Any:
            t = time.perf_counter()
            try:
                return _fn(self, *args, **kwargs)
            finally:
                add("other", time.perf_counter() - t)

        setattr(cls, name, other)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--running", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=60)
    args = parser.parse_args()
    scheduler = bench._running("pagedkv", args.running)
    spent: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    _instrument(type(scheduler.kv_cache_manager), spent)
    gc.collect()
    gc.disable()
    for _ in range(5):
        step(scheduler)
    spent.clear()
    t = time.perf_counter()
    for _ in range(args.steps):
        step(scheduler)
    wall = time.perf_counter() - t
    gc.enable()
    n = args.steps
    print(f"{'kind':>20} {'ms/step':>8} {'calls/step':>11} {'us/call':>8}")
    for kind, (seconds, calls) in sorted(spent.items(), key=lambda kv: -kv[1][0]):
        print(
            f"{kind:>20} {seconds / n * 1e3:8.3f} {calls / n:11.1f} "
            f"{seconds / max(calls, 1) * 1e6:8.2f}"
        )
    total = sum(seconds for seconds, _ in spent.values())
    print(f"{'manager':>20} {total / n * 1e3:8.3f}")
    print(f"{'step':>20} {wall / n * 1e3:8.3f}")


if __name__ == "__main__":
    main()
