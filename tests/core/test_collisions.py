"""Digest collisions never let one prompt read another's KV (docs/security.md).

`hash_algo="xxh3_128_trunc8_testing"` is xxh3-128 with all but the first byte of each digest
zeroed: a test-only hash under which different blocks share digests after a short search. The
manager confirms every hit of a non-collision-resistant hash with a secret per-manager tag of
the whole prefix, so a colliding block must never be served, at any depth of the chain.
"""

from __future__ import annotations

import itertools

import pytest

from pagedkv import BlockManager, InvalidArgumentError, hash_blocks

B = 4
WEAK = "xxh3_128_trunc8_testing"


def _collide(prefix: list[int], target: list[int]) -> list[int]:
    """A block other than `target` whose chain digest after `prefix` equals target's."""
    want = hash_blocks(prefix + target, B, hash_algo=WEAK)[-1]
    for k in itertools.count():
        cand = [k, k + 1, k + 2, 9000 + k]
        if cand != target and hash_blocks(prefix + cand, B, hash_algo=WEAK)[-1] == want:
            return cand
    raise AssertionError("unreachable")


def _manager(**kw: object) -> BlockManager:
    return BlockManager(64, B, hash_algo=WEAK, **kw)  # type: ignore[arg-type]


def test_colliding_first_blocks_never_share() -> None:
    a = [1, 2, 3, 4]
    b = _collide([], a)
    m = _manager()
    m.allocate(1, [*a, 0])
    assert m.allocate(2, [*b, 0]) == 0
    assert m.block_hashes(1)[0] == m.block_hashes(2)[0], "the digests do collide"
    assert m.block_table(1)[0] != m.block_table(2)[0]
    m.free(1)  # block 0 of sequence 1 is now CACHED under the shared digest
    assert m.allocate(3, [*b, 0]) == 0
    assert m.allocate(4, [*a, 7]) == B, "the genuine prefix still hits"
    m.check_invariants()


def test_a_collision_in_the_parent_does_not_leak_the_child() -> None:
    """Equal digests at two consecutive levels, different content at the first: checking only
    the block's own tokens and parent digest would serve the attacker's second block."""
    x2 = [1, 2, 3, 4]  # the victim's (e.g. a public system prompt)
    x1 = _collide([], x2)  # the attacker's first block: same digest, other tokens
    y = [50, 51, 52, 53]
    m = _manager()
    m.allocate(1, [*x2, 0])
    m.allocate(2, [*x1, *y, 0])
    attacker = m.block_table(2)
    victim = [*x2, *y, 0]
    assert m.block_hashes(2)[:2] == hash_blocks(victim, B, hash_algo=WEAK)[:2]
    assert m.allocate(3, victim) == B
    assert attacker[1] not in m.block_table(3)
    m.check_invariants()


def test_salted_tenants_never_share_even_when_digests_collide() -> None:
    m = _manager()
    a = [1, 2, 3, 4]
    m.allocate(1, [*a, 0], cache_salt="tenant-a")
    # Find a block that collides with tenant a's block under tenant b's salt.
    want = m.block_hashes(1)[0]
    for k in itertools.count():
        cand = [k, k, k, k]
        if hash_blocks([*cand, 0], B, hash_algo=WEAK, cache_salt="tenant-b")[0] == want:
            break
    assert m.allocate(2, [*cand, 0], cache_salt="tenant-b") == 0
    assert m.allocate(3, [*a, 0], cache_salt="tenant-b") == 0, "same tokens, other tenant"
    assert m.allocate(4, [*a, 0], cache_salt="tenant-a") == B
    m.check_invariants()


@pytest.mark.parametrize("algo", ["sha256", "xxh3_128", WEAK])
def test_many_colliding_prompts_only_hit_their_own_prefix(algo: str) -> None:
    """A crowd of prompts over a tiny vocabulary (many equal digests under the weak hash):
    every hit serves a block last written with exactly the same prefix."""
    import random

    rng = random.Random(5)
    m = BlockManager(48, B, hash_algo=algo)
    content: dict[int, tuple[int, ...]] = {}  # block -> prefix whose KV it holds
    live: list[int] = []
    hits = 0
    for sid in range(400):
        prompt = [rng.randrange(3) for _ in range(rng.randrange(1, 13))]
        hit = m.allocate(sid, prompt)
        if hit is None:
            m.free(live.pop(0))
            continue
        table = m.block_table(sid)
        for i, blk in enumerate(table):
            want = tuple(prompt[: min((i + 1) * B, len(prompt))])
            if i < hit // B:
                assert content[blk] == want, f"block {blk} served another prefix"
            else:
                content[blk] = want
        hits += hit
        live.append(sid)
        if len(live) > 6:
            m.free(live.pop(0))
    assert hits > 100
    m.check_invariants()


def test_unknown_algorithm_is_rejected() -> None:
    with pytest.raises(InvalidArgumentError):
        BlockManager(4, B, hash_algo="xxh3_128_trunc8")
