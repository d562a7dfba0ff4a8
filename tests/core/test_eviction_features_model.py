"""Model-based test of pins, retention and tenant quotas: the Rust manager against the reference.

`pagedkv.BlockManager` and `ReferenceBlockManager` (whose pins, retention, clock and tenant
quotas model the core's: rust/core/src/pins.rs, retention.rs, tenants/) take the same calls
side by side, with test_eviction_model.py's driver: after every call their return values,
each call's own evictions, the drained KV events (so the whole eviction order, trims
included), block tables and stats must be equal, and so must `num_pinned_cached()`, `now()`
and, with `tenants=True`, `tenant_stats()`. Both managers run on a manual clock
(`set_time`), advanced alike, so retention durations expire at the same calls.

- seeded random workloads per policy, with and without tenants (three cache salts, quotas
  set and changed on the way), pins and unpins, and (priority eviction) token-range and
  decode retention with durations; each run checks that pins, trims and expiries happened;
- hand-worked cases of each feature;
- bad input to the new calls: the same error type and message from both.
"""

from __future__ import annotations

import random
from typing import Any

import pytest

import pagedkv
from kv_oracle import KVOracle
from pagedkv.config import EVICTIONS
from pagedkv.errors import PagedKVError
from test_eviction_model import Pair, _step
from test_groups_model_based import CONFIGS, MAX_SEQ
from test_model_based import run

SALTS = [None, "a", b"b"]


class FeaturePair(Pair):
    """`Pair`, on a manual clock, comparing the new queries too."""

    def __init__(self, num_blocks: int, block_size: int, **kw: Any) -> None:
        super().__init__(num_blocks, block_size, **kw)
        self.tenants = bool(kw.get("tenants"))
        self.t = 0.0
        self.history: list[tuple[list[int], Any]] = []  # (prompt, salt) allocated so far
        self.call("set_time", self.t)

    def tick(self, dt: float) -> None:
        self.t += dt
        self.call("set_time", self.t)

    def check(self) -> None:
        super().check()
        rust, ref = self.rust, self.ref
        assert rust.now() == ref.now() == self.t, self.where()
        assert rust.num_pinned_cached() == ref.num_pinned_cached(), "pinned" + self.where()
        if self.tenants:
            assert rust.tenant_stats() == ref.tenant_stats(), "tenant stats" + self.where()


def _retention(rng: random.Random, n: int) -> dict[str, Any]:
    """Token-range retention over a prompt of `n` tokens, and sometimes decode retention."""
    kw: dict[str, Any] = {}
    if rng.random() < 0.7:
        cut = rng.randint(1, max(1, n))
        dur = rng.choice([None, 0.0, 1.0, 2.5])
        ranges = [(0, cut, rng.choice([0, 10, 60, 90]), dur)]
        if rng.random() < 0.5:
            ranges.append((cut, None, rng.choice([5, 35, 80]), rng.choice([None, 1.5])))
        rng.shuffle(ranges)
        kw["retention"] = ranges
    if rng.random() < 0.4:
        kw["decode_retention"] = (rng.choice([0, 20, 100]), rng.choice([None, 2.0]))
    return kw


class Counts:
    def __init__(self) -> None:
        self.pinned_cached = 0  # calls after which a pinned block was CACHED
        self.pinned_hits = 0  # allocations that revived a pinned block
        self.quota_trims = 0  # blocks trimmed by a cap (evictions no call reported)
        self.departures = 0  # steps after which a tenant had left the registry


