"""Model-based test of the eviction policies: the Rust manager against the reference, per policy.

`pagedkv.BlockManager(..., eviction=p)` and `ReferenceBlockManager(..., eviction=p)` (whose
policy is the plain one of `pagedkv_reference.eviction`, docs/eviction.md) take the same
calls side by side, and after every call their return values, each call's own evictions
(`evicted=`), the drained KV events (every eviction is a `BlockRemoved`, in order: so the
whole eviction order is compared), block tables and stats must be equal, and both must pass
`check_invariants()`. Three drivers:

- seeded random workloads of prompts cut from a few shared ones, on small pools, with and
  without KV-cache groups (a hybrid model), so that hits on CACHED blocks (revivals),
  evictions, ghost hits (S3-FIFO, ARC), aging (LFU) and promotions (SLRU) happen all the
  time; each run checks that they did;
- rounds of a hot set and scans, the trace the policies differ on most (SLRU's demotions,
  ARC's adaptation), each checked to tell apart mutated rules of the reference policies;
- the whole hypothesis state machine of test_model_based.py (every call and argument form)
  under each policy, with KV events on.

And a failed `allocate` (it could have revived cached blocks, but the rest does not fit)
must leave every policy's eviction order exactly as it was.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize

import pagedkv
from kv_oracle import KVOracle
from pagedkv.config import EVICTIONS
from pagedkv.errors import PagedKVError
from pagedkv.groups import has_null_block
from pagedkv_reference import ReferenceBlockManager
from pagedkv_reference.eviction import Arc, LfuAging, S3Fifo, Slru
from test_groups_model_based import CONFIGS, MAX_SEQ, _observe
from test_model_based import DUTIES, ManagerComparison, _stats, normalize, run


class Pair:
    """A Rust manager and the reference, built alike; `call` runs a call on both and
    compares everything a caller can see afterwards."""

    def __init__(self, num_blocks: int, block_size: int, **kw: Any) -> None:
        kw = {"enable_kv_events": True, "record_evictions": True, **kw}
        self.rust = pagedkv.BlockManager(num_blocks, block_size, **kw)
        self.ref = ReferenceBlockManager(num_blocks, block_size, **kw)
        self.log: list[str] = [f"BlockManager({num_blocks}, {block_size}, **{kw!r})"]
        self.evictions = 0
        # The KV is the oracle: each manager drives its own shadow pool.
        groups = kw.get("groups") or []
        null = has_null_block(groups)
        self.oracles = [
            (KVOracle(block_size, max(1, len(groups)), null_block=null), m)
            for m in (self.rust, self.ref)
        ]

    def where(self) -> str:
        """The calls so far, for a failure's message."""
        return "\n  after: " + "\n  ".join(self.log)

    def call(self, name: str, *args: Any, **kw: Any) -> Any:
        self.log.append(f"{name}{args!r} {kw!r}")
        duty = name in DUTIES
        rust_ev: list[Any] = []
        ref_ev: list[Any] = []
        for kv, m in self.oracles:
            kv.before(m, name, args, kw)
        want = run(self.ref, name, *args, **kw, **({"evicted": ref_ev} if duty else {}))
        got = run(self.rust, name, *args, **kw, **({"evicted": rust_ev} if duty else {}))
        for (kv, m), out, ev in zip(self.oracles, (got, want), (rust_ev, ref_ev), strict=True):
            try:
                kv.after(m, name, args, kw, out.raw, out.exc, evicted=ev)
            except AssertionError as e:
                raise AssertionError(f"{type(m).__name__}: {e}" + self.where()) from None
        if want.exc is not None:
            assert isinstance(want.exc, PagedKVError), f"reference raised {want.exc!r}"
        assert got.key() == want.key(), f"rust {got.describe()}, ref {want.describe()}" + (
            self.where()
        )
        assert normalize(rust_ev) == normalize(ref_ev), f"evicted {rust_ev}, {ref_ev}" + (
            self.where()
        )
        self.evictions += len(ref_ev)
        self.check()
        return want

    def check(self) -> None:
        """Stats, the drained events, every group's tables and slots, and both audits."""
        rust, ref = self.rust, self.ref
        rust.check_invariants()
        ref.check_invariants()
        n = ref.num_groups
        assert _observe(rust, n) == _observe(ref, n), "observable state" + self.where()


