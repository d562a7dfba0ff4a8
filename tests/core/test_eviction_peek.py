"""`EvictionPolicy.peek` for every reference policy (`pagedkv_reference.eviction`).

On fixed-seed random call sequences: the peek before each victim is that victim, a second
peek is the first, and peeks taken between other calls leave a valid policy whose victims
(but S3-FIFO's, whose peek makes its moves for real) are exactly those of a run without
them. Hand-worked cases pin down the two stateful peeks (S3-FIFO's moves and kept choice of
queue, the priority policy's time) and what S3-FIFO's peek means for tenant quotas.
"""

from __future__ import annotations

import random
from typing import Literal

import pytest

from pagedkv_reference.eviction import (
    POLICIES,
    EvictionPolicy,
    Priority,
    Quota,
    S3Fifo,
    TenantQuotas,
    make_policy,
)
from pagedkv_reference.eviction.priority import DEFAULT_PRIORITY, NEVER_EVICT

NUM_BLOCKS = 12

Peeks = Literal["never", "before_victims", "anywhere"]


def k(name: str) -> bytes:
    return name.encode()


def checked_peek(p: EvictionPolicy, now: float, inside: set[int]) -> int | None:
    """A peek, twice: the same member (or None from an empty set, or only pins), and the
    set unchanged."""
    n = len(p)
    got = p.peek(now)
    assert p.peek(now) == got, "a second peek differs"
    assert len(p) == n
    assert got is None or got in inside
    return got


def run(name: str, seed: int, peeks: Peeks) -> list[int]:
    """Random calls to a fresh `name` policy, the same for the same seed while the victims
    agree; checks the contract and returns the victims."""
    rng = random.Random(seed)
    peek_rng = random.Random(seed + 1)
    p = make_policy(name, NUM_BLOCKS)
    inside: set[int] = set()
    pinned: set[int] = set()  # priority only: evictable and never a victim
    victims: list[int] = []
    now = 0.0
    peeked_then_called = 0
    for _ in range(6000):
        now += rng.choice([0.0, 0.0, 0.25, 0.5, 1.0])
        peeked = peeks == "anywhere" and peek_rng.random() < 1 / 3
        if peeked:
            checked_peek(p, now, inside)
        b = rng.randrange(NUM_BLOCKS)
        op = rng.randrange(100)
        if 60 <= op < 97:
            want: int | Literal["-"] | None = "-"
            if peeks == "before_victims" or (peeks == "anywhere" and peek_rng.random() < 0.5):
                want = checked_peek(p, now, inside)
            if isinstance(p, Priority):
                pinned = {x for x in inside if p.priority_of(x, now) == NEVER_EVICT}
            v = p.victim(now)
            if want != "-":
                assert v == want, "the victim is not the peek"
            if v is None:
                assert inside <= pinned
            else:
                assert v in inside and v not in pinned
                inside.discard(v)
                victims.append(v)
            continue
        peeked_then_called += peeked
        key = f"s{rng.randrange(6)}" if rng.random() < 0.25 else f"k{rng.randrange(3)}-{b}"
        if op < 30 and b not in inside:
            p.on_cached(b, now, k(key))
            inside.add(b)
        elif op < 42 and b in inside:
            p.on_hit(b, now)
            inside.discard(b)
        elif op < 46 and b in inside:
            p.on_removed(b)
            inside.discard(b)
        elif op < 59 and isinstance(p, Priority):
            prio = rng.choice([0, 20, DEFAULT_PRIORITY, DEFAULT_PRIORITY, 50, 100, NEVER_EVICT])
            dur = rng.choice([None, None, 0.0, 0.5, 2.0])
            p.set_retention(b, prio, dur, now=now)
        else:
            # Every step calls the policy after its peek: the victim right after a peek is
            # the peek's even when the clock moved on, which a run without it would not see.
            p.on_miss(k(key), now)
    for b in sorted(inside):
        if isinstance(p, Priority):
            p.set_retention(b, DEFAULT_PRIORITY, now=now)
    while (v := p.victim(now)) is not None:
        assert v in inside
        inside.discard(v)
        victims.append(v)
    assert not inside, f"{inside} never left"
    assert len(victims) > 1000
    if peeks == "anywhere":
        assert peeked_then_called > 500
    return victims


@pytest.mark.parametrize("name", POLICIES)
def test_the_peek_before_each_victim_is_that_victim(name: str) -> None:
    run(name, 7, "before_victims")


@pytest.mark.parametrize("seed", [11, 12])
@pytest.mark.parametrize("name", POLICIES)
def test_peeks_between_other_calls_leave_a_valid_policy_and_pure_ones_no_trace(
    name: str, seed: int
) -> None:
    without = run(name, seed, "never")
    with_peeks = run(name, seed, "anywhere")
    if name != "s3fifo":
        assert with_peeks == without


