"""Sparse prefix-cache retention of window groups (`prefix_cache_retention_interval`,
`allocate(reachable_tokens=)`; docs/semantics.md, "Window retention"): which full blocks a
window group caches, and the settings it refuses. The groups model-based test checks the
same rule against the reference on random call sequences."""

from __future__ import annotations

import pytest

import pagedkv
from pagedkv import KVCacheGroup
from pagedkv.config import BlockManagerConfig
from pagedkv.errors import InvalidArgumentError

BS = 4
# A window of 8 tokens reads the 2 blocks before a boundary (cdiv(8 - 1, 4)).
GROUPS = [KVCacheGroup("full"), KVCacheGroup("sliding_window", window=8)]
PROMPT = list(range(24))  # 6 full blocks


def registered(interval: int | None, **allocate: object) -> tuple[int, int]:
    """(full, window) blocks the prompt's allocation registers."""
    m = pagedkv.BlockManager(32, BS, groups=GROUPS, prefix_cache_retention_interval=interval)
    assert m.allocate(0, PROMPT, **allocate) == 0
    full, window = m.stats().groups
    return full.registered_blocks, window.registered_blocks


@pytest.mark.parametrize(
    ("interval", "allocate", "window"),
    [
        (None, {}, 6),  # dense: every full block
        (0, {}, 2),  # the tail before 20 (the prompt less one token, 23): blocks 3, 4
        (0, {"reachable_tokens": [23, 8]}, 4),  # and before 8: blocks 0, 1
        (0, {"reachable_tokens": [3]}, 0),  # a boundary at 0 reads nothing
        (16, {}, 3),  # and every 16-token segment's tail (blocks 2, 3): 2, 3, 4
        (8, {}, 6),  # a segment no longer than the tail: every block
    ],
)
def test_a_window_group_caches_the_blocks_a_later_hit_reads(
    interval: int | None, allocate: dict[str, object], window: int
) -> None:
    assert registered(interval, **allocate) == (6, window)


def test_a_later_hit_finds_the_retained_tail() -> None:
    """A resend of the prompt hits all but its last block: the window blocks before it were
    kept; a prompt sharing only its first three blocks misses (blocks 1, 2 were not)."""
    m = pagedkv.BlockManager(32, BS, groups=GROUPS, prefix_cache_retention_interval=0)
    m.allocate(0, PROMPT)
    m.free(0)
    assert m.allocate(1, PROMPT) == 20
    assert m.allocate(2, [*PROMPT[:12], 99, 99, 99, 99, 99]) == 0
    dense = pagedkv.BlockManager(32, BS, groups=GROUPS)
    dense.allocate(0, PROMPT)
    dense.free(0)
    assert dense.allocate(2, [*PROMPT[:12], 99, 99, 99, 99, 99]) == 12


@pytest.mark.parametrize(
    ("groups", "interval", "message"),
    [
        (GROUPS, 6, "multiple of the block size 4"),
        (GROUPS, -4, "prefix_cache_retention_interval"),
        ([KVCacheGroup("full")], 8, "has none: give 0 or None"),
        ([KVCacheGroup("full"), KVCacheGroup("state")], 8, "has none"),
        (None, 8, "has none"),
    ],
)
def test_bad_intervals_raise(groups: object, interval: int, message: str) -> None:
    with pytest.raises(InvalidArgumentError, match=message):
        pagedkv.BlockManager(32, BS, groups=groups, prefix_cache_retention_interval=interval)


def test_zero_without_a_window_changes_nothing() -> None:
    m = pagedkv.BlockManager(32, BS, prefix_cache_retention_interval=0)
    assert m.allocate(0, PROMPT) == 0
    assert m.stats().registered_blocks == 6


def test_a_reachable_position_past_the_prompt_raises_and_changes_nothing() -> None:
    m = pagedkv.BlockManager(32, BS, groups=GROUPS, prefix_cache_retention_interval=0)
    before = m.stats()
    with pytest.raises(InvalidArgumentError, match="reachable position 25 is past"):
        m.allocate(0, PROMPT, reachable_tokens=[3, 25])
    with pytest.raises(InvalidArgumentError, match="reachable_tokens"):
        m.allocate(0, PROMPT, reachable_tokens=[-1])
    assert 0 not in m
    assert m.stats() == before
    m.check_invariants()


@pytest.mark.parametrize(
    ("groups", "interval"), [(GROUPS, 6), (GROUPS, -4), (None, 8), (GROUPS, True)]
)
def test_the_config_refuses_what_the_constructor_refuses(groups: object, interval: object) -> None:
    with pytest.raises(InvalidArgumentError, match="prefix_cache_retention_interval"):
        BlockManagerConfig(
            num_blocks=32,
            block_size=BS,
            groups=groups,  # type: ignore[arg-type]
            prefix_cache_retention_interval=interval,  # type: ignore[arg-type]
        )


def test_a_manager_from_the_config_retains_sparsely() -> None:
    config = BlockManagerConfig(
        num_blocks=32, block_size=BS, groups=tuple(GROUPS), prefix_cache_retention_interval=0
    )
    m = pagedkv.BlockManager.from_config(config)
    m.allocate(0, PROMPT)
    assert m.stats().groups[1].registered_blocks == 2