class Marks:
    """What a run reached of its policy's distinctive states (so that it compared them)."""

    def __init__(self) -> None:
        self.seen: set[str] = set()
        self.arc_p: tuple[object, int] = (None, 0)  # ARC's policy and target p at the last look

    def look(self, ref: ReferenceBlockManager) -> None:
        p = ref._policy
        if isinstance(p, S3Fifo):
            _, main, ghost = p.queues()
            self.seen |= {n for n, q in (("main", main), ("ghost", ghost)) if q}
            if p._readmit:
                self.seen.add("readmit")
        elif isinstance(p, Arc):
            _, t2, b1, b2 = p.lists()
            self.seen |= {n for n, q in (("t2", t2), ("b1", b1), ("b2", b2)) if q}
            was, before = self.arc_p
            if was is p and p.p > before + 1:
                self.seen.add("p jumps")  # a B1 hit with |B2| >= 2 |B1|, or several hits
            if was is p and p.p < before:
                self.seen.add("p falls")  # a B2 hit
            self.arc_p = (p, p.p)
        elif isinstance(p, LfuAging) and p.age > 1:
            self.seen.add("aged")
        elif isinstance(p, Slru):
            protected = len(p.segments()[1])
            self.seen |= {"protected"} if protected else set()
            self.seen |= {"protected full"} if protected >= p._cap else set()


# The states each policy's runs must reach: S3-FIFO's main queue, ghosts and readmissions
# (a miss found in the ghosts), ARC's T2, both ghost lists and a raised target p, LFU-DA's
# aging, SLRU's protected segment. The priority policy without retention orders as LRU does
# (its retention is compared in `test_eviction_features_model.py`).
EXPECTED_MARKS: dict[str, set[str]] = {
    "lru": set(),
    "s3fifo": {"main", "ghost", "readmit"},
    "arc": {"t2", "b1", "b2", "p jumps", "p falls"},
    "lfu": {"aged"},
    "slru": {"protected", "protected full"},
    "priority": set(),
}


def _prompt(rng: random.Random, bases: list[list[int]]) -> list[int]:
    """Mostly a cut of a shared prompt plus a token or two (hits), now and then a fresh one
    (a scan that pushes the shared blocks towards eviction)."""
    if rng.random() < 0.2:
        return [rng.randrange(3) for _ in range(rng.randint(2, 10))]
    base = rng.choice(bases)
    return base[: rng.randint(1, len(base))] + [rng.randrange(3) for _ in range(rng.randint(0, 2))]


def _step(pair: Pair, rng: random.Random, bases: list[list[int]]) -> int:
    """One random call; returns the cached blocks an allocate revived (else 0)."""
    ref = pair.ref
    live = [s for s in range(MAX_SEQ) if s in ref]
    resident = [s for s in live if not ref.is_swapped(s)]
    new = [s for s in range(MAX_SEQ) if s not in ref]
    op = rng.random()
    if (op < 0.4 or not live) and new:
        toks = _prompt(rng, bases)
        kw: dict[str, Any] = {}
        if rng.random() < 0.2:
            kw["num_new_tokens"] = rng.randint(1, len(toks))
        if rng.random() < 0.15:
            kw["lookahead"] = rng.randint(1, 3)
        if rng.random() < 0.1:
            kw["max_hit_tokens"] = rng.randint(0, 6)
        _, _, revived = ref.allocation_cost(toks, **kw)
        got = pair.call("allocate", rng.choice(new), toks, **kw)
        return revived if got.exc is None and got.value is not None else 0
    if op < 0.7 and live:
        sid = rng.choice(live)
        if rng.random() < 0.15:
            n = ref.num_tokens(sid)
            pair.call("free", sid, num_computed_tokens=rng.randint(0, n))
        else:
            pair.call("free", sid)
    elif op < 0.8 and resident:
        sid = rng.choice(resident)
        left = ref.num_tokens(sid) - ref.num_scheduled_tokens(sid)
        if left:
            pair.call("extend", sid, rng.randint(1, left))
        else:
            pair.call("append", sid, [rng.randrange(3) for _ in range(rng.randint(1, 3))])
    elif op < 0.84 and resident and new:
        pair.call("fork", rng.choice(resident), rng.choice(new))
    elif op < 0.88 and resident:
        sid = rng.choice(resident)
        pair.call("truncate", sid, rng.randint(1, ref.num_tokens(sid)))
    elif op < 0.92:
        pair.call("evict_blocks", [rng.randrange(ref.num_blocks) for _ in range(rng.randint(1, 2))])
    elif op < 0.95 and live:
        sid = rng.choice(live)
        pair.call("swap_in" if ref.is_swapped(sid) else "swap_out", sid)
    elif op < 0.96:
        # A reset needs every block released: free them all first, now and then.
        if rng.random() < 0.5:
            for sid in live:
                pair.call("free", sid)
        pair.call("reset_prefix_cache")
    else:
        # A quiet moment: every sequence ends, so the whole pool may be cached (SLRU's
        # protected segment fills up and demotes).
        for sid in live:
            pair.call("free", sid)
    return 0


