"""`Scheduler`: vLLM's v1 scheduler building pagedkv's `KVCacheManager`.

vLLM's scheduler constructs its manager from the module-level name `KVCacheManager` in
`vllm.v1.core.sched.scheduler`; this subclass binds that name to pagedkv's manager for the
duration of its own construction only, so other schedulers in the process keep vLLM's.
"""

from __future__ import annotations

import threading
from typing import Any

import vllm.v1.core.sched.scheduler as _vllm_scheduler

from pagedkv.vllm.manager import KVCacheManager

# Construction rebinds a module global: one construction at a time.
_BUILDING = threading.Lock()


class Scheduler(_vllm_scheduler.Scheduler):
    """`--scheduler-cls pagedkv.vllm.Scheduler`: vLLM's scheduler over pagedkv's blocks."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        with _BUILDING:
            saved = _vllm_scheduler.KVCacheManager
            _vllm_scheduler.KVCacheManager = KVCacheManager  # type: ignore[misc,assignment]
            try:
                super().__init__(*args, **kwargs)
            finally:
                _vllm_scheduler.KVCacheManager = saved  # type: ignore[misc]


__all__ = ["Scheduler"]
