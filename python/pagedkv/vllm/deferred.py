"""Deferred decode steps: the adapter's one-token steps answered at once, applied in a batch.

vLLM's scheduler asks for slots one running request at a time, with its own bookkeeping in
between, so each call finds pagedkv's record and sequence of that request cold. Most decode
steps write one token into a slot the request already holds: their answer ("no new block")
is known before the step. `new_step_starts` plans those steps for every request in one pass
(`pagedkv._core.DeferredDecodes.prime`), `allocate_slots` answers a planned call at once
and queues it (`take`), and the queued tokens are appended in one pass (`apply`).

No call may observe a sequence without a step already answered: `settled_first` wraps every
public method and property of the manager (and its `core`) so that it settles the queue
first, and a method added later is wrapped too. Left out: `allocate_slots` (which applies
the queue itself before its general path), `new_step_starts` (which primes), and the few
methods listed in `INDEPENDENT`, which no deferred step can change the answer of.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

# The methods that handle the queue themselves.
SETTLES_ITSELF = frozenset({"allocate_slots", "new_step_starts"})

# Methods that read and change nothing a deferred step changes (a sequence's tokens, its
# scheduled count, the used slots, the adapter's records, the cached blocks): a deferred
# step adds no block, copies none and emits no event (one that registers its full block's
# key is planned only while no events are published), so these answer the same either way,
# and the queue waits for the next step's `prime`, which applies it in the same pass.
INDEPENDENT = frozenset(
    {
        "take_events",
        "take_new_block_ids",
        "take_kv_cache_block_copies",
        "take_boundary_state_offloads",
        "make_prefix_cache_stats",
        "prefix_cache_lookup_enabled",
        "record_prefix_cache_stats",
        "create_kv_cache_blocks",
    }
)

T = TypeVar("T")


def _settling(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def settled(self: Any, *args: Any, **kwargs: Any) -> Any:
        self._deferred.settle()
        return fn(self, *args, **kwargs)

    settled.__settles__ = True  # type: ignore[attr-defined]
    return settled


def settled_first(cls: type[T]) -> type[T]:
    """Make every public method and property of `cls` settle the deferred steps first (the
    instance's `_deferred`), except `SETTLES_ITSELF` and `INDEPENDENT`."""
    for name, attr in list(vars(cls).items()):
        if name.startswith("_") or name in SETTLES_ITSELF or name in INDEPENDENT:
            continue
        if isinstance(attr, property):
            assert attr.fget is not None
            setattr(
                cls,
                name,
                property(
                    _settling(attr.fget),
                    None if attr.fset is None else _settling(attr.fset),
                    None,
                    attr.__doc__,
                ),
            )
        elif callable(attr) and not isinstance(attr, (type, staticmethod, classmethod)):
            setattr(cls, name, _settling(attr))
    return cls


def settles(cls: type, name: str) -> bool:
    """Whether `cls.name` settles the deferred steps first (for tests)."""
    attr = vars(cls).get(name)
    if isinstance(attr, property):
        attr = attr.fget
    return bool(getattr(attr, "__settles__", False))


__all__ = ["INDEPENDENT", "SETTLES_ITSELF", "settled_first", "settles"]
