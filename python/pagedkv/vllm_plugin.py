"""vLLM general plugin: `PAGEDKV_VLLM_SCHEDULER=1` puts pagedkv's block manager under a stock
vLLM (`vllm serve`, `python -m vllm.entrypoints.openai.api_server`, `LLM(...)`) with no flag.

vLLM loads every `vllm.general_plugins` entry point in each of its processes (the front end,
the engine core, the workers) before it builds anything, and the engine core asks
`SchedulerConfig.get_scheduler_cls()` which scheduler to build. With the variable on,
`register` wraps that method: where vLLM would build its own `Scheduler` or
`AsyncScheduler` (no `--scheduler-cls` given), it gets `pagedkv.vllm.Scheduler` or
`pagedkv.vllm.AsyncScheduler`, chosen by the same `async_scheduling` flag. A scheduler
class named explicitly is a conflict and raises, naming both.

This module sits outside `pagedkv.vllm` on purpose: vLLM loads plugins early in every
process (workers included), and importing `pagedkv.vllm` imports vLLM's scheduler. Nothing
here imports vLLM until the variable is on, and with it unset `register` changes nothing.
"""

from __future__ import annotations

import os
from typing import Any

ENV = "PAGEDKV_VLLM_SCHEDULER"
_ON = ("1", "true", "yes", "on")
_OFF = ("", "0", "false", "no", "off")
# Set once `register` has wrapped vLLM's method in this process (vLLM may call it again).
_WRAPPED_ATTR = "_pagedkv_wrapped"


def enabled() -> bool:
    """Whether `PAGEDKV_VLLM_SCHEDULER` asks for pagedkv's scheduler; raises on a value that
    is neither on (1, true, yes, on) nor off (unset, empty, 0, false, no, off)."""
    value = os.environ.get(ENV, "").strip().lower()
    if value in _ON:
        return True
    if value in _OFF:
        return False
    raise ValueError(
        f"{ENV}={os.environ[ENV]!r}: expected 1/true/yes/on to use pagedkv's scheduler, "
        "or 0/false/no/off (or unset) for vLLM's"
    )


def register() -> None:
    """The `vllm.general_plugins` entry point (pyproject.toml). Does nothing unless
    `PAGEDKV_VLLM_SCHEDULER` is on."""
    if not enabled():
        return
    from vllm.config.scheduler import SchedulerConfig

    original = SchedulerConfig.get_scheduler_cls
    if getattr(original, _WRAPPED_ATTR, False):
        return

    def get_scheduler_cls(self: Any) -> Any:
        if self.scheduler_cls is not None:
            chosen = original(self)
            if not (chosen.__module__ or "").startswith("pagedkv."):
                raise ValueError(
                    f"{ENV} is on but a scheduler class is also given "
                    f"(scheduler_cls={self.scheduler_cls!r}): pagedkv's manager runs "
                    f"under vLLM's own Scheduler or AsyncScheduler only; unset {ENV} or "
                    "drop --scheduler-cls"
                )
            return chosen
        import pagedkv.vllm

        if self.async_scheduling:
            return pagedkv.vllm.AsyncScheduler
        return pagedkv.vllm.Scheduler

    setattr(get_scheduler_cls, _WRAPPED_ATTR, True)
    get_scheduler_cls.__doc__ = original.__doc__
    SchedulerConfig.get_scheduler_cls = get_scheduler_cls


__all__ = ["ENV", "enabled", "register"]
