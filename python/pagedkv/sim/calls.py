"""Timed manager calls, and the replay of a recorded list of calls.

The scheduler makes every manager call through `TimedCalls`, which adds the time spent inside
the call to a nanosecond counter and, with `record=True`, keeps the call and its answer, so
that a benchmark can replay exactly the same calls on another manager with no scheduler in the
way (`bind_trace` + `replay_trace`), and a test can compare the answers (`same_result`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

Call = tuple[str, tuple[Any, ...], dict[str, Any]]
BoundCall = tuple[Any, tuple[Any, ...], dict[str, Any]]


class TimedCalls:
    """Calls the manager, timing each call and optionally recording it."""

    __slots__ = ("calls", "manager", "ns", "results", "trace")

    def __init__(self, manager: object, record: bool) -> None:
        self.manager = manager
        self.ns = 0
        self.calls = 0
        self.trace: list[Call] | None = [] if record else None
        self.results: list[Any] | None = [] if record else None

    def __call__(self, name: str, *args: Any, **kwargs: Any) -> Any:
        fn = getattr(self.manager, name)
        t0 = time.perf_counter_ns()
        out = fn(*args, **kwargs)
        self.ns += time.perf_counter_ns() - t0
        self.calls += 1
        if self.trace is not None and self.results is not None:
            self.trace.append((name, args, kwargs))
            self.results.append(out)
        return out

    def timed(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Call `fn` (a call made through the manager, such as the tiers' allocate), timed
        as one manager call; not recorded (a trace replays plain manager calls)."""
        t0 = time.perf_counter_ns()
        out = fn(*args, **kwargs)
        self.ns += time.perf_counter_ns() - t0
        self.calls += 1
        return out


def bind_trace(manager: object, trace: Sequence[Call]) -> list[BoundCall]:
    """Resolve a recorded trace's method names on `manager` (done once, before timing)."""
    return [(getattr(manager, name), args, kwargs) for name, args, kwargs in trace]


def replay_trace(bound: Sequence[BoundCall]) -> None:
    """Make every recorded call again, in order (see `bind_trace`)."""
    for fn, args, kwargs in bound:
        fn(*args, **kwargs)


def same_result(a: Any, b: Any) -> bool:
    """Whether two managers' answers to the same call agree (arrays compared by value)."""
    import numpy as np

    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return bool(np.array_equal(np.asarray(a), np.asarray(b)))
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return len(a) == len(b) and all(same_result(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


__all__ = ["BoundCall", "Call", "TimedCalls", "bind_trace", "replay_trace", "same_result"]
