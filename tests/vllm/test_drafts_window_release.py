"""Accepted drafts and a sliding-window group, on the manager alone: the window's blocks are
freed at the processed tokens (accepted drafts included) whether or not the installed
scheduler calls `cache_blocks` after the step (0.33 and 0.34 do, 0.32 does not:
compat's `caches_after_output`). Each case replays what the installed scheduler calls, on
vLLM's manager and on pagedkv's, and compares the free blocks and the window's table."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("vllm")

from pagedkv.vllm.compat import RELEASE
from vllm_objects import (
    KVCacheManager,
    VllmKVCacheManager,
    full_spec,
    make_manager,
    make_request,
    window_spec,
)

PROMPT = list(range(2000, 2045))  # 45 tokens
DRAFTS = 2
WINDOW = 32


def _after_an_accepted_step(cls: type[Any], caching: bool) -> tuple[Any, Any]:
    """A 45-token prompt computed, then a step of one token and two drafts, all accepted:
    48 tokens computed, 49 known. pagedkv learned of the 45 it scheduled."""
    manager = make_manager(cls, 32, [full_spec(), window_spec(WINDOW)], enable_caching=caching)
    request = make_request("r", PROMPT)
    assert manager.allocate_slots(request, len(PROMPT)) is not None
    request.num_computed_tokens = len(PROMPT)
    request.append_output_token_ids(7)
    request.spec_token_ids = [3, 4]
    assert manager.allocate_slots(request, 1 + DRAFTS) is not None
    request.num_computed_tokens += 1 + DRAFTS
    request.spec_token_ids = []
    request.append_output_token_ids([3, 4, 9])  # both drafts accepted, and the bonus token
    if RELEASE.caches_after_output:
        # The installed scheduler's update_from_output (0.33 on); 0.32 has no such call.
        manager.cache_blocks(request, request.num_computed_tokens)
    return manager, request


def _window_table(manager: Any) -> list[bool]:
    return [b.is_null for b in manager.get_blocks("r").blocks[1]]


@pytest.mark.parametrize("caching", [False, True])
@pytest.mark.parametrize("via", ["allocate_slots", "remove_skipped_blocks"])
def test_accepted_drafts_count_when_the_window_frees(via: str, caching: bool) -> None:
    """At 48 processed tokens the window (32) skips 17: its first block is freed. Counting
    only the 46 tokens known before the step skips 15 and frees none (pagedkv under 0.32
    before compat's `caches_after_output`: one free block fewer than vLLM)."""
    seen = []
    for cls in (VllmKVCacheManager, KVCacheManager):
        manager, request = _after_an_accepted_step(cls, caching)
        if via == "allocate_slots":
            request.spec_token_ids = [5, 6]
            assert manager.allocate_slots(request, 1 + DRAFTS) is not None
        else:
            manager.remove_skipped_blocks(
                "r", request.num_computed_tokens, num_prompt_tokens=len(PROMPT)
            )
        seen.append((manager.block_pool.get_num_free_blocks(), _window_table(manager)))
    assert seen[0][1][0], f"vLLM kept the window's first block: {seen[0]}"
    assert seen[1] == seen[0], f"vLLM {seen[0]}, pagedkv {seen[1]}"
