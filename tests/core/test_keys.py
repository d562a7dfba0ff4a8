"""Caller keys, hit caps, held registration and slots without tokens (docs/semantics.md,
"Caller keys, hit caps and held registration"), scripted on every layout: each step's answer
is asserted, and the Rust manager and the reference must agree on it."""

from __future__ import annotations

from typing import Any

import pytest

import pagedkv
from pagedkv import InvalidArgumentError, KVCacheGroup
from pagedkv_reference import ReferenceBlockManager

B = 4
LAYOUTS: dict[str, list[KVCacheGroup] | None] = {
    "plain": None,
    "full+window": [KVCacheGroup("full"), KVCacheGroup("sliding_window", window=8)],
    "two-full": [KVCacheGroup("full"), KVCacheGroup("full")],
}


def keys(prefix: bytes, n: int) -> list[bytes]:
    return [prefix + bytes([i]) for i in range(n)]


class Both:
    """The Rust manager and the reference, called together: the answers must agree."""

    def __init__(self, groups: list[KVCacheGroup] | None, **kw: Any) -> None:
        self.rust = pagedkv.BlockManager(64, B, groups=groups, **kw)
        self.ref = ReferenceBlockManager(64, B, groups=groups, **kw)
        self.windowed = False

    def __getattr__(self, name: str) -> Any:
        def call(*args: Any, **kw: Any) -> Any:
            got = getattr(self.rust, name)(*args, **kw)
            want = getattr(self.ref, name)(*args, **kw)
            assert got == want, f"{name}{args}: rust {got!r}, reference {want!r}"
            self.rust.check_invariants()
            self.ref.check_invariants()
            return got

        return call


@pytest.fixture(params=sorted(LAYOUTS))
def m(request: pytest.FixtureRequest) -> Both:
    both = Both(LAYOUTS[request.param])
    # A window group releases the blocks that slid out of it, so they never register there.
    both.windowed = request.param == "full+window"
    return both


def test_equal_keys_hit_across_sequences_and_different_keys_never(m: Both) -> None:
    prompt = list(range(17))  # four full blocks and one token
    assert m.allocate(1, prompt, block_hashes=keys(b"a", 4)) == 0
    # Other tokens, the same keys: the keys decide the hit.
    assert m.allocate(2, [9] * 17, block_hashes=keys(b"a", 4)) == 16
    assert m.lookup([0] * 17, block_hashes=keys(b"a", 2)) == 8, "fewer keys: fewer hits"
    # The same tokens with other keys, or hashed by pagedkv: no hit.
    assert m.allocate(3, prompt, block_hashes=keys(b"b", 4)) == 0
    assert m.allocate(4, prompt) == 0
    assert m.lookup(prompt, block_hashes=[b"a\x00", b"x", b"a\x02"]) == 4, "stops at a miss"
    assert m.block_hashes(1) == m.block_hashes(2) != m.block_hashes(3)
    assert m.num_block_hashes(1) == 4
    # A range of them, clamped as a slice is.
    assert m.block_hashes(1, 1, 3) == m.block_hashes(1)[1:3]
    assert m.block_hashes(1, 2) == m.block_hashes(1)[2:]
    assert m.block_hashes(1, 3, 9) == m.block_hashes(1)[3:]
    assert m.block_hashes(1, 5) == m.block_hashes(1, 3, 1) == []
    assert m.block_table(1, 2, 4) == m.block_table(1)[2:4]
    assert m.block_table(1, 4) == m.block_table(1)[4:] != []
    assert m.block_table(1, 9) == m.block_table(1, 2, 2) == []
    # A caller key is never a token chain's digest.
    assert not set(m.block_hashes(1)) & set(m.block_hashes(4))


def test_held_registration_publishes_only_on_register(m: Both) -> None:
    prompt = list(range(13))  # three full blocks
    k = keys(b"h", 3)
    assert m.allocate(1, prompt, block_hashes=k, register=False) == 0
    assert m.lookup(prompt, block_hashes=k) == 0, "held: nothing in the cache"
    assert m.append(1, [1, 2, 3]) == []
    assert m.lookup(prompt, block_hashes=k) == 0, "later scheduling respects the hold"
    groups = m.rust.num_groups
    # The first block (full below 5 tokens); the window group let go of it at the append.
    assert m.register(1, num_tokens=5) == (1 if m.windowed else groups)
    assert m.register(1, num_tokens=2) == 0, "a hold only lifts"
    if not m.windowed:
        assert m.lookup(prompt, block_hashes=k) == 4
    assert m.register(1) == 2 * groups
    assert m.lookup(prompt, block_hashes=k) == 12
    assert m.register(1) == 0
    # A sequence that was never held: already registered, 0.
    assert m.allocate(2, [5] * 9) == 0
    assert m.register(2) == 0
    # The hit's blocks are in the cache from the start.
    assert m.allocate(3, prompt, block_hashes=k, register=False) == 12
    with pytest.raises(InvalidArgumentError):
        m.rust.register(3, num_tokens=14)  # past its 13 scheduled tokens


def test_self_hashed_sequences_can_be_held_too(m: Both) -> None:
    prompt = [7] * 9
    assert m.allocate(1, prompt, register=False) == 0
    assert m.lookup(prompt) == 0
    assert m.register(1) == 2 * m.rust.num_groups
    assert m.lookup(prompt) == 8


