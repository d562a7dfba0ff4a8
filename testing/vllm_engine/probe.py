"""A request sequence whose prefix hit differs between vLLM's manager and pagedkv's, by
pagedkv's documented rule "a block computed twice is cached once" (docs/vllm.md, "Deliberate
differences"): the observable proof that an engine really ran pagedkv's manager.

With U usable blocks and an empty cache, each request finishing before the next starts:
- A = P (two blocks b1 b2) caches b1 and b2;
- G = two blocks of other tokens, cached after A's;
- B = P again: its hit stops one block short (a token is always computed), so it computes
  b2 a second time. vLLM caches that copy b2' too; pagedkv leaves it unhashed and free;
- F = U - 3 blocks of fresh tokens. vLLM takes its U - 5 never-cached blocks, then evicts
  from the front of its one free queue: b2 and g2, keeping b2'. pagedkv takes its U - 4
  free blocks (b2' among them) and evicts one cached block, the least recently released: b2;
- D = P + one block: vLLM hits b1 b2' (64 tokens); pagedkv only b1 (32 tokens).
"""

from __future__ import annotations

import random

from vllm_engine.prompts import BLOCK, tokens

# D's `num_cached_tokens` by manager.
EXPECTED_D_HIT = {"stock": 2 * BLOCK, "pagedkv": BLOCK}


def requests(usable_blocks: int, seed: int = 99) -> list[tuple[str, list[int]]]:
    """The (name, prompt) sequence, to run one at a time with max_tokens=1 after the prefix
    cache was reset."""
    if usable_blocks < 8:
        raise ValueError(f"the probe needs at least 8 usable blocks, got {usable_blocks}")
    rng = random.Random(seed)
    p = tokens(rng, 2 * BLOCK)
    return [
        ("A", p),
        ("G", tokens(rng, 2 * BLOCK)),
        ("B", list(p)),
        ("F", tokens(rng, (usable_blocks - 3) * BLOCK)),
        ("D", p + tokens(rng, BLOCK)),
    ]
