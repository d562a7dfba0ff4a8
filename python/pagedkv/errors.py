"""The exception hierarchy: every error pagedkv raises is a `PagedKVError`.

Each also subclasses the builtin that Python users reach for (`KeyError` for an unknown
sequence, `ValueError` for bad arguments), so existing `except` clauses keep working.
"""

from __future__ import annotations


class PagedKVError(Exception):
    """Root of every pagedkv error."""


class UnknownSequenceError(PagedKVError, KeyError):
    """A sequence id that the manager does not hold."""

    def __str__(self) -> str:
        # KeyError quotes its argument; a sentence reads better.
        return str(self.args[0]) if self.args else ""


class DuplicateSequenceError(PagedKVError, ValueError):
    """A sequence id that the manager already holds."""


class SequenceSwappedError(PagedKVError, ValueError):
    """An operation that needs a resident sequence got a swapped-out one."""


class SequenceNotSwappedError(PagedKVError, ValueError):
    """`swap_in` or `can_swap_in` got a sequence that is resident on the GPU."""


class RefcountOverflowError(PagedKVError, OverflowError):
    """An operation would give one block more holders than the refcount field can count."""


class ManagerBrokenError(PagedKVError, RuntimeError):
    """An internal invariant failed mid-operation; the manager refuses further changes."""


class InvalidArgumentError(PagedKVError, ValueError):
    """Bad input: wrong dtype or shape, empty, negative, out of range, mismatched lengths."""


class InvalidArgumentTypeError(InvalidArgumentError, TypeError):
    """An argument of the wrong kind (a float for an int, a generator for a sequence): both an
    `InvalidArgumentError` and the `TypeError` Python code expects for a wrong type."""


class KVEventsOverflowError(PagedKVError, RuntimeError):
    """The bounded KV event queue overflowed: events were lost, so `drain_events` refuses
    until `kv_event_snapshot()` gives the consumer the cached set to start again from."""


class EvictionsNotDeliveredError(PagedKVError, RuntimeError):
    """Some evictions of a call could not be appended to its `evicted=` list (out of memory):
    the call itself went through (its state change stands). Each is still a duty to copy
    out: `evicted` holds those not appended (`(block, group, digest)`, in order; the others
    are in the caller's list), `result` the call's return value (copy pairs included; the
    core's form: lists and tuples, not arrays) or None, and `error` the call's own exception
    when it raised (else None). The append's failure is the `__cause__`."""

    evicted: list[tuple[int, int, bytes]]
    result: object
    error: BaseException | None


class KVEventPayloadError(InvalidArgumentError):
    """A KV event payload a router index cannot apply (`pagedkv.router`): not vLLM's
    msgpack `KVEventBatch`, or block hashes of another form or width than the index holds."""


class InvariantError(PagedKVError, AssertionError):
    """`check_invariants` found the lifecycle contract broken."""


__all__ = [
    "DuplicateSequenceError",
    "EvictionsNotDeliveredError",
    "InvalidArgumentError",
    "InvalidArgumentTypeError",
    "InvariantError",
    "KVEventPayloadError",
    "KVEventsOverflowError",
    "ManagerBrokenError",
    "PagedKVError",
    "RefcountOverflowError",
    "SequenceNotSwappedError",
    "SequenceSwappedError",
    "UnknownSequenceError",
]