# (groups, seed): the plain manager, and hybrid ones (which report no misses, in either
# manager: the grouped path of the core does not).
WORKLOADS = [(None, 0), (None, 1), ("two-full", 0), ("full+window", 0)]


@pytest.mark.parametrize(("groups", "seed"), WORKLOADS)
@pytest.mark.parametrize("policy", EVICTIONS)
def test_policy_matches_the_reference(policy: str, groups: str | None, seed: int) -> None:
    rng = random.Random(f"{policy}-{groups}-{seed}")
    kw: dict[str, Any] = {"eviction": policy, "num_cpu_blocks": rng.choice([0, 6])}
    if groups is None:
        block_size = rng.choice([1, 2, 2])
        num_blocks = 8 + 8 * seed + rng.randint(0, 4)  # a tiny pool, and a larger one
    else:
        block_size, kw["groups"] = CONFIGS[groups]
        num_blocks = rng.randint(12, 24)
    pair = Pair(num_blocks, block_size, **kw)
    assert pair.rust.eviction == pair.ref.eviction == policy
    bases = [[rng.randrange(3) for _ in range(12)] for _ in range(4)]
    marks = Marks()
    revived = 0
    for _ in range(400):
        revived += _step(pair, rng, bases)
        marks.look(pair.ref)
    # The comparison was not vacuous: evictions and revivals happened, many, and the
    # policy's own states (ghosts, second queues, aging) were reached.
    assert pair.evictions > 40 and revived > 25, (pair.evictions, revived)
    # (Hybrid managers report no misses; SLRU's protected segment fills up in
    # `test_hot_set_and_scans`.)
    expected = EXPECTED_MARKS[policy] - {"protected full"}
    if groups:
        expected.discard("readmit")
    assert expected <= marks.seen, marks.seen


@pytest.mark.parametrize(("num_blocks", "num_hot"), [(10, 3), (14, 4)])
@pytest.mark.parametrize("policy", EVICTIONS)
def test_hot_set_and_scans(policy: str, num_blocks: int, num_hot: int) -> None:
    """Rounds of a hot set (each prompt twice: revivals) and scans (half of them repeated
    from earlier rounds: ghost hits), sometimes with a hot sequence held through the scan:
    the trace the policies differ on most. Its protected segment, ghost lists and target p
    fill and move in ways the random workload rarely reaches. With 14 blocks, scan blocks
    stay cached through a hot round: older than the blocks SLRU demotes."""
    rng = random.Random(policy)
    pair = Pair(num_blocks, 2, eviction=policy)
    hot = [[10 + i] * 7 for i in range(num_hot)]  # three full blocks each, no shared prefix
    # Scans of 0, 1 or 2 full blocks: a small one after a demotion puts a new block in
    # SLRU's probationary segment behind the demoted ones, where their order shows.
    scans = [[20 + i, 0, 1, 2, 3][: 2 + i % 4] for i in range(14)]
    marks = Marks()
    sid = 0

    def use(prompt: list[int]) -> None:
        nonlocal sid
        if pair.call("allocate", sid, prompt).value is not None:
            marks.look(pair.ref)  # (S3-FIFO's readmissions wait for the release)
            pair.call("free", sid)
        sid = (sid + 1) % MAX_SEQ
        marks.look(pair.ref)

    for _ in range(25):
        for p in hot + hot:
            use(p)
        held = rng.random() < 0.3 and pair.call("allocate", 7, hot[0]).value is not None
        for p in rng.sample(scans, 5):
            use(p)
        if held:
            pair.call("free", 7)
    assert pair.evictions > 100
    assert EXPECTED_MARKS[policy] <= marks.seen, marks.seen