def _feature_step(
    pair: FeaturePair, rng: random.Random, bases: list[list[int]], counts: Counts
) -> int:
    ref = pair.ref
    live = [s for s in range(MAX_SEQ) if s in ref]
    new = [s for s in range(MAX_SEQ) if s not in ref]
    op = rng.random()
    pinned = ref._pinned_cached()
    if len(pinned) > ref.num_blocks // 2 and rng.random() < 0.3:
        # Pins hold most of the pool: withdraw two of them (bad KV), as nothing else but a
        # reset could (a pool of pinned blocks admits nothing that needs a block).
        pair.call("evict_blocks", rng.sample(pinned, 2))
        return 0
    if op < 0.1:
        pair.tick(rng.choice([0.0, 0.5, 1.0, 3.0]))
        return 0
    if op < 0.16 and live:
        # Pins and unpins of any live sequence (a swapped one is refused), or an unknown id.
        sid = rng.choice([*live, MAX_SEQ + 1] if rng.random() < 0.05 else live)
        pair.call("pin" if rng.random() < 0.4 else "unpin", sid)
        return 0
    if op < 0.22 and pair.tenants:
        cap = rng.choice([None, 0, 1, 1, 2, 3])
        reserved = rng.choice([0, 0, 1, 2, 4])
        ev = ref.stats().evictions
        pair.call("set_tenant_quota", rng.choice(SALTS), max_cached=cap, reserved=reserved)
        counts.quota_trims += ref.stats().evictions - ev
        return 0
    if op < 0.55 and new:
        kw: dict[str, Any] = {}
        again = pair.history and rng.random() < 0.3
        if again:
            # An earlier prompt again, with its salt: hits (on pinned blocks too).
            toks, kw["cache_salt"] = rng.choice(pair.history)
        else:
            toks = [*list(rng.choice(bases))[: rng.randint(1, 12)], rng.randrange(3)]
            if pair.tenants or rng.random() < 0.2:
                kw["cache_salt"] = rng.choice(SALTS)
            pair.history = [*pair.history[-7:], (toks, kw.get("cache_salt"))]
        if ref.eviction == "priority" and rng.random() < 0.6:
            kw |= _retention(rng, len(toks))
        salt = kw.get("cache_salt")
        _, _, revived = ref.allocation_cost(toks, cache_salt=salt)
        _, tables = ref.lookup_blocks(toks, cache_salt=salt)
        pinned = set(ref._pinned_cached())
        ev = ref.stats().evictions
        sid = rng.choice(new)
        got = pair.call("allocate", sid, toks, **kw)
        if got.exc is None and got.value is not None:
            counts.pinned_hits += sum(1 for t in tables for b in t if b in pinned)
            if again and rng.random() < 0.5:
                pair.call("unpin", sid)  # what it hit of an earlier pinned prompt, too
            return revived
        counts.quota_trims += ref.stats().evictions - ev
        return 0
    ev = ref.stats().evictions
    before = pair.evictions
    revived = _step(pair, rng, bases)
    # Evictions no call reported (`evicted=`): a cap's trims at a release.
    counts.quota_trims += (ref.stats().evictions - ev) - (pair.evictions - before)
    return revived


WORKLOADS = [(p, t, None) for p in EVICTIONS for t in (False, True)] + [
    ("lru", False, "two-full"),
    ("s3fifo", True, "two-full"),
    ("lfu", True, "full+window"),
    # One full group runs the core's plain paths: ARC's ghosts learn the prompts' misses
    # there, and retention is refused as with any `groups=` (both once differed).
    ("arc", True, "full-only"),
    ("priority", True, "full-only"),
]


@pytest.mark.parametrize(("policy", "tenants", "groups"), WORKLOADS)
def test_features_match_the_reference(policy: str, tenants: bool, groups: str | None) -> None:
    counts = Counts()
    evictions = revived = 0
    for seed in range(2):
        rng = random.Random(f"{policy}-{tenants}-{groups}-{seed}")
        kw: dict[str, Any] = {"eviction": policy, "num_cpu_blocks": rng.choice([0, 6])}
        if tenants:
            kw["tenants"] = True
        if groups is None:
            block_size = rng.choice([1, 2, 2])
            num_blocks = rng.randint(12, 18)
        else:
            block_size, kw["groups"] = CONFIGS[groups]
            num_blocks = rng.randint(16, 26)
        pair = FeaturePair(num_blocks, block_size, **kw)
        bases = [[rng.randrange(3) for _ in range(12)] for _ in range(4)]
        present = 1
        for _ in range(500):
            revived += _feature_step(pair, rng, bases, counts)
            counts.pinned_cached += pair.ref.num_pinned_cached() > 0
            if tenants:  # the core's stats are compared with these after every call
                now = len(pair.ref.tenant_stats())
                counts.departures += now < present
                present = now
        evictions += pair.evictions
    # Not vacuous: evictions, revivals, pinned cached blocks, hits on them, and trims.
    assert evictions > 20 and revived > 0, (evictions, revived)
    assert counts.pinned_cached > 20 and counts.pinned_hits > 0, vars(counts)
    assert (counts.quota_trims > 0) == tenants, vars(counts)
    assert (counts.departures > 0) == tenants, vars(counts)