def test_keys_arrive_late_with_append_and_register(m: Both) -> None:
    assert m.allocate(1, list(range(8)), block_hashes=keys(b"l", 1)) == 0
    assert m.lookup([0] * 9, block_hashes=keys(b"l", 2)) == 4, "only the keyed block"
    # One more token: the second block's key arrives with it (vLLM's hash lookahead).
    assert m.append(1, [8], block_hashes=keys(b"l", 2)[1:]) == []
    assert m.lookup([0] * 9, block_hashes=keys(b"l", 2)) == 8
    assert m.append(1, [9, 10, 11]) == []
    # Keys only (empty tokens, no lookahead), then through register.
    assert m.append(1, [], block_hashes=keys(b"l", 3)[2:]) == []
    assert m.num_block_hashes(1) == 3
    assert m.lookup([0] * 13, block_hashes=keys(b"l", 3)) == 12
    with pytest.raises(InvalidArgumentError):
        m.rust.append(1, [], block_hashes=keys(b"l", 4)[3:])  # 12 tokens: 3 keys at most
    assert m.append(1, [0] * 4) == []
    assert m.register(1, block_hashes=keys(b"l", 4)[3:]) == m.rust.num_groups
    assert m.num_block_hashes(1) == 4


def test_slots_without_tokens(m: Both) -> None:
    assert m.allocate(1, [1, 2, 3]) == 0
    assert m.append(1, [], lookahead=6) == []
    assert m.num_tokens(1) == 3
    assert len(m.block_table(1)) == 3, "3 tokens + 6 slots: three blocks"
    assert m.num_scheduled_tokens(1) == 3
    with pytest.raises(InvalidArgumentError):
        m.rust.append(1, [])


def test_max_hit_tokens_caps_the_hit(m: Both) -> None:
    prompt = list(range(17))
    assert m.allocate(1, prompt) == 0
    for cap, want in [(0, 0), (3, 0), (4, 4), (9, 8), (100, 16)]:
        assert m.lookup(prompt, max_hit_tokens=cap) == want
    assert m.allocate(2, prompt, max_hit_tokens=9) == 8
    assert m.allocate(3, [0] * 9, block_hashes=keys(b"c", 2)) == 0
    assert m.allocate(4, [0] * 9, block_hashes=keys(b"c", 2), max_hit_tokens=4) == 4
    assert m.can_allocate(9, block_hashes=keys(b"c", 2), max_hit_tokens=0) == m.can_allocate(9)


def test_can_allocate_credits_a_keyed_hit_given_a_length() -> None:
    m = Both(None, watermark=0.0)
    assert m.allocate(1, list(range(40)), block_hashes=keys(b"k", 10)) == 0  # 10 blocks
    assert m.allocate(2, list(range(100, 292))) == 0  # 48 more: 6 blocks left
    # 60 tokens: 15 blocks without a hit, 5 new ones with the 10 keyed hits.
    assert m.can_allocate(60) == pagedkv.AllocStatus.LATER
    assert m.can_allocate(60, block_hashes=keys(b"k", 10)) == pagedkv.AllocStatus.OK
    assert m.can_allocate(60, block_hashes=keys(b"x", 10)) == pagedkv.AllocStatus.LATER


def test_forks_share_keys_and_a_shared_block_stays_unregistered(m: Both) -> None:
    # Registered before the fork: both know the blocks under the same keys.
    assert m.allocate(3, list(range(9)), block_hashes=keys(b"g", 2)) == 0
    m.fork(3, 4)
    m.free(3)
    m.free(4)
    assert m.lookup([0] * 9, block_hashes=keys(b"g", 2)) == 8
    # Held, then forked: each fork may key the blocks otherwise, so while they share them
    # neither registers them (the prompt's keys and those given later alike).
    assert m.allocate(1, list(range(8)), block_hashes=keys(b"f", 1), register=False) == 0
    m.fork(1, 2)
    assert m.num_block_hashes(2) == 1
    assert m.register(1, block_hashes=[b"one"]) == 0
    assert m.register(2, block_hashes=[b"two"]) == 0
    assert m.lookup([0] * 9, block_hashes=[b"f\x00", b"one"]) == 0
    assert m.lookup([0] * 9, block_hashes=[b"f\x00", b"two"]) == 0
    # Held alone, a sequence registers as usual.
    assert m.allocate(5, list(range(8)), block_hashes=keys(b"f", 2), register=False) == 0
    assert m.register(5) == 2 * m.rust.num_groups


def test_truncate_lowers_the_hold(m: Both) -> None:
    assert m.allocate(1, list(range(12)), block_hashes=keys(b"t", 3), register=False) == 0
    assert m.register(1, num_tokens=12) == 3 * m.rust.num_groups
    m.truncate(1, 6)
    assert m.num_block_hashes(1) == 1
    assert m.append(1, [0, 0], block_hashes=[b"new"]) == []
    # The hold was lifted up to 3 blocks, truncate lowered it to 1: the new block waits.
    assert m.lookup([0] * 9, block_hashes=[b"t\x00", b"new"]) == 4
    assert m.register(1) == m.rust.num_groups
    assert m.lookup([0] * 9, block_hashes=[b"t\x00", b"new"]) == 8


def test_keys_without_prefix_caching_are_checked_and_dropped() -> None:
    m = Both(None, enable_prefix_caching=False)
    assert m.allocate(1, list(range(9)), block_hashes=keys(b"n", 2)) == 0
    assert m.num_block_hashes(1) == 0
    assert m.lookup(list(range(9)), block_hashes=keys(b"n", 2)) == 0
    with pytest.raises(InvalidArgumentError):
        m.rust.allocate(2, list(range(9)), block_hashes=keys(b"n", 3))
