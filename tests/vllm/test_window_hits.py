"""Prefix hits with a sliding-window group, pagedkv's manager against vLLM's under vLLM's own
scheduler, on the request streams and the layout of the CPU engine's window model
(`vllm_window_streams`).

In the engine vLLM's manager served 1,632 hit tokens in `window_shared` and pagedkv's 1,504,
per request in both directions. Two causes, each shown here without the engine:

- vLLM's sparse prefix-cache retention (`prefix_cache_retention_interval`, `CacheConfig`'s
  default 0, which the engine passes into `KVCacheConfig`): a window group hashes only the
  blocks a later hit can reach (the window's tail before each request's replay boundary,
  its prompt less one token, and before a shared-prefix junction its lookup found). pagedkv
  ignores the setting and hashes every full block, as vLLM does with the setting None. Not
  implemented yet (docs/vllm-engine.md): tests/engine compares the engines' hits with these
  replays, stock with the setting 0, pagedkv with None and the rule.
- pagedkv's deliberate rule that a block computed twice is cached once (docs/vllm.md). With
  dense retention it is the whole difference: vLLM's manager with the rule grafted on
  (`vllm_engine.duplicate_rule`) schedules every step as pagedkv does, free blocks
  included, and gives every request the same hit.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from vllm_window_streams import DENSE, SCENARIOS, hits


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_with_dense_retention_pagedkv_is_vllm_with_its_duplicate_rule(scenario: str) -> None:
    ours = hits("pagedkv", scenario, DENSE)
    emulated = hits("vllm", scenario, DENSE, dedup=True)
    assert ours.schedule == emulated.schedule
    assert ours.hits == emulated.hits


def test_window_shared_with_dense_retention_differs_by_the_duplicate_rule() -> None:
    """The rule matters in this stream: two requests hit less under pagedkv (11: 64 tokens
    against 96; 12: none against 96), and only those, and the test above shows that vLLM
    leaving duplicates unhashed is all it takes."""
    stock = hits("vllm", "window_shared", DENSE).hits
    ours = hits("pagedkv", "window_shared", DENSE).hits
    apart = {i: (a, b) for i, (a, b) in enumerate(zip(stock, ours, strict=True)) if a != b}
    assert apart == {11: (96, 64), 12: (96, 0)}
