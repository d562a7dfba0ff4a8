"""Sparse prefix-cache retention of window groups in the reference model (vLLM's
`prefix_cache_retention_interval`; docs/semantics.md, "Window retention"), written from
vLLM's rule rather than from the core's code: a window group caches a full block only where
a hit can read it, the window's blocks before a boundary a later hit can end at."""

from __future__ import annotations

from pagedkv.errors import InvalidArgumentError
from pagedkv.groups import KVCacheGroup


def check_interval(
    groups: tuple[KVCacheGroup, ...], block_size: int, interval: object
) -> int | None:
    if interval is None:
        return None
    if isinstance(interval, bool) or not isinstance(interval, int) or interval < 0:
        raise InvalidArgumentError(
            f"prefix_cache_retention_interval must be an int >= 0 or None, got {interval!r}"
        )
    if not any(g.kind == "sliding_window" for g in groups):
        if interval:
            raise InvalidArgumentError(
                f"prefix_cache_retention_interval {interval} applies to sliding-window "
                "groups and this layout has none: give 0 or None"
            )
        return interval
    if interval % block_size:
        raise InvalidArgumentError(
            f"prefix_cache_retention_interval {interval} must be 0, None or a multiple of "
            f"the block size {block_size}"
        )
    return interval


def caches(
    group: KVCacheGroup, block_size: int, interval: int | None, reachable: list[int], i: int
) -> bool:
    """Whether `group` caches full block `i` of a sequence whose hits can resume at the
    token positions `reachable`."""
    if interval is None or group.kind != "sliding_window":
        return True
    assert group.window is not None
    # A hit ending at boundary block `e` reads the blocks holding its last window - 1 tokens.
    need = -(-(group.window - 1) // block_size)
    ends = [p // block_size for p in reachable]
    if interval:
        per = interval // block_size
        ends.append((i // per + 1) * per)  # the next segment boundary above block i
    return any(e - need <= i < e for e in ends)