def _evict_all(m: Any, base: int) -> list[tuple[int, int, bytes]]:
    """Evict every cached block, by `allocate`s of fresh one-block prompts (the free stack
    is emptied first): the whole eviction order, next victim first."""
    out: list[tuple[int, int, bytes]] = []
    sid = 100
    while m.num_free_blocks or m.num_cached_blocks:
        assert m.allocate(sid, [base, sid], evicted=out) == 0
        sid += 1
    return out


@pytest.mark.parametrize("groups", [None, "two-full"])
@pytest.mark.parametrize("policy", EVICTIONS)
def test_a_failed_allocate_leaves_the_eviction_order_unchanged(
    policy: str, groups: str | None
) -> None:
    kw: dict[str, Any] = {"enable_kv_events": True, "record_evictions": True, "eviction": policy}
    bs, ng = 2, 1
    if groups is not None:
        bs, kw["groups"] = CONFIGS[groups]
        ng = len(kw["groups"])
    n = 12 * ng
    rng = random.Random(policy)
    bases = [[rng.randrange(3) for _ in range(10)] for _ in range(3)]

    def history(m: Any) -> None:
        """Cached blocks with varied histories (revived, evicted: ghosts, released twice),
        and a sequence that keeps 3 blocks."""
        for i, p in enumerate([*bases, bases[0][:6], bases[1], [9] * 8, bases[0]]):
            assert m.allocate(i, p) is not None
            m.free(i)
        assert m.allocate(60, [8] * 6) is not None

    failed, untouched = pagedkv.BlockManager(n, bs, **kw), pagedkv.BlockManager(n, bs, **kw)
    ref = ReferenceBlockManager(n, bs, **kw)
    for m in (failed, untouched, ref):
        history(m)
    # A prompt that starts like a cached one (its hit would revive cached blocks) and fits
    # the pool, but not the blocks the kept sequence leaves.
    prompt = bases[0] + [7] * 10
    hit, new, revived = ref.allocation_cost(prompt)
    assert hit > 0 and revived > 0 and new + revived > ref.num_available_blocks
    assert (hit // bs) * ng + new <= n
    before = ref._policy.entries()
    for m in (failed, ref):
        assert m.allocate(50, prompt) is None
        assert 50 not in m
    assert ref._policy.entries() == before
    events = [normalize(m.drain_events()) for m in (failed, untouched, ref)]
    assert events[0] == events[1] == events[2]
    assert _stats(failed) == _stats(untouched) == _stats(ref)
    orders = [_evict_all(m, 5) for m in (failed, untouched, ref)]
    assert normalize(orders[0]) == normalize(orders[1]) == normalize(orders[2])
    assert len(orders[0]) >= 4


def _machine(policy: str) -> Any:
    """test_model_based.py's state machine, every rule of it, with the managers built with
    `eviction=policy` and KV events on (the invariant compares the drained events)."""

    class PolicyComparison(ManagerComparison):
        @initialize(
            num_blocks=st.integers(6, 24),
            block_size=st.integers(1, 3),
            num_cpu_blocks=st.integers(0, 8),
            enable_prefix_caching=st.sampled_from([True, True, True, False]),
            hash_algo=st.sampled_from(["sha256", "xxh3_128"]),
            record_evictions=st.booleans(),
        )
        def init(self, num_blocks: int, block_size: int, **kw: Any) -> None:
            kw |= {"enable_kv_events": True, "eviction": policy}
            self.records = kw["record_evictions"]
            self.ref = ReferenceBlockManager(num_blocks, block_size, **kw)
            self.rust = pagedkv.BlockManager(num_blocks, block_size, **kw)
            self.build_oracles(block_size)
            self.log.append(f"BlockManager({num_blocks}, {block_size}, **{kw!r})")

    PolicyComparison.__name__ = PolicyComparison.__qualname__ = f"PolicyComparison_{policy}"
    case = PolicyComparison.TestCase
    case.settings = settings(
        max_examples=12,
        stateful_step_count=50,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    )
    return case


TestStateMachineS3Fifo = _machine("s3fifo")
TestStateMachineArc = _machine("arc")
TestStateMachineLfu = _machine("lfu")
TestStateMachineSlru = _machine("slru")