class NeutralPair(FeaturePair):
    """The Rust manager built with `tenants=True` (no quota is ever set) against the
    reference without tenants: per-tenant bookkeeping alone must change nothing a caller
    sees, every eviction in order included."""

    def __init__(self, num_blocks: int, block_size: int, **kw: Any) -> None:
        super().__init__(num_blocks, block_size, **kw)
        self.rust = pagedkv.BlockManager(
            num_blocks, block_size, enable_kv_events=True, record_evictions=True,
            tenants=True, **kw,
        )  # fmt: skip
        self.rust.set_time(self.t)
        self.oracles[0] = (KVOracle(block_size), self.rust)
        self.log[0] = f"rust with tenants=True, reference without: {self.log[0]}"


@pytest.mark.parametrize("policy", EVICTIONS)
def test_tenants_without_quotas_change_no_eviction(policy: str) -> None:
    # Under priority this found a held block's retention left behind in its group's policy
    # when the block went FREE (withdrawn by `evict_blocks` while held), so that its next
    # content, cached without retention, kept the old priority.
    counts = Counts()
    evictions = revived = withdrawn = 0
    for seed in range(3):
        rng = random.Random(f"neutral-{policy}-{seed}")
        pair = NeutralPair(rng.randint(12, 18), rng.choice([1, 2]), eviction=policy)
        bases = [[rng.randrange(3) for _ in range(12)] for _ in range(4)]
        for _ in range(400):
            live = [s for s in range(MAX_SEQ) if s in pair.ref and not pair.ref.is_swapped(s)]
            if live and rng.random() < 0.08:
                # Withdraw blocks a sequence holds (bad KV): they go FREE at its free.
                table = pair.ref.block_table(rng.choice(live))
                if table:
                    withdrawn += pair.call("evict_blocks", rng.sample(table, 1)).value[1]
                continue
            revived += _feature_step(pair, rng, bases, counts)
        evictions += pair.evictions
        assert pair.rust.tenants and not pair.ref.tenants
    assert evictions > 20 and revived > 0 and withdrawn > 10, (evictions, revived, withdrawn)


# ------------------------------------------------------------------------ hand-worked cases


def _both(**kw: Any) -> FeaturePair:
    return FeaturePair(8, 2, **kw)


def test_a_pinned_prompt_survives_pressure_and_is_hit_without_a_unit() -> None:
    p = _both()
    prompt = [1, 2, 3, 4, 5]
    p.call("allocate", 1, prompt)
    assert p.call("pin", 1).value == ("int", 3)
    p.call("free", 1)
    assert p.ref.num_pinned_cached() == 2  # the partial block went FREE and lost its pin
    # 6 blocks can be had: 7 do not fit (nothing is evicted), 6 do.
    assert p.call("allocate", 2, [9] * 13).value is None
    assert p.call("allocate", 2, [9] * 12).value == ("int", 0)
    # The pinned prefix still hits, with no unit left: a pinned block costs none.
    assert p.ref.num_available_blocks == 0
    assert p.rust.allocation_cost([*prompt[:4], 7]) == (4, 1, 0)
    assert p.ref.allocation_cost([*prompt[:4], 7]) == (4, 1, 0)
    p.call("free", 2)
    assert p.call("allocate", 3, prompt).value == ("int", 4)
    assert p.call("unpin", 3).value == ("int", 3)
    p.call("free", 3)
    assert p.ref.num_pinned_cached() == 0


def test_reset_and_evict_blocks_drop_pinned_blocks() -> None:
    p = _both()
    p.call("allocate", 1, [1, 2, 3, 4, 5, 6, 7])
    p.call("allocate", 2, [8, 8, 8])
    p.call("pin", 1)
    table = p.ref.block_table(1)
    p.call("free", 1)
    p.call("free", 2)
    assert p.call("evict_blocks", table[1:2]).value == ("int", 1)
    assert p.ref.num_pinned_cached() == 2
    assert p.call("reset_prefix_cache").value is True
    assert p.ref.num_pinned_cached() == 0
    # The formerly cached blocks went under the free ones: the unpinned first, then the
    # pinned by id.
    p.call("allocate", 3, [5] * 16)


