"""Seeded token-id prompts for the engine scenarios (no tokenizer: `skip_tokenizer_init`)."""

from __future__ import annotations

import random

from vllm_engine.model import FIRST_PROMPT_TOKEN, VOCAB

BLOCK = 32  # the engine's block size in every scenario (CPU attention takes multiples of 32)


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(FIRST_PROMPT_TOKEN, VOCAB) for _ in range(n)]


def shared_prefixes(seed: int, groups: int, per_group: int, prefix: int) -> list[list[int]]:
    """`groups` prefixes of `prefix` tokens, each followed by `per_group` distinct suffixes."""
    rng = random.Random(seed)
    heads = [tokens(rng, prefix) for _ in range(groups)]
    return [
        heads[g] + tokens(rng, rng.randrange(8, 3 * BLOCK))
        for _ in range(per_group)
        for g in range(groups)
    ]


def distinct(seed: int, count: int, lo: int, hi: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [tokens(rng, rng.randrange(lo, hi)) for _ in range(count)]
