"""The hybrid prefix hit of a manager with KV-cache groups (docs/semantics.md, "The hybrid
prefix hit").

A hit of `L` blocks is *servable by group g* when every block `g` still needs at position
`L * B` is cached: blocks `first_needed(g, L) .. L - 1`. The hit is the largest `L` up to the
cap that every group can serve, found as vLLM's hybrid coordinator finds it: start at the
cap and let each group in turn lower `L` to the largest length it can serve, until a whole
round lowers nothing. Pure functions over "is block i of group g cached?", so the reference
manager and tests share one definition.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from pagedkv.groups import KVCacheGroup


def first_needed(
    group: KVCacheGroup, length: int, block_size: int, loaded: int = 0, limit: int | None = None
) -> int:
    """`a_g(L)`: the first block a hit of `length` blocks needs in this group. The blocks
    before it are skipped where the sequence resumes: at `length * block_size`, or past
    `loaded` tokens whose KV a load brings (at most `limit`, the prompt's length); their
    entries are the null block."""
    at = length * block_size
    position = at + loaded if limit is None else max(at, min(at + loaded, limit))
    return min(group.skipped_tokens(position) // block_size, length)


def _runs(cached: Sequence[bool]) -> list[int]:
    """`runs[i]`: how many consecutive cached blocks end at block `i` (0 if `i` is not)."""
    runs: list[int] = []
    for i, c in enumerate(cached):
        runs.append((runs[i - 1] + 1 if i else 1) if c else 0)
    return runs


def _servable(
    group: KVCacheGroup,
    runs: list[int],
    length: int,
    block_size: int,
    resume: tuple[int, int | None],
) -> bool:
    """Are blocks `first_needed .. length - 1` all cached? (Always so for length 0, and for
    a length where the group needs no block, such as a chunk boundary.)"""
    needed = length - first_needed(group, length, block_size, *resume)
    return needed == 0 or runs[length - 1] >= needed


def largest_servable(
    group: KVCacheGroup,
    runs: list[int],
    upto: int,
    block_size: int,
    resume: tuple[int, int | None] = (0, None),
) -> int:
    """The largest length `<= upto` this group can serve (0 at worst); `resume`: the
    loaded tokens and the prompt's length (`first_needed`)."""
    for length in range(upto, 0, -1):
        if _servable(group, runs, length, block_size, resume):
            return length
    return 0


def hybrid_hit(
    groups: Sequence[KVCacheGroup],
    block_size: int,
    cap: int,
    cached: Callable[[int, int], bool],
    resume: tuple[int, int | None] = (0, None),
) -> int:
    """The hit in blocks: the largest `L <= cap` every group can serve, where
    `cached(g, i)` says whether block `i` of the prompt is in the index for group `g`.

    The fixed point is that largest common length: no group ever lowers `L` below a length
    every group serves, and a round that lowers nothing leaves a length all of them serve.
    """
    runs = [_runs([cached(g, i) for i in range(cap)]) for g in range(len(groups))]
    length = cap
    while True:
        before = length
        for g, group in enumerate(groups):
            length = largest_servable(group, runs[g], length, block_size, resume)
        if length == before:
            return length


__all__ = ["first_needed", "hybrid_hit", "largest_servable"]
