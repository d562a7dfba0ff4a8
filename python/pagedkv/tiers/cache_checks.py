"""Checks and error notes of `TieredCache` (`tiers.cache`): its arguments, and the pool it
is given against its manager."""

from __future__ import annotations

import traceback
from collections.abc import Sequence
from typing import Any

import numpy as np

from pagedkv.errors import InvalidArgumentError
from pagedkv.groups import KVCacheGroup


def tokens_arg(value: object, n: int) -> int:
    """`num_new_tokens`, checked as the manager checks it (1..n)."""
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise InvalidArgumentError(f"num_new_tokens must be an int, got {value!r}")
    if not 1 <= value <= n:
        raise InvalidArgumentError(f"num_new_tokens must be in 1..{n}, got {value}")
    return int(value)


def note(exc: BaseException, what: str, other: BaseException) -> None:
    """Add `other` (with its traceback) to `exc` as a note: `exc` stays the one raised and
    neither is lost."""
    text = "".join(traceback.format_exception(other)).rstrip()
    exc.add_note(f"pagedkv.tiers: {what}:\n{text}")


def _shape(groups: Sequence[KVCacheGroup]) -> list[tuple[str, int | None, int | None]]:
    return [(g.kind, g.window, g.chunk) for g in groups]


def check_pool_groups(groups: Sequence[KVCacheGroup] | None, pool: Any, null: bool) -> None:
    """The pool must have the manager's null block (one rule: `groups.has_null_block`) and,
    where it knows its groups, the manager's groups."""
    if bool(pool.null_block) != null:
        raise InvalidArgumentError(
            f"the pool {'has' if pool.null_block else 'has no'} null block but the manager "
            f"{'has one' if null else 'has none'}: build both with the same groups= (block 0 "
            "is the null block exactly when some group is not full attention)"
        )
    layout = getattr(pool, "layout", None)
    mine = getattr(layout, "groups", None) if layout is not None else getattr(pool, "groups", None)
    if mine is not None and groups is not None and _shape(mine) != _shape(groups):
        raise InvalidArgumentError(
            f"the pool's groups {_shape(mine)} are not the manager's {_shape(groups)}"
        )


__all__ = ["check_pool_groups", "note", "tokens_arg"]