def test_retention_orders_evictions_and_expires_on_the_clock() -> None:
    p = _both(eviction="priority")
    # Sequence 1: block 0 at priority 90 for 2 s, block 1 at 60 for good.
    p.call("allocate", 1, [1] * 5, retention=[(2, None, 60, None), (0, 2, 90, 2.0)])
    # Sequence 2: its prompt's blocks at 10, the decode block at 5.
    p.call("allocate", 2, [2] * 5, retention=[(0, None, 10, None)], decode_retention=(5, None))
    p.call("append", 2, [3, 3, 3])
    p.call("free", 1)
    p.call("free", 2)
    assert p.ref.num_cached_blocks == 6
    p.tick(1.0)
    # 2 free blocks and 4 evictions: sequence 2's, lowest priority first.
    assert p.call("allocate", 3, [4] * 12).value == ("int", 0)
    assert p.rust.lookup([1] * 5) == p.ref.lookup([1] * 5) == 4
    assert p.rust.lookup([2] * 3) == p.ref.lookup([2] * 3) == 0
    p.tick(2.0)  # block 0's 2 s ran out at t=2: at the default now, below block 1's 60
    p.call("allocate", 4, [5])
    assert p.rust.lookup([1] * 5) == p.ref.lookup([1] * 5) == 0
    assert p.ref.num_cached_blocks == 1


def test_a_withdrawn_pinned_block_loses_its_retention() -> None:
    """A pinned CACHED block that `evict_blocks` frees goes FREE with its content, and its
    retention with it: the block's next content is cached at the default priority. (The core
    kept the retention until this was found by the random workload below.)"""
    p = FeaturePair(10, 1, eviction="priority")
    p.call("allocate", 2, [2, 0, 2, 1, 0, 1, 1, 1], retention=[(0, 4, 10, None)])
    p.call("allocate", 1, [0, 2])
    p.call("free", 1)  # blocks 8 and 9 cached at the default
    p.call("pin", 2)
    p.call("free", 2)  # blocks 0..7 pinned and CACHED, 0..3 at priority 10
    assert p.call("evict_blocks", [3, 1]).value == ("int", 2)
    # 1 and 3 get new content (a prompt without retention) and are cached again.
    assert p.call("allocate", 0, [2, 0, 1, 2], num_new_tokens=2).value == ("int", 1)
    assert p.ref.block_table(0) == [0, 1, 3]
    p.call("free", 0)
    # The next eviction takes the least recently released default block, 9, not 3.
    p.call("allocate", 5, [2, 2])
    assert p.ref.block_table(5) == [0, 9]


def test_a_block_freed_without_digests_loses_its_retention() -> None:
    """A fork's parent gives block 0 its retention when it lets go; the child truncates
    block 0's digest away and frees it without digests: the retention goes all the same."""
    p = FeaturePair(4, 2, eviction="priority")
    p.call("allocate", 1, [1] * 5, retention=[(0, None, 10, None)])
    p.call("fork", 1, 2)
    p.call("free", 1)
    p.call("truncate", 2, 1)
    p.call("free", 2)  # block 0 FREE, released without digests
    p.call("allocate", 3, [7, 7, 7])
    assert p.ref.block_table(3)[0] == 0
    p.call("allocate", 4, [8, 8, 8])
    p.call("free", 4)
    p.call("free", 3)
    # Block 0 (tokens 7, 7) was released last, at the default: it is the last to go.
    p.call("allocate", 5, [9] * 5)
    assert p.ref.block_table(5) == [2, 1, 3]


def test_retention_is_refused_without_the_priority_policy() -> None:
    bs, groups = CONFIGS["two-full"]
    for kw, size in (({"eviction": "lru"}, 2), ({"eviction": "priority", "groups": groups}, bs)):
        p = FeaturePair(12, size, **kw)
        got = p.call("allocate", 1, [1, 2, 3], retention=[(0, None, 50, None)])
        assert got.exc is not None and "retention" in str(got.exc)
        assert str(run(p.rust, "allocate", 1, [1], retention=[]).exc) == str(
            run(p.ref, "allocate", 1, [1], retention=[]).exc
        )


