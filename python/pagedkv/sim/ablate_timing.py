"""The ablations' manager time: the run's calls recorded, then replayed on a fresh manager and
timed in CPU time, best of N (`sim.ablate`).

Timing the calls inside a run measures the wall clock of a machine that may be busy with
other work: on a shared machine two identical runs differed by 2x. So a run records every
manager call it makes (`CallLog`, the reclaim window's `evict_blocks` included), and the
calls are made again, in order, on a fresh manager built from the same configuration (the
manager is deterministic, so every call meets the state it met in the run), with no
scheduler in the way, timed by the thread's CPU clock (`time.thread_time_ns`: time the
thread was descheduled does not count), the least of `repeats` replays kept (noise only
adds). Two replays each time: one timing the whole replay, one timing each `allocate` call
(so the per-call clock reads do not weigh on the total).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from pagedkv.config import BlockManagerConfig
from pagedkv.sim.calls import Call, bind_trace
from pagedkv.sim.factory import make_manager

# Read-only calls the simulator makes for its own bookkeeping, not the manager's work.
_NOT_LOGGED = frozenset({"block_tables", "stats", "check_invariants", "block_table"})


class CallLog:
    """The manager, with every call it is asked to make written down (`calls`)."""

    def __init__(self, manager: Any) -> None:
        self._m = manager
        self.calls: list[Call] = []

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._m, name)
        if not callable(attr) or name in _NOT_LOGGED:
            return attr
        calls = self.calls

        def logged(*args: Any, **kwargs: Any) -> Any:
            calls.append((name, args, kwargs))
            return attr(*args, **kwargs)

        return logged


@dataclass(frozen=True, slots=True)
class Timing:
    seconds: float  # the whole replay, CPU time
    allocate_seconds: float  # the allocate calls alone
    allocate_calls: int
    calls: int

    @property
    def allocate_mean_seconds(self) -> float | None:
        return self.allocate_seconds / self.allocate_calls if self.allocate_calls else None


def replay_cpu(config: BlockManagerConfig, calls: list[Call], repeats: int) -> Timing:
    """The least CPU time of `repeats` replays of `calls` on fresh managers."""
    best_total = best_alloc = float("inf")
    n_alloc = sum(1 for name, _, _ in calls if name == "allocate")
    for _ in range(max(1, repeats)):
        bound = bind_trace(make_manager(config), calls)
        t0 = time.thread_time_ns()
        for fn, args, kwargs in bound:
            fn(*args, **kwargs)
        best_total = min(best_total, time.thread_time_ns() - t0)
        bound = bind_trace(make_manager(config), calls)
        alloc = 0
        for (name, _, _), (fn, args, kwargs) in zip(calls, bound, strict=True):
            if name == "allocate":
                t0 = time.thread_time_ns()
                fn(*args, **kwargs)
                alloc += time.thread_time_ns() - t0
            else:
                fn(*args, **kwargs)
        best_alloc = min(best_alloc, alloc)
    return Timing(best_total / 1e9, best_alloc / 1e9, n_alloc, len(calls))


__all__ = ["CallLog", "Timing", "replay_cpu"]
