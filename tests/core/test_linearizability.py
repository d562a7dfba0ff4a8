"""Races that must stay linearizable (docs/semantics.md, "Under concurrency ...").

Each test runs many short rounds on a small, fresh manager: a few threads are released
together by a `threading.Barrier`, with `sys.setswitchinterval(1e-6)` and prompts of at least
4,096 tokens (or batches of at least 64 ids), so that the calls run in Rust with the GIL
released and really overlap. After each round the outcomes are checked against what *some*
serial order of the round's calls could give; the checks below only reject histories that no
serial order explains (a test that flags a legal interleaving is as wrong as one that never
fails). Where events are checked, an `EventMirror` replays the drained events in order, as an
external indexer would, and is compared with what the manager really caches once it is
quiescent.

Sizes scale with `PAGEDKV_SOAK_SCALE` (default 1; e.g. 20 for a long run), see docs/soak.md.
"""

from __future__ import annotations

import os
import random
import sys
import threading
import traceback
from collections.abc import Callable, Iterator
from typing import Any, Final

import numpy as np
import pytest

from pagedkv import (
    AllBlocksCleared,
    BlockManager,
    BlockRemoved,
    BlockStored,
    DuplicateSequenceError,
    KVEvent,
    PagedKVError,
    UnknownSequenceError,
    hash_blocks,
)

pytestmark = pytest.mark.slow  # race rounds: about a minute and a half on 2 cores

SCALE = float(os.environ.get("PAGEDKV_SOAK_SCALE", "1"))
LONG = 4096  # prompts this long make `allocate` release the GIL
ALGO: Final = "xxh3_128"  # cheap hashing: the racing part of a call is the block bookkeeping


def rounds(n: int) -> int:
    return max(1, int(n * SCALE))


@pytest.fixture(autouse=True)
def _tiny_switch_interval() -> Iterator[None]:
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(old)


