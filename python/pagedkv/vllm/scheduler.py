"""`Scheduler` and `AsyncScheduler`: vLLM's v1 schedulers building pagedkv's `KVCacheManager`.

vLLM's scheduler constructs its manager from the module-level name `KVCacheManager` in
`vllm.v1.core.sched.scheduler`; these subclasses bind that name to pagedkv's manager for the
duration of their own construction only, so other schedulers in the process keep vLLM's.
`--scheduler-cls pagedkv.vllm.Scheduler`, or `pagedkv.vllm.AsyncScheduler` with
`--async-scheduling` (vLLM picks its own async class only when no class is given).
"""

from __future__ import annotations

import threading
from typing import Any

import vllm.v1.core.sched.scheduler as _vllm_scheduler
from vllm.v1.core.sched.async_scheduler import AsyncScheduler as _VllmAsyncScheduler

from pagedkv.vllm.manager import KVCacheManager

# Construction rebinds a module global: one construction at a time.
_BUILDING = threading.Lock()


def _build(init: Any, this: Any, args: Any, kwargs: Any) -> None:
    with _BUILDING:
        saved = _vllm_scheduler.KVCacheManager
        _vllm_scheduler.KVCacheManager = KVCacheManager
        try:
            init(this, *args, **kwargs)
        finally:
            _vllm_scheduler.KVCacheManager = saved


class Scheduler(_vllm_scheduler.Scheduler):
    """`--scheduler-cls pagedkv.vllm.Scheduler`: vLLM's scheduler over pagedkv's blocks."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        _build(_vllm_scheduler.Scheduler.__init__, self, args, kwargs)


class AsyncScheduler(_VllmAsyncScheduler):
    """vLLM's asynchronous scheduler (`--async-scheduling`) over pagedkv's blocks."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        _build(_VllmAsyncScheduler.__init__, self, args, kwargs)


__all__ = ["AsyncScheduler", "Scheduler"]
