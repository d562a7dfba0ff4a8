"""Which scheduling loop runs a replay, and the glue of the Rust one.

`scheduler.run_workload` replays a workload with the Python scheduler (`scheduler._Scheduler`,
the reference) or with the same loop in Rust (pagedkv-sim's `sched_loop`, through
`pagedkv._core.schedule_replay`), which drives the core manager directly and makes the same
manager calls with the same arguments in the same order (tests/sim/test_sim_rust_loop.py
checks it call for call). The Rust loop runs a replay only when every option is in its scope
(`rust_loop_blocker` names the first one that is not): chunked prefill, the Rust manager
itself (not the reference model, not a wrapper; hybrid KV-cache groups included), parallel
samples but no beams, no speculative decoding, no aborts, no tiers, no `--check` record, no
fork copies, no per-step Python callback but `progress`, a `watch` that is a
`FastMRCRecorder` (or a `FanOut` of them: their streams are fed from Rust) and an `until`
that is a sizing check's `StopRule` (it states its test as data, `stop_limits()`, which the
loop evaluates after every step).
docs/scheduling-loop.md lists which options take which loop. This module imports neither the
scheduler nor the stop rule's module (the scheduler imports it: `sim/` has no import circle).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pagedkv import _core
from pagedkv.sim.block_keys import root
from pagedkv.sim.fan_out import FanOut
from pagedkv.sim.mrc_fast import FastMRCRecorder
from pagedkv.sim.requests import Request, Workload


def _streams(watch: object) -> list[Any] | None:
    """The Rust streams behind `watch`, or None if any observer is Python."""
    if watch is None:
        return []
    if type(watch) is FastMRCRecorder:
        return [watch._stream]
    if type(watch) is FanOut:
        out: list[Any] = []
        for o in watch.observers:
            got = _streams(o)
            if got is None:
                return None
            out += got
        return out
    return None


def rust_loop_blocker(manager: object, workload: Workload, **options: Any) -> str | None:
    """The first reason the Rust loop cannot replay `workload` with `run_workload`'s
    `options`, or None when it can."""
    from pagedkv.manager import BlockManager

    if type(manager) not in (BlockManager, _core.BlockManager):
        return "the manager is not the Rust BlockManager itself"
    if options.get("max_num_batched_tokens") is None:
        return "whole prompts (no chunked prefill)"
    checks = (
        ("spec_tokens", "speculative decoding"),
        ("abort_rate", "aborts"),
        ("check", "--check's record of scheduled blocks"),
        ("tiers", "tiers"),
        ("fork_copies", "fork copies"),
        ("observe", "an observe() callback"),
        ("after_step", "an after_step() callback"),
        ("before_step", "a before_step() callback"),
    )
    for name, what in checks:
        if options.get(name):
            return what
    if _streams(options.get("watch")) is None:
        return "a Python schedule observer"
    until = options.get("until")
    if until is not None and not callable(getattr(until, "stop_limits", None)):
        return "an until() callback other than a sizing check's StopRule"
    if any(r.beam_width > 1 for r in workload.requests):
        return "beam search"
    return None


def _request(r: Request, roots: dict[str | None, int], watched: bool) -> tuple[Any, ...]:
    salt = r.cache_salt
    if watched and salt not in roots:
        roots[salt] = root(salt, None)
    key = roots[salt] if watched else 0
    return (
        r.request_id,
        r.prompt_tokens,
        r.hash_ids,
        r.hash_block_tokens,
        r.prompt_len,
        r.max_new_tokens,
        r.num_samples,
        salt,
        key,
        r.arrival_step,
        r.after,
        r.delay,
    )


def run_rust_loop(
    manager: Any,
    workload: Workload,
    *,
    max_batch: int,
    max_num_batched_tokens: int,
    long_prefill_token_threshold: int,
    skip_sure_checks: bool,
    record: bool,
    progress: Callable[[int, int], None] | None,
    watch: object,
    until: Any,
) -> dict[str, Any]:
    """The replay on the Rust loop (the caller checked `rust_loop_blocker`):
    `{"counters", "series", "log"}` (`_core.schedule_replay`'s answer), `SimResult`'s
    figures by name."""
    streams = _streams(watch)
    assert streams is not None
    roots: dict[str | None, int] = {}
    requests = [_request(r, roots, bool(streams)) for r in workload.requests]
    out: dict[str, Any] = _core.schedule_replay(
        manager,
        requests,
        max_batch=max_batch,
        max_num_batched_tokens=max_num_batched_tokens,
        long_prefill_token_threshold=long_prefill_token_threshold,
        skip_sure_checks=skip_sure_checks,
        record=record,
        watches=streams,
        progress=progress,
        stop=None if until is None else until.stop_limits(),
    )
    return out


__all__ = ["run_rust_loop", "rust_loop_blocker"]