def race(*calls: Callable[[], Any]) -> list[tuple[str, Any]]:
    """Run the calls on their own threads, released together; return, per call,
    ("ok", result) or ("raised", exception). Any other failure in a thread is re-raised."""
    barrier = threading.Barrier(len(calls))
    out: list[tuple[str, Any]] = [("none", None)] * len(calls)
    crashes: list[str] = []

    def body(i: int) -> None:
        try:
            barrier.wait()
            try:
                out[i] = ("ok", calls[i]())
            except (DuplicateSequenceError, UnknownSequenceError) as e:
                out[i] = ("raised", e)
        except BaseException:
            crashes.append(traceback.format_exc())

    threads = [threading.Thread(target=body, args=(i,)) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
        assert not t.is_alive(), "a racing thread hung"
    assert not crashes, "\n".join(crashes)
    return out


class EventMirror:
    """An external prefix index fed only by drained events, applied in order.

    Per hash, the events must arrive in the order the manager's index changed, so a
    `BlockStored` never names a hash the mirror holds and a `BlockRemoved` never names one
    it does not hold (each digest is registered at most once at a time, docs/semantics.md,
    "Registration")."""

    def __init__(self) -> None:
        self.held: set[bytes] = set()
        self.violations: list[str] = []

    def apply(self, events: list[KVEvent]) -> None:
        for e in events:
            if isinstance(e, BlockStored):
                for h in e.block_hashes:
                    if h in self.held:
                        self.violations.append(
                            f"BlockStored for {h.hex()[:16]}, which the mirror already holds "
                            "(registered twice, or its BlockRemoved was delivered late)"
                        )
                    self.held.add(h)
            elif isinstance(e, BlockRemoved):
                for h in e.block_hashes:
                    if h not in self.held:
                        self.violations.append(
                            f"BlockRemoved for {h.hex()[:16]}, which the mirror does not hold "
                            "(cleared or never stored, or delivered before its BlockStored)"
                        )
                    self.held.discard(h)
            else:
                assert isinstance(e, AllBlocksCleared)
                self.held.clear()


def assert_mirror_matches(m: BlockManager, mirror: EventMirror, what: str) -> None:
    """With every sequence freed (so every hashed block is CACHED), the manager caches
    exactly one block per registered digest: the mirror must hold exactly that many."""
    assert len(m) == 0
    mirror.apply(m.drain_events())
    assert not mirror.violations, f"{what}: " + "; ".join(mirror.violations[:3])
    assert m.num_cached_blocks == len(mirror.held), (
        f"{what}: the manager caches {m.num_cached_blocks} blocks, "
        f"the event mirror holds {len(mirror.held)} digests"
    )


def probe_hits(m: BlockManager, mirror: EventMirror, tokens: list[int], probe_id: int) -> None:
    """Allocate `tokens` plus one token as a probe: its hits must be the longest prefix of
    the chain that the mirror holds; then free it (the probe's own events go to the
    mirror)."""
    b = m.block_size
    full = len(tokens) // b
    chain = hash_blocks(tokens[: full * b], b, hash_algo=ALGO)
    expect = 0
    while expect < full and chain[expect] in mirror.held:
        expect += 1
    hit = m.allocate(probe_id, np.asarray([*tokens[: full * b], 7], dtype=np.uint32))
    assert hit is not None, "the probe must fit"
    assert hit == expect * b, f"probe hit {hit // b} blocks, the event mirror says {expect}"
    mirror.apply(m.drain_events())
    m.free(probe_id)


def spin(n: int) -> None:
    """Busy-wait for `n` loop steps: a random delay of a few microseconds that shifts one
    racer against the other (no timing is asserted)."""
    for _ in range(n):
        pass


def prompt(rng: random.Random, n: int, first: int) -> list[int]:
    """A prompt whose first token is `first` (so prompts with different `first` share no
    block) followed by random tokens."""
    return [first] + [rng.randrange(1 << 31) for _ in range(n - 1)]


# ------------------------------------------------------------------ reset vs allocate


def test_reset_prefix_cache_is_atomic_with_a_racing_allocate() -> None:
    """`reset_prefix_cache()` racing a long-prompt `allocate` whose prefix is cached.

    Serial orders: allocate first (its sequence then owns blocks, so the reset must return
    False, and the allocate hits the whole cached prefix), or reset first (True, the index
    is empty, so the allocate hits nothing). Violations: True with hits, False without the
    full hits, and an event mirror that disagrees with what is cached afterwards (an
    `AllBlocksCleared` emitted while blocks stay registered).

    The cache holds a long chain whose head the allocate shares; the chain was released tail
    first, so a reset drains the head last, and the reset is delayed by a random few
    microseconds so that, in some rounds, the allocate's hits land while the reset drains."""
    b = 4
    head_blocks, tail_blocks = 2, 20_000
    rng = random.Random(1)
    nrng = np.random.default_rng(1)
    violations: list[str] = []
    outcomes = {True: 0, False: 0}
    total = rounds(200)
    for r in range(total):
        # Draining 20,000 events costs more than the rest of a round: events every 4th round.
        events = r % 4 == 0
        m = BlockManager(tail_blocks + LONG // b + 8, b, hash_algo=ALGO, enable_kv_events=events)
        mirror = EventMirror()
        head = [1, *nrng.integers(0, 1 << 31, head_blocks * b - 1).tolist()]
        tail = nrng.integers(0, 1 << 31, tail_blocks * b).tolist()
        cached = np.asarray(head + tail, dtype=np.uint32)
        assert m.allocate(0, cached) == 0
        m.free(0)  # released tail first: the head blocks are the newest, reset drains them last
        mirror.apply(m.drain_events())
        mine = np.asarray(head + nrng.integers(0, 1 << 31, LONG).tolist(), dtype=np.uint32)
        delay = rng.randrange(6000)

        def reset(delay: int = delay, m: BlockManager = m) -> bool:
            spin(delay)
            return m.reset_prefix_cache()

        def alloc(m: BlockManager = m, mine: np.ndarray = mine) -> int | None:
            return m.allocate(1, mine)

        (_, hit), (_, was_reset) = race(alloc, reset)
        outcomes[was_reset] += 1
        if was_reset and hit != 0:
            violations.append(f"round {r}: reset returned True but the allocate hit {hit} tokens")
        if not was_reset and hit != head_blocks * b:
            violations.append(f"round {r}: reset returned False but the allocate hit {hit}")
        m.free(1)
        if not events:
            continue
        try:
            assert_mirror_matches(m, mirror, f"round {r}")
            probe_hits(m, mirror, head + tail[: 8 * b], 99)
            m.check_invariants()
        except AssertionError as e:
            violations.append(str(e).splitlines()[0])
    print(f"reset vs allocate: {outcomes} (reset won / allocate won), {len(violations)} violations")
    assert not violations, f"{len(violations)} in {total} rounds: " + " | ".join(violations[:4])


# ------------------------------------------------------------------ duplicate id, long prompts


def test_duplicate_sequence_error_changes_nothing_under_a_race() -> None:
    """Two threads allocate the same new id with different long prompts into a pool full of
    cached blocks. Exactly one wins; the loser's DuplicateSequenceError must have changed
    nothing, so the manager must end exactly as after the winner's call alone: it evicted
    the `per` oldest cached blocks (the tail of the cold chain, released tail first) and
    nothing else, the cached digests (event mirror) are the rest of the cold chain plus the
    winner's, and the loser's prompt does not hit."""
    b = 16
    nrng = np.random.default_rng(2)
    size = 4 * LONG  # a long call, so that the other racer starts before it ends
    per = size // b + 1  # blocks one prompt takes
    num_blocks = 2 * per + 8
    violations: list[str] = []
    total = rounds(100)
    for r in range(total):
        m = BlockManager(num_blocks, b, hash_algo=ALGO, enable_kv_events=True)
        mirror = EventMirror()
        cold = [1, *nrng.integers(0, 1 << 31, num_blocks * b - 1).tolist()]
        assert m.allocate(0, np.asarray(cold, dtype=np.uint32)) == 0
        m.free(0)  # the pool is now all CACHED
        mirror.apply(m.drain_events())
        prompts = [[f, *nrng.integers(0, 1 << 31, size + 4).tolist()] for f in (2, 3)]
        arrs = [np.asarray(p, dtype=np.uint32) for p in prompts]
        out = race(*(lambda m=m, a=a: m.allocate(7, a) for a in arrs))
        winners = [i for i, (kind, _) in enumerate(out) if kind == "ok"]
        assert len(winners) == 1, f"round {r}: outcomes {out}"
        w = winners[0]
        assert isinstance(out[1 - w][1], DuplicateSequenceError)
        assert out[w][1] == 0
        try:
            st = m.stats()
            got = (st.evictions, st.free_blocks, st.used_blocks, st.cached_blocks)
            want = (per, 0, per, num_blocks - per)
            assert got == want, (
                f"(evictions, free, used, cached) = {got} after the race, {want} for the "
                "winner alone"
            )
            mirror.apply(m.drain_events())
            assert not mirror.violations, "; ".join(mirror.violations[:2])
            expected = set(hash_blocks(cold, b, hash_algo=ALGO)[: num_blocks - per])
            expected |= set(hash_blocks(prompts[w], b, hash_algo=ALGO))
            assert mirror.held == expected, (
                f"{len(mirror.held - expected)} digests registered that the winner alone "
                f"would not register, {len(expected - mirror.held)} missing"
            )
            m.free(7)
            assert_mirror_matches(m, mirror, "after freeing the winner")
            probe_hits(m, mirror, prompts[1 - w][: 8 * b], 99)
            m.check_invariants()
        except AssertionError as e:
            violations.append(f"round {r}: " + str(e).splitlines()[0])
    assert not violations, f"{len(violations)} of {total} rounds: " + " | ".join(violations[:4])


# ------------------------------------------------------------------ identical prompts


def test_concurrent_identical_prompts_register_each_digest_once() -> None:
    """Several threads allocate the same long prompt under distinct ids on an empty cache.
    Each digest must be registered once (one `BlockStored` per digest, one cached block per
    digest once all are freed), whichever thread registers it.

    Not asserted: how many prompt tokens each call hit. In a strict serial order only the
    first call misses; the contract does not yet say whether two overlapping calls may both
    miss, so that is left to the lead (the rounds where it happens are counted)."""
    b = 16
    rng = random.Random(3)
    threads = 4
    per = LONG // b + 1
    violations: list[str] = []
    both_missed = 0
    total = rounds(150)
    for r in range(total):
        m = BlockManager(threads * per + 8, b, hash_algo=ALGO, enable_kv_events=True)
        mirror = EventMirror()
        p = np.asarray(prompt(rng, LONG + 3, first=1), dtype=np.uint32)
        out = race(*(lambda i=i, m=m, p=p: m.allocate(10 + i, p) for i in range(threads)))
        hits = [v for _, v in out]
        assert all(isinstance(h, int) for h in hits), out
        both_missed += hits.count(0) > 1
        mirror.apply(m.drain_events())
        m.free_batch(list(range(10, 10 + threads)))
        try:
            assert_mirror_matches(m, mirror, f"round {r}")
            assert m.num_cached_blocks == len(p) // b, (
                f"{m.num_cached_blocks} cached blocks for {len(p) // b} distinct digests"
            )
            m.check_invariants()
        except AssertionError as e:
            violations.append(str(e).splitlines()[0])
    print(f"identical prompts: {both_missed} of {total} rounds had several calls miss")
    assert not violations, f"{len(violations)} of {total} rounds: " + " | ".join(violations[:4])


# ------------------------------------------------------------------ free_batch vs free


def test_free_batch_racing_free_of_its_last_id() -> None:
    """`free_batch(ids)` racing `free(ids[-1])`: one of them frees `ids[-1]` first, and the
    other must then raise UnknownSequenceError. If `free_batch` raised, it changed nothing:
    every other id is still there."""
    k = 2000  # >= 64 ids: free_batch runs without the GIL, and long enough to be overtaken
    rng = random.Random(4)
    violations: list[str] = []
    total = rounds(400)
    m = BlockManager(4 * k, 4, enable_prefix_caching=False)
    for r in range(total):
        delay = rng.randrange(3000)
        ids = list(range(k))
        for s in ids:
            assert m.allocate(s, [s, s + 1, 1, 2, 3]) == 0
        arr = np.asarray(ids, dtype=np.int64)

        def free_last(delay: int = delay, last: int = ids[-1]) -> None:
            spin(delay)
            m.free(last)

        def free_all(arr: np.ndarray = arr) -> None:
            m.free_batch(arr)

        (kb, _), (kf, _) = race(free_all, free_last)
        if (kb, kf) == ("ok", "ok"):
            violations.append(f"round {r}: free_batch and free both succeeded")
        elif (kb, kf) == ("raised", "raised"):
            violations.append(f"round {r}: both raised")
        elif kb == "raised":
            left = [s for s in ids if s in m]
            if left != ids[:-1]:
                violations.append(f"round {r}: the failed free_batch freed {k - 1 - len(left)}")
        if len(m):
            m.free_batch([s for s in ids if s in m])
        m.check_invariants()
        assert m.stats().used_blocks == 0
    assert not violations, f"{len(violations)} of {total} rounds: " + " | ".join(violations[:4])


# ------------------------------------------------------------------ event order per hash


def test_events_per_hash_arrive_in_index_order() -> None:
    """Threads keep evicting each other's cached prompts in a small pool while one thread
    re-registers the prompts that were just evicted (each prompt set is allocated by one
    thread only, so no digest is ever registered by two calls at once). An `EventMirror`
    replaying the drained events must end holding exactly the digests the manager caches:
    a `BlockRemoved` queued after its index removal can be delivered after the
    `BlockStored` of the re-registration, and the mirror then loses a cached digest."""
    b = 16
    rng = random.Random(5)
    per = LONG // b + 1
    threads = 4
    violations: list[str] = []
    total = rounds(150)
    for r in range(total):
        m = BlockManager(int(2.5 * per), b, hash_algo=ALGO, enable_kv_events=True)
        mirror = EventMirror()
        # Thread t allocates and frees its own two prompts (first token t), alternately;
        # the pool holds about two and a half prompts, so every allocation evicts.
        sets = [
            [np.asarray(prompt(rng, LONG + 1, first=t), dtype=np.uint32) for _ in range(2)]
            for t in range(threads)
        ]

        def churn(t: int, sets: list[list[np.ndarray]] = sets, m: BlockManager = m) -> None:
            for j in range(6):
                sid = 1000 * t + j
                if m.allocate(sid, sets[t][j % 2]) is not None:
                    m.free(sid)

        race(*(lambda t=t: churn(t) for t in range(threads)))
        try:
            assert_mirror_matches(m, mirror, f"round {r}")
            for t in range(threads):
                for p in sets[t]:
                    probe_hits(m, mirror, p.tolist(), 99)
            m.check_invariants()
        except AssertionError as e:
            violations.append(str(e).splitlines()[0])
    assert not violations, f"{len(violations)} of {total} rounds: " + " | ".join(violations[:4])


# ------------------------------------------------------------------ issue 9 calls vs the reference
#
# Histories of the issue-9 calls (chunked allocate, extend, truncate, free with
# num_computed_tokens, lookup, hit-aware can_allocate, append with lookahead) are checked
# against the sequential reference model: the same setup runs serially on both, then a few
# calls race on the Rust manager, and their results plus the quiescent state afterwards must
# equal what the reference gives for *some* order of those calls. Block ids are left out
# (two racing allocations may interleave their pops of the free stack, which renames blocks
# but changes nothing observable); everything else is compared: each call's answer (hit
# tokens, None, a lookup, an AllocStatus, the number of copy pairs, the error class), each
# sequence's token, scheduled-token and table lengths, the block and registration counters,
# and what `lookup` finds for every prompt involved.

Call = tuple[str, tuple[Any, ...], dict[str, Any]]


def _apply(m: Any, call: Call) -> tuple[str, Any]:
    """Run one call; return its answer normalised (no block ids) or the error class."""
    name, args, kwargs = call
    try:
        out = getattr(m, name)(*args, **kwargs)
    except (PagedKVError, MemoryError) as e:
        return ("raised", type(e).__name__)
    if isinstance(out, (list, np.ndarray)) and name != "lookup_many":
        return ("pairs", len(out))
    return ("ok", out)


def _observe(m: Any, ids: list[int], prompts: list[list[int]]) -> tuple[Any, ...]:
    """The quiescent state, without block ids."""
    seqs = []
    for s in ids:
        if s not in m:
            seqs.append(None)
            continue
        seqs.append((m.num_tokens(s), m.num_scheduled_tokens(s), len(m.block_table(s))))
    st = m.stats()
    counters = (
        st.free_blocks,
        st.used_blocks,
        st.cached_blocks,
        st.num_sequences,
        st.prefix_queries,
        st.prefix_hits,
        st.evictions,
        st.cow_copies,
        st.registered_blocks,
        st.unregistered_blocks,
        st.truncated_blocks,
        st.reserved_slots,
        st.used_slots,
    )
    return (tuple(seqs), counters, tuple(m.lookup(p) for p in prompts))


def _race_any(*calls: Callable[[], Any]) -> list[tuple[str, Any]]:
    """`race`, but each result already normalised by the callable (errors included)."""
    barrier = threading.Barrier(len(calls))
    out: list[Any] = [None] * len(calls)
    crashes: list[str] = []

    def body(i: int) -> None:
        try:
            barrier.wait()
            out[i] = calls[i]()
        except BaseException:
            crashes.append(traceback.format_exc())

    threads = [threading.Thread(target=body, args=(i,)) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
        assert not t.is_alive(), "a racing thread hung"
    assert not crashes, "\n".join(crashes)
    return out


def check_against_reference(
    num_blocks: int,
    b: int,
    setup: list[Call],
    racing: list[Call],
    ids: list[int],
    prompts: list[list[int]],
    delays: list[int],
) -> tuple[int, str | None]:
    """Run `setup` serially on a fresh Rust manager, race `racing` on it (call i after a
    spin of `delays[i]`), and look for an order of the racing calls under which the
    reference gives the same answers and the same state. Returns (the index of the
    matching order among the permutations, None) or (-1, a description of the history)."""
    from itertools import permutations

    from pagedkv_reference import ReferenceBlockManager

    m = BlockManager(num_blocks, b, hash_algo=ALGO)
    for c in setup:
        _apply(m, c)

    def runner(c: Call, d: int) -> Callable[[], tuple[str, Any]]:
        def go() -> tuple[str, Any]:
            spin(d)
            return _apply(m, c)

        return go

    got = _race_any(*(runner(c, d) for c, d in zip(racing, delays, strict=True)))
    m.check_invariants()
    state = _observe(m, ids, prompts)
    tried = []
    for k, order in enumerate(permutations(range(len(racing)))):
        r = ReferenceBlockManager(num_blocks, b, hash_algo=ALGO)
        for c in setup:
            _apply(r, c)
        answers: list[Any] = [None] * len(racing)
        for i in order:
            answers[i] = _apply(r, racing[i])
        ref_state = _observe(r, ids, prompts)
        if answers == got and ref_state == state:
            return k, None
        tried.append(f"order {order}: answers {answers}, state {ref_state}")
    return -1, f"rust answered {got} with state {state}; serial orders give " + " | ".join(tried)


def _run_scenario(
    name: str,
    total: int,
    make: Callable[[random.Random, int], tuple[int, int, list[Call], list[Call], list[int]]],
    prompts_of: Callable[[list[Call]], list[list[int]]],
    seed: int,
) -> None:
    rng = random.Random(seed)
    violations: list[str] = []
    orders: dict[int, int] = {}
    for r in range(total):
        num_blocks, b, setup, racing, ids = make(rng, r)
        delays = [rng.randrange(3000) for _ in racing]
        k, why = check_against_reference(
            num_blocks, b, setup, racing, ids, prompts_of(setup + racing), delays
        )
        orders[k] = orders.get(k, 0) + 1
        if why is not None:
            violations.append(f"round {r}: {why}")
    print(f"{name}: matching serial orders {orders}")
    assert not violations, f"{len(violations)} of {total} rounds: " + " | ".join(violations[:2])


def _prompts_in(calls: list[Call]) -> list[list[int]]:
    seen: list[list[int]] = []
    for name, args, _ in calls:
        if name in ("allocate",) and list(args[1]) not in seen:
            seen.append(list(args[1]))
        if name in ("lookup", "can_allocate") and isinstance(args[0], list) and args[0] not in seen:
            seen.append(args[0])
    return seen


def test_abort_of_a_chunked_prefill_racing_an_allocation_that_hits_it() -> None:
    """Sequence 1 has scheduled a chunk of a long prompt P (its full blocks registered).
    Racing: `free(1, num_computed_tokens=0)` (withdraws the blocks it holds alone), a full
    `allocate(2, P)` (hits them unless the withdrawal came first, and then keeps them
    registered), and a `lookup(P)`. Every answer and the final index must match a serial
    order: no half-withdrawn chain, no hit on a withdrawn block."""
    b = 16

    def make(rng: random.Random, r: int) -> tuple[int, int, list[Call], list[Call], list[int]]:
        p = prompt(rng, LONG + rng.randrange(1, 3 * b), first=1)
        chunk = rng.randrange(b, len(p))
        setup: list[Call] = [("allocate", (1, p), {"num_new_tokens": chunk})]
        racing: list[Call] = [
            ("free", (1,), {"num_computed_tokens": 0}),
            ("allocate", (2, p), {}),
            ("lookup", (p,), {}),
        ]
        return 2 * (len(p) // b + 2), b, setup, racing, [1, 2]

    _run_scenario("abort vs hit", rounds(60), make, _prompts_in, seed=91)


def test_extend_racing_allocations_and_lookups_of_the_same_prompt() -> None:
    """Sequence 1 scheduled the hit plus a chunk of P; racing: `extend(1, k)` (registers
    the next blocks), `allocate(2, P, num_new_tokens=c)` and `can_allocate(P)`/`lookup(P)`.
    The second allocation hits exactly what the extend had registered in the serial order
    that explains the history, and registers nothing twice."""
    b = 16

    def make(rng: random.Random, r: int) -> tuple[int, int, list[Call], list[Call], list[int]]:
        p = prompt(rng, LONG + rng.randrange(1, 3 * b), first=2)
        chunk = rng.randrange(1, len(p) // 2)
        more = rng.randrange(1, len(p) - chunk + 1)
        num_blocks = 2 * (len(p) // b + 2)
        setup: list[Call] = [("allocate", (1, p), {"num_new_tokens": chunk})]
        racing: list[Call] = [
            ("extend", (1, more), {"lookahead": rng.choice([0, 3])}),
            ("allocate", (2, p), {"num_new_tokens": rng.randrange(1, len(p))}),
            rng.choice([("lookup", (p,), {}), ("can_allocate", (p,), {"num_new_tokens": b})]),
        ]
        return num_blocks, b, setup, racing, [1, 2]

    _run_scenario("extend vs allocate", rounds(60), make, _prompts_in, seed=92)


def test_truncate_into_a_hashed_block_racing_a_hit_on_it() -> None:
    """Sequence 1 holds a fully scheduled long prompt P (every full block registered).
    Racing: `truncate(1, m)` to the middle of a full block (held alone: withdrawn; shared:
    copied), `allocate(2, P)` (hits the chain, so the block may be shared when the truncate
    runs) and `lookup(P)`. The truncate's pairs, the hit, the withdrawal and the copy must
    fit one serial order."""
    b = 16

    def make(rng: random.Random, r: int) -> tuple[int, int, list[Call], list[Call], list[int]]:
        p = prompt(rng, LONG + rng.randrange(1, 3 * b), first=3)
        blk = rng.randrange(1, len(p) // b)
        m_ = blk * b + rng.randrange(1, b)  # inside full block `blk`
        setup: list[Call] = [("allocate", (1, p), {}), ("append", (1, [5]), {"lookahead": 2})]
        racing: list[Call] = [
            ("truncate", (1, m_), {}),
            ("allocate", (2, p), {"num_new_tokens": rng.randrange(1, len(p))}),
            ("lookup", (p,), {}),
        ]
        return 2 * (len(p) // b + 3), b, setup, racing, [1, 2]

    _run_scenario("truncate vs hit", rounds(60), make, _prompts_in, seed=93)


def test_evict_blocks_racing_an_allocation_that_hits_the_block() -> None:
    """Sequence 1 holds (or held: then its blocks are CACHED) a long prompt P, blocks
    `0 .. n-1` in a fresh pool. Racing: `evict_blocks([j])` of one block of P's chain (a bad
    KV load), `allocate(2, P)` (hits the chain: a hit on block j either pinned it first, and
    keeps it withdrawn, or stops there) and `allocation_cost(P)` or `lookup(P)`. Answers,
    counters and what lookups find must fit one serial order."""
    b = 16

    def make(rng: random.Random, r: int) -> tuple[int, int, list[Call], list[Call], list[int]]:
        p = prompt(rng, LONG + rng.randrange(1, 3 * b), first=4)
        setup: list[Call] = [("allocate", (1, p), {})]
        if rng.random() < 0.5:
            setup.append(("free", (1,), {}))
        j = rng.randrange(len(p) // b)  # sequence 1's table is 0 .. n-1 (fresh pool)
        racing: list[Call] = [
            ("evict_blocks", ([j],), {}),
            ("allocate", (2, p), {"num_new_tokens": rng.randrange(1, len(p))}),
            rng.choice([("lookup", (p,), {}), ("allocation_cost", (p,), {})]),
        ]
        return 2 * (len(p) // b + 2), b, setup, racing, [1, 2]

    def prompts_of(calls: list[Call]) -> list[list[int]]:
        return _prompts_in(calls) + [
            list(args[0]) for name, args, _ in calls if name == "allocation_cost"
        ]

    _run_scenario("evict_blocks vs hit", rounds(60), make, prompts_of, seed=94)


# ------------------------------------------------------------------ abort vs hit


@pytest.mark.parametrize("other", ["allocate", "lookup"])
def test_abort_withdrawal_is_atomic_against_a_hit(other: str) -> None:
    """Minimal reproducer, no reference needed. Sequence 1 scheduled a chunk of a long
    prompt P (r full blocks registered, held alone). Racing: `free(1,
    num_computed_tokens=0)` (withdraws all r) and `allocate(2, P)` or `lookup(P)`. In any
    serial order the other call sees all r blocks or none of them, and the abort withdraws
    all r either way (a hitter's shared blocks too: their KV was never written): a hit of
    0 < h < r blocks is a torn view."""
    b = 16
    rng = random.Random(7)
    torn: list[tuple[int, int, int, int]] = []  # round, r, hit blocks, withdrawn
    total = rounds(500)
    for r in range(total):
        p = prompt(rng, LONG + 5, first=1)
        m = BlockManager(2 * (len(p) // b + 2), b, hash_algo=ALGO)
        chunk = rng.randrange(b, len(p))
        registered = chunk // b
        m.allocate(1, p, num_new_tokens=chunk)
        delay = rng.randrange(3000)

        def abort(m: BlockManager = m, delay: int = delay) -> None:
            spin(delay)
            m.free(1, num_computed_tokens=0)

        def hit(m: BlockManager = m, p: list[int] = p) -> int | None:
            return m.allocate(2, p) if other == "allocate" else m.lookup(p)

        _, (_, got) = race(abort, hit)
        assert got is not None
        withdrawn = m.stats().unregistered_blocks
        m.check_invariants()
        if other == "allocate":
            ok = got // b in (registered, 0) and withdrawn == registered
        else:
            ok = got // b in (registered, 0)
        if not ok:
            torn.append((r, registered, got // b, withdrawn))
    assert not torn, f"{len(torn)} of {total} rounds (round, r, hit, withdrawn): {torn[:4]}"