def test_a_first_quota_keeps_the_retention_of_the_blocks_it_moves() -> None:
    # Tenant a's blocks are cached at priority 90, a gets its first quota (its blocks move to
    # its own policy instance), then tenant b's blocks are cached at the default. Pressure
    # must take b's, as it would without the quota. (Before, the move placed a's blocks as
    # new, at the default priority and released at the move: older than b's, so they went.)
    p = _both(eviction="priority", tenants=True)
    prompt_a, prompt_b = [1, 2, 3, 4, 5], [6, 7, 8, 9, 10]
    p.call("allocate", 1, prompt_a, cache_salt=b"a", retention=[(0, None, 90, None)])
    p.call("free", 1)
    p.tick(1.0)
    p.call("set_tenant_quota", b"a", max_cached=100)  # a quota that caps nothing here
    p.tick(1.0)
    p.call("allocate", 2, prompt_b, cache_salt=b"b")
    p.call("free", 2)
    assert p.ref.num_free_blocks == 4 and p.ref.num_cached_blocks == 4
    p.call("allocate", 3, list(range(20, 31)))  # 6 blocks: the 4 free and 2 evicted
    for m in (p.rust, p.ref):
        assert m.lookup(prompt_a, cache_salt=b"a") == 4
        assert m.lookup(prompt_b, cache_salt=b"b") == 0


def test_a_quota_tenants_expired_block_ranks_at_its_deadline_after_a_passed_over_peek() -> None:
    # Issue 32, item 8. Tenant a (with a quota) caches block A at priority 100 for 5 s at
    # t=0. An eviction at t=2 peeks a's policy (A, at 100) and takes the unsalted tenant's
    # block. At t=10 A ran out at t=5: it ranks as released at its deadline, before the
    # unsalted blocks released at t=6, so the next eviction takes it. (Before, a's policy kept
    # the t=2 peek's time, so A still ranked at 100 and an unsalted block went.)
    p = _both(eviction="priority", tenants=True)
    prompt_a = [1, 1, 1]
    p.call("allocate", 1, prompt_a, cache_salt=b"a", retention=[(0, None, 100, 5.0)])
    p.call("free", 1)
    p.call("set_tenant_quota", b"a", max_cached=4)
    p.tick(1.0)
    p.call("allocate", 2, [2, 2, 2])
    p.call("free", 2)  # the unsalted block U, released at t=1
    p.tick(1.0)
    assert p.ref.num_free_blocks == 6
    p.call("allocate", 3, [3] * 14)  # 7 blocks: the 6 free and U (the peek saw A at 100)
    assert p.rust.lookup([2, 2, 2]) == p.ref.lookup([2, 2, 2]) == 0
    p.tick(4.0)
    p.call("free", 3)  # 7 unsalted blocks released at t=6, after A's deadline
    p.tick(4.0)
    p.call("allocate", 4, [4])  # one block: A goes
    for m in (p.rust, p.ref):
        assert m.lookup(prompt_a, cache_salt=b"a") == 0
        assert m.lookup([3] * 14) == 12  # all 7 blocks (a hit leaves one token)


def test_a_removed_quota_gives_the_blocks_back_to_the_shared_policy() -> None:
    # Issue 32, item 9: `set_tenant_quota(salt)` with the defaults (no cap, no reserve) is no
    # quota: the tenant's own policy instance goes (before, it stayed for good), its cached
    # blocks move back to the shared one with their retention and rank, and a held block
    # comes back as a new one. The order is then as if the quota never was.
    p = _both(eviction="priority", tenants=True)
    prompt_a, prompt_b = [1, 2, 3, 4, 5], [6, 7, 8, 9, 10]
    p.call("set_tenant_quota", b"a", max_cached=3)
    p.call("allocate", 1, prompt_a, cache_salt=b"a", retention=[(0, None, 90, None)])
    p.call("free", 1)
    p.tick(1.0)
    p.call("allocate", 2, prompt_a[:3], cache_salt=b"a")  # holds a's first block (a hit)
    p.call("allocate", 3, prompt_b, cache_salt=b"b")
    p.call("free", 3)
    p.call("set_tenant_quota", b"a")
    for m in (p.rust, p.ref):
        a = next(t for t in m.tenant_stats() if t.cache_salt == b"a")
        assert (a.max_cached, a.reserved, a.held_blocks) == (None, 0, 2)
    p.tick(1.0)
    p.call("free", 2)  # a's first block back, at 90 (its retention stayed); 4 free
    p.call("allocate", 4, list(range(20, 31)))  # 6 blocks: the 4 free, then b's 2 (default)
    for m in (p.rust, p.ref):
        assert m.lookup(prompt_a, cache_salt=b"a") == 4
        assert m.lookup(prompt_b, cache_salt=b"b") == 0


