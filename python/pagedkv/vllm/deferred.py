"""Deferred decode steps: the adapter's one-token steps answered at once, applied later.

vLLM's scheduler asks for slots one running request at a time, with its own bookkeeping in
between, so each call finds pagedkv's record and sequence of that request cold. Most decode
steps write one token into a slot the request already holds: their answer ("no new block")
is known before the step. `new_step_starts` plans, for each request, a run of those steps
to the end of its block (`pagedkv._core.DeferredDecodes.prime`); `allocate_slots` answers a
planned call at once and queues it (`taken`); each step's start plans the run's next step
and applies only the steps that hand over a key (in call order) and the runs that ended.

No call may observe a sequence without a step already answered. `settled_first` wraps every
public method and property of the manager (and its `core`) so that it settles first (every
answered step applied, every plan forgotten), and a method added later is wrapped too. Left
out: `SETTLES_ITSELF` (which apply what they need themselves), `INDEPENDENT` (which no
deferred step can change the answer of), and `OWN_FIRST`: the calls about one request that
read or change only its own record and sequence, the pool's counts and the cached blocks.
They need the steps that register a block applied (in call order) and the request's own
(`apply_for`), not the other runs' steps, which write into blocks their sequences alone
hold (never cached, never free) and register nothing; those runs go on.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

# The methods that handle the queue themselves: `free` applies its request's own steps
# (`DeferredDecodes.release`), the others' runs go on.
SETTLES_ITSELF = frozenset({"allocate_slots", "new_step_starts", "free", "pop_blocks_for_free"})

# The calls about one request (a `Request`, or a request id, first) that read or change only
# its record and sequence, the pool's counts and the cached blocks: the steps that register
# a block applied first, and the request's own; the other runs go on.
OWN_FIRST = frozenset(
    {
        "get_computed_blocks",
        "get_num_cached_tokens",
        "get_blocks",
        "get_block_ids",
        "get_block_ids_for_computed_tokens",
        "num_cached_blocks",
        "estimate_cached_tokens",
    }
)

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


def _own_first(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def own_applied(self: Any, *args: Any, **kwargs: Any) -> Any:
        first = args[0] if args else kwargs.get("request", kwargs.get("request_id"))
        rid = first if isinstance(first, str) else getattr(first, "request_id", None)
        if isinstance(rid, str):
            self._deferred.apply_for(self._seqs.get(rid))
        else:
            self._deferred.settle()  # not a request it can tell: everything, as any call
        return fn(self, *args, **kwargs)

    own_applied.__settles__ = "own"  # type: ignore[attr-defined]
    return own_applied


def settled_first(cls: type[T]) -> type[T]:
    """Make every public method and property of `cls` settle the deferred steps first (the
    instance's `_deferred`), except `SETTLES_ITSELF` and `INDEPENDENT`; `OWN_FIRST`
    applies the steps that register a block and the request's own first."""
    for name, attr in list(vars(cls).items()):
        if name.startswith("_") or name in SETTLES_ITSELF or name in INDEPENDENT:
            continue
        if name in OWN_FIRST:
            setattr(cls, name, _own_first(attr))
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


def settles(cls: type, name: str) -> bool | str:
    """Whether `cls.name` settles the deferred steps first (for tests): True, False, or
    "own" (`OWN_FIRST`)."""
    attr = vars(cls).get(name)
    if isinstance(attr, property):
        attr = attr.fget
    found = getattr(attr, "__settles__", False)
    return found if found == "own" else bool(found)


__all__ = ["INDEPENDENT", "OWN_FIRST", "SETTLES_ITSELF", "settled_first", "settles"]