def s3fifo_case() -> S3Fifo:
    """M = 18 blocks (ghost hits); S = [20 (key a, hit twice: freq 2), 21 (key b)]."""
    p = S3Fifo(40)
    for i in range(18):
        p.on_cached(i, 0.0, k(f"m{i}"))
    for _ in range(18):
        assert p.victim(0.0) is not None
    for i in range(18):
        p.on_cached(i, 0.0, k(f"m{i}"))  # in G: to M
    p.on_cached(20, 0.0, k("a"))
    for _ in range(2):
        p.on_hit(20, 0.0)
        p.on_cached(20, 0.0, k("a"))
    p.on_cached(21, 0.0, k("b"))
    assert p.queues()[:2] == ([20, 21], list(range(18)))
    return p


def test_s3fifo_peek_makes_the_moves_and_keeps_its_choice_of_queue() -> None:
    # |S| = 2 is 10% of 20: the victim comes from S, where 20 moves to M first. With
    # |S| = 1 the choice would now be M; the victim after the peek is still 21, from S.
    p = s3fifo_case()
    assert p.peek(1.0) == 21
    s, m, _ = p.queues()
    assert (s, len(m), m[-1]) == ([21], 19, 20)  # moved, for real
    assert p.peek(1.0) == 21
    assert p.victim(1.0) == 21
    assert p.queues()[2][-1] == k("b")  # evicted from S: its key to G
    assert p.peek(1.0) == 0  # S is empty now: M's oldest


def test_s3fifo_peek_then_another_call_keeps_the_moves_not_the_choice() -> None:
    p = s3fifo_case()  # without a peek: S = [20, 21, 30] of 21 is big, 20 moves, 21 goes
    p.on_cached(30, 1.0, k("e"))
    assert p.victim(1.0) == 21
    p = s3fifo_case()  # with one: 20 moved; then S = [21, 30] of 21 is small: M's 0 goes
    assert p.peek(1.0) == 21
    p.on_cached(30, 1.0, k("e"))
    assert p.peek(1.0) == 0
    assert p.victim(1.0) == 0
    assert p.queues()[0] == [21, 30]


def test_priority_victim_after_a_peek_is_the_peek_at_a_later_now() -> None:
    p = Priority()
    p.set_retention(0, 10, 1.0)
    p.on_cached(0, 0.0, k("a"))  # priority 10 until t = 1
    p.on_cached(1, 0.0, k("b"))
    assert p.cross_rank(0, 0.0) == (10, 0.0, 1)
    assert p.peek(0.0) == 0
    # At t = 1, 0 has run out (at its deadline, after 1); the rank and the victim are
    # still the peek's, at t = 0.
    assert p.cross_rank(0, 1.0) == (10, 0.0, 1)
    assert p.victim(1.0) == 0
    # A call between, and the victim is decided at its own time.
    p.set_retention(2, 10, 1.0)
    p.on_cached(2, 1.0, k("c"))  # priority 10 until t = 2
    assert p.peek(1.0) == 2
    assert p.cross_rank(2, 2.0) == (10, 1.0, 1)
    p.on_miss(k("x"), 2.0)
    assert p.cross_rank(2, 2.0) == (DEFAULT_PRIORITY, 2.0, 0)
    assert p.peek(2.0) == 1
    assert p.victim(2.0) == 1
    assert p.victim(2.0) == 2
    assert p.peek(2.0) is None


def test_peek_with_a_clock_going_back_raises_and_changes_nothing() -> None:
    p = s3fifo_case()
    with pytest.raises(ValueError, match="before the last time"):
        p.peek(-1.0)
    assert p.queues()[:2] == ([20, 21], list(range(18)))  # no move made
    q = TenantQuotas(lambda: S3Fifo(40), {b"B": Quota(cap=100)})  # B: its own group
    q.on_cached(0, 5.0, k("x"), b"B")
    q.on_cached(1, 1.0, k("y"), b"A")
    with pytest.raises(ValueError, match="before the last time"):
        q.victim(2.0)  # A's policy is at 1, B's at 5: nothing peeked, nothing evicted
    assert len(q) == 2


def test_quotas_keep_the_moves_of_a_tenant_peeked_and_not_chosen() -> None:
    # B's block is released first, so B's candidate goes; A's policy was peeked on the way,
    # and its S3-FIFO moved its reused block 1 from S to M for real (a peek on a copy, as
    # quotas did before, would have left A's S as it was).
    q = TenantQuotas(lambda: make_policy("s3fifo", 16), {b"B": Quota(cap=100)})
    q.on_cached(5, 0.0, k("b5"), b"B")
    q.on_cached(1, 0.0, k("a1"), b"A")
    for _ in range(2):
        q.on_hit(1, 0.0)
        q.on_cached(1, 0.0, k("a1"), b"A")  # freq 2
    q.on_cached(2, 0.0, k("a2"), b"A")
    pa = q.policy(b"A")
    assert isinstance(pa, S3Fifo)
    assert pa.queues() == ([1, 2], [], [])
    assert q.victim(1.0) == 5
    assert pa.queues() == ([2], [1], [])
    assert q.victim(1.0) == 2
