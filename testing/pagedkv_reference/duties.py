"""Delivering a call's evictions to its `evicted=` list, as the binding does
(rust/python/src/evicted.rs; docs/semantics.md, "Duties"): each is a block the engine must
copy out, so none is lost silently."""

from __future__ import annotations

from typing import Any, TypeVar

import numpy as np

from pagedkv.errors import EvictionsNotDeliveredError

T = TypeVar("T")

Eviction = tuple[int, int, bytes]

# The list type's own append, never a subclass's method (tests replace it to make it fail).
_append = list.append


class Outcome:
    """What a block-taking call's body did: its return value (through `__call__`) or its
    exception."""

    def __init__(self) -> None:
        self.result: object = None
        self.error: BaseException | None = None

    def __call__(self, result: T) -> T:
        self.result = result
        return result


def _plain(x: Any) -> Any:
    """A result as the core gives it: arrays as lists of tuples or ints."""
    if isinstance(x, np.ndarray):
        return [tuple(r) for r in x.tolist()] if x.ndim == 2 else x.tolist()
    if isinstance(x, tuple):
        return tuple(_plain(v) for v in x)
    return x


def deliver(evicted: list[Eviction], items: list[Eviction], out: Outcome) -> None:
    """Append every eviction `items` to `evicted`; one that fails does not stop the rest.
    Raise `EvictionsNotDeliveredError` (the first failure its cause) with the ones not
    appended and the call's outcome if any failed."""
    lost: list[Eviction] = []
    cause: BaseException | None = None
    for item in items:
        try:
            _append(evicted, item)
        except Exception as e:  # any failure: this duty is reported below
            lost.append(item)
            cause = cause or e
    if cause is None:
        return
    err = EvictionsNotDeliveredError(
        f"{len(lost)} of the call's evictions could not be appended to evicted= ({cause}); "
        "the call's state change stands: copy them out from .evicted"
    )
    err.evicted = lost
    err.result = _plain(out.result)
    err.error = out.error
    raise err from cause