def test_quotas_trim_and_reserve_across_tenants() -> None:
    p = _both(tenants=True)
    for i, salt in enumerate(["a", "a", "b", None]):
        p.call("allocate", i, [i + 1] * 4, cache_salt=salt)
    for i in range(4):
        p.call("free", i)
    # Tenant a caches 4 blocks: a cap of 1 trims 3 at once (BlockRemoved, evictions).
    p.call("set_tenant_quota", "a", max_cached=1)
    assert [t.cached_blocks for t in p.ref.tenant_stats()] == [2, 1, 2]
    assert p.ref.stats().evictions == 3
    # b at its reserve: the unsalted tenant's blocks go first though b's were released
    # earlier, then a's.
    p.call("set_tenant_quota", b"b", reserved=2)
    p.call("allocate", 9, [7] * 12)
    assert [t.cached_blocks for t in p.ref.tenant_stats()] == [0, 0, 2]
    assert [t.held_blocks for t in p.ref.tenant_stats()] == [6, 0, 0]


# ------------------------------------------------------------------------ bad input

BAD_CALLS: list[tuple[dict[str, Any], str, tuple[Any, ...], dict[str, Any]]] = [
    ({}, "pin", (7,), {}),
    ({}, "unpin", (-1,), {}),
    ({}, "pin", ("x",), {}),
    ({}, "set_time", (float("nan"),), {}),
    ({}, "set_time", (-1.0,), {}),
    ({}, "set_tenant_quota", ("a",), {"max_cached": 2}),
    ({}, "tenant_stats", (), {}),
    ({"tenants": True}, "set_tenant_quota", ("a",), {"max_cached": 1, "reserved": 2}),
    ({"tenants": True}, "set_tenant_quota", ("a",), {"max_cached": -1}),
    ({"tenants": True}, "set_tenant_quota", ("a",), {"reserved": "2"}),
    ({"tenants": True}, "set_tenant_quota", (5,), {}),
]
_P = {"eviction": "priority"}
for retention, decode in [
    ("x", None),
    ([(0, 4, 50)], None),
    ([[0, 4, 50, None, 1]], None),
    ([(0, 4, 101, None)], None),
    ([(0, 4, -1, None)], None),
    ([(0, 4, 50, "1")], None),
    ([(0, 4, 50, -1.0)], None),
    ([(0, 4, 50, float("inf"))], None),
    ([(4, 4, 50, None)], None),
    ([(6, None, 50, None), (0, 8, 50, None)], None),
    ([(0, None, 50, None), (4, None, 50, None)], None),
    ([(-1, 4, 50, None)], None),
    ([(0, "4", 50, None)], None),
    (None, (50,)),
    (None, (200, None)),
    (None, (5, float("nan"))),
    (None, 5),
]:
    BAD_CALLS.append(
        (_P, "allocate", (1, [1, 2, 3]), {"retention": retention, "decode_retention": decode})
    )


@pytest.mark.parametrize(("build", "name", "args", "kw"), BAD_CALLS)
def test_bad_input_to_the_new_calls(
    build: dict[str, Any], name: str, args: tuple[Any, ...], kw: dict[str, Any]
) -> None:
    p = FeaturePair(8, 2, **build)
    p.call("allocate", 0, [1, 2, 3])
    p.call("swap_out", 0)
    want, got = run(p.ref, name, *args, **kw), run(p.rust, name, *args, **kw)
    assert want.exc is not None and got.exc is not None, (want.describe(), got.describe())
    assert isinstance(want.exc, PagedKVError)
    assert type(got.exc) is type(want.exc), (got.describe(), want.describe())
    # (The seq_id and cache_salt checks shared with every call word their messages apart.)
    if not (name in ("pin", "unpin") or (args and args[0] == 5)):
        assert str(got.exc) == str(want.exc)
    p.check()  # nothing changed


def test_a_swapped_sequence_cannot_be_pinned_and_time_never_goes_back() -> None:
    p = FeaturePair(8, 2, num_cpu_blocks=4)
    p.call("allocate", 0, [1, 2, 3])
    p.call("swap_out", 0)
    for name in ("pin", "unpin"):
        want, got = run(p.ref, name, 0), run(p.rust, name, 0)
        assert type(got.exc) is type(want.exc) and str(got.exc) == str(want.exc)
    p.tick(5.0)
    want, got = run(p.ref, "set_time", 4.5), run(p.rust, "set_time", 4.5)
    assert type(got.exc) is type(want.exc) and str(got.exc) == str(want.exc), (
        got.describe(),
        want.describe(),
    )
    p.check()
