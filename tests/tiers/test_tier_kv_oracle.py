"""The KV-content oracle for the tiers (issue 32, "Make the class impossible"): a CPU
`KVCachePool` and a `TieredCache` over real stores run a random workload with constant
eviction, demotion and promotion, forks, truncates, swaps, `evict_blocks`, plain manager
allocations beside the tiered ones, retracted steps and errors injected after the manager's
call, over every group layout (none; [full]; [full, full]; full + sliding window; full +
chunked local).

The "engine" writes every scheduled token's K and V through the pool (`pool.write` with the
manager's slot mapping, group by group) as a function of its sequence's salt and token
prefix, its position and its group, so a block holds the right bytes only if it is the very
block computed for that prefix. After every call:

- every live resident sequence reads back, through its tables, exactly its expected K/V at
  every computed position each group still needs there (a full group: all of them; a
  window or chunk: those its attention reads at the computed length; the entries before
  them were released or, below a tier hit, never computed: docs/tiers.md);
- every hit (GPU or tier) was checked the same way when it was served, and every block a
  load wrote holds the expected KV of the prefix it serves;
- the hit a tiered allocation plans is the reference model's hybrid hit
  (`pagedkv_reference.hybrid_hit`) over the GPU hit and what the stores hold.

On the code before issue 32's fixes this failed for items 2 (a pool of full-attention
groups dropped writes to block 0), 3 (a tier with other hash settings, and errors after the
manager's call, left uncomputed blocks cached) and 4 (hybrid layouts promoted nothing).
"""

from __future__ import annotations

import contextlib
import hashlib
import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")  # the pool under test is torch's CPU KVCachePool

from pagedkv import BlockManager, InvalidArgumentError, KVCacheGroup, hash_blocks  # noqa: E402
from pagedkv.device.pool import KVCachePool, swap_blocks  # noqa: E402
from pagedkv.tiers import Namespace, TierKey  # noqa: E402
from pagedkv.tiers.cache import TieredCache  # noqa: E402
from pagedkv.tiers.host import CompressedHostTier, HostTier  # noqa: E402
from pagedkv_reference.hybrid_hit import hybrid_hit  # noqa: E402

BS, HEADS, DIM, BLOCKS, CPU_BLOCKS = 4, 1, 4, 20, 8
NS = Namespace("oracle", f"1x{HEADS}x{DIM}", "float32", BS)
FULL = KVCacheGroup("full")
LAYOUTS: dict[str, list[KVCacheGroup] | None] = {
    "none": None,
    "full": [FULL],
    "full+full": [FULL, FULL],
    "full+window": [FULL, KVCacheGroup("sliding_window", window=8)],
    "full+chunked": [FULL, KVCacheGroup("chunked_local", chunk=8)],
}


class Injected(RuntimeError):
    """An error the test injects after the manager's call succeeded."""


@lru_cache(maxsize=1 << 16)
def _kv(salt: str | None, prefix: bytes, group: int) -> np.ndarray:
    """[2, HEADS, DIM] float32 K and V of the last token of `prefix` (uint32 tokens) in
    `group` of a sequence salted `salt`."""
    h = hashlib.blake2b(digest_size=32)
    h.update(b"-" if salt is None else b"s" + salt.encode())
    h.update(bytes([group]))
    h.update(prefix)
    raw = np.frombuffer(h.digest(), dtype=np.uint32)
    return (raw.astype(np.float32) / np.float32(2**32)).reshape(2, HEADS, DIM)


@dataclass
class Seq:
    tokens: list[int]
    salt: str | None
    computed: int  # tokens whose KV the engine wrote (always the scheduled ones here)
    swapped: bool = False

    def kv(self, p: int, g: int) -> np.ndarray:
        return _kv(self.salt, np.asarray(self.tokens[: p + 1], dtype=np.uint32).tobytes(), g)


class FlakyStore:
    """A store whose `get` raises while armed (a broken store: the protocol says stores
    never raise, so this is an error after the manager's call)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.medium = inner.medium
        self.armed = False

    def get(self, key: TierKey) -> bytes | None:
        if self.armed:
            raise Injected("store get")
        out: bytes | None = self.inner.get(key)
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


@dataclass
class Oracle:
    """The engine, its expected KV and the checks (module docstring)."""

    groups: list[KVCacheGroup] | None
    stores: list[Any]
    rng: random.Random
    inject: bool = False
    tc_kwargs: dict[str, Any] = field(default_factory=dict)
    check_promotion: bool = True

    def __post_init__(self) -> None:
        self.kinds = self.groups or [FULL]
        self.G = len(self.kinds)
        self.m = BlockManager(
            BLOCKS, BS, record_evictions=True, num_cpu_blocks=CPU_BLOCKS, groups=self.groups
        )
        grouped = self.groups is not None
        self.pool = KVCachePool(
            self.G,
            BLOCKS,
            BS,
            HEADS,
            DIM,
            dtype="float32",
            device="cpu",
            groups=self.groups,
            layer_groups=list(range(self.G)) if grouped else None,
        )
        self.swap = self.pool.swap_pool(CPU_BLOCKS)
        self.null = any(k.kind != "full" for k in self.kinds)  # the manager's rule, restated
        self.flaky = [FlakyStore(s) for s in self.stores]
        self.tc = TieredCache(self.m, self.pool, self.flaky, workers=0, **self.tc_kwargs)
        self.seqs: dict[int, Seq] = {}
        self.next_sid = 0
        prefix_rng = random.Random(self.rng.random())
        self.prefixes = [[prefix_rng.randrange(50) for _ in range(24)] for _ in range(4)]
        self.recent: list[tuple[list[int], str | None]] = []  # prompts of freed sequences
        self.tier_hits = 0  # tokens loaded from the tiers
        self.tier_plans = 0  # tokens tiered allocations planned to load

    # ---- the engine's writes and the checks ---------------------------------------------

    def write(self, sid: int, upto: int, n: int) -> None:
        """Write the KV of the `n` scheduled tokens ending at `upto` (= scheduled) of `sid`,
        every group, through the manager's slot mapping and `pool.write`."""
        if n <= 0:
            return
        s = self.seqs[sid]
        assert self.m.num_scheduled_tokens(sid) == upto
        for g in range(self.G):
            slots = self.m.slot_mapping([sid], n, group=g)
            kv = np.stack([s.kv(p, g) for p in range(upto - n, upto)])
            k = torch.from_numpy(np.ascontiguousarray(kv[:, 0]))
            v = torch.from_numpy(np.ascontiguousarray(kv[:, 1]))
            self.pool.write(g, k, v, slots, group=g if self.groups is not None else None)
        s.computed = upto

    def check_seq(self, sid: int, upto: int | None = None, what: str = "") -> None:
        """`sid`'s positions below `upto` (its computed ones) that each group needs there
        read back its expected K/V."""
        s = self.seqs[sid]
        upto = s.computed if upto is None else upto
        for g, kind in enumerate(self.kinds):
            table = self.m.block_table(sid, group=g)
            key, value = self.pool.key(g), self.pool.value(g)
            for p in range(kind.skipped_tokens(upto) // BS * BS, upto):
                b = table[p // BS]
                assert not (self.null and b == 0), f"{what}: seq {sid} group {g} pos {p} null"
                want = s.kv(p, g)
                got_k = key[b, p % BS].numpy()
                got_v = value[b, p % BS].numpy()
                if not (np.array_equal(got_k, want[0]) and np.array_equal(got_v, want[1])):
                    raise AssertionError(
                        f"{what}: seq {sid} group {g} position {p} (block {b}) holds wrong KV"
                    )

    def check_all(self, what: str) -> None:
        for sid, s in self.seqs.items():
            if not s.swapped:
                self.check_seq(sid, what=what)
        self.m.check_invariants()
        # The promotion rule, on the prompts the workload may ask for again.
        for tokens, salt in self.recent if self.check_promotion else ():
            gpu, tiers = self.tc.lookup(tokens, cache_salt=salt)
            want = self.expected_hit(tokens, salt) * BS
            assert gpu + sum(tiers) == want, (
                f"{what}: the tiers would serve {gpu + sum(tiers)} tokens of a recent "
                f"prompt, the hybrid rule {want}"
            )

    def apply_pairs(self, pairs: Any) -> None:
        if pairs is not None and len(pairs):
            self.pool.copy_blocks(np.asarray(pairs, dtype=np.int64).reshape(-1, 2))

    # ---- the reference promotion ------------------------------------------------------

    def expected_hit(self, tokens: list[int], salt: str | None) -> int:
        """Blocks the manager's hybrid rule serves over the GPU hit and the stores."""
        g0 = self.m.lookup(tokens, cache_salt=salt) // BS
        digests = hash_blocks(tokens, BS, cache_salt=salt)
        cap = min((len(tokens) - 1) // BS, len(digests))

        def cached(g: int, i: int) -> bool:
            if i < g0:
                return True
            key = TierKey(g, digests[i])
            return any(st.inner.count_present([key]) == 1 for st in self.flaky)

        return int(hybrid_hit(self.kinds, BS, cap, cached))

    # ---- the operations ---------------------------------------------------------------

    def new_sid(self) -> int:
        self.next_sid += 1
        return self.next_sid

    def prompt(self) -> tuple[list[int], str | None]:
        r = self.rng
        if self.recent and r.random() < 0.35:  # a prompt again, after other work evicted it
            tokens, salt = r.choice(self.recent)
            return list(tokens), salt
        base = r.choice(self.prefixes)
        head = base[: r.randrange(0, len(base) + 1)]
        tail = [r.randrange(50) for _ in range(r.randrange(1, 7))]
        return head + tail, r.choice([None, None, "t1"])

    def op_allocate(self) -> None:
        r = self.rng
        tokens, salt = self.prompt()
        sid = self.new_sid()
        chunk = None if r.random() < 0.6 else r.randrange(1, len(tokens) + 1)
        want = self.expected_hit(tokens, salt)
        g0 = self.m.lookup(tokens, cache_salt=salt)
        inject = self.inject and r.random() < 0.15
        where = r.choice(["load", "demote"]) if inject else ""
        if where == "demote":
            real = self.tc._demote

            def broken(evicted: Any) -> int:
                raise Injected("copy-out")

            self.tc._demote = broken  # type: ignore[method-assign]
        try:
            alloc = self.tc.allocate(sid, tokens, num_new_tokens=chunk, cache_salt=salt)
        except Injected:
            assert sid not in self.m, "an allocation that raised after the manager's call stays"
            return
        finally:
            if where == "demote":
                self.tc._demote = real  # type: ignore[method-assign]
        if alloc is None:
            return
        self.seqs[sid] = Seq(tokens, salt, 0)
        if alloc.gpu_hit_tokens == g0:
            assert alloc.hit_tokens == want * BS, (
                f"planned hit {alloc.hit_tokens} tokens, the hybrid rule gives {want * BS}"
            )
        self.tier_plans += alloc.hit_tokens - alloc.gpu_hit_tokens
        for st in self.flaky:
            st.armed = where == "load"
        try:
            cached = self.tc.load(alloc)
        except Injected:
            assert sid not in self.m, "a load that raised leaves its sequence allocated"
            del self.seqs[sid]
            return
        finally:
            for st in self.flaky:
                st.armed = False
        self.tier_hits += cached - alloc.gpu_hit_tokens
        self.check_seq(sid, cached, "hit")
        # Every block the load wrote holds the KV of the prefix it serves.
        s = self.seqs[sid]
        for (_, key, block), i in zip(alloc.plan, alloc.positions, strict=True):
            if i < cached // BS:
                for o in range(BS):
                    want_kv = s.kv(i * BS + o, key.group)
                    got = self.pool.key(key.group)[block, o].numpy()
                    assert np.array_equal(got, want_kv[0]), f"loaded block {block} pos {i}"
        sched = self.m.num_scheduled_tokens(sid)
        s.computed = cached
        self.write(sid, sched, sched - cached)

    def op_plain_allocate(self) -> None:
        """An allocation that does not go through the tiers: it hits whatever the GPU
        cache holds (uncomputed blocks left registered would be served here)."""
        tokens, salt = self.prompt()
        sid = self.new_sid()
        hit = self.m.allocate(sid, tokens, cache_salt=salt)
        if hit is None:
            return
        self.seqs[sid] = Seq(tokens, salt, hit)
        self.check_seq(sid, hit, "GPU hit")
        self.write(sid, len(tokens), len(tokens) - hit)

    def live(self, *, resident: bool = True, prefilled: bool | None = None) -> list[int]:
        out = []
        for sid, s in self.seqs.items():
            if resident and s.swapped:
                continue
            if prefilled is not None and (s.computed == len(s.tokens)) != prefilled:
                continue
            out.append(sid)
        return out

    def op_extend(self) -> None:
        ids = self.live(prefilled=False)
        if not ids:
            return
        sid = self.rng.choice(ids)
        s = self.seqs[sid]
        k = self.rng.randrange(1, len(s.tokens) - s.computed + 1)
        pairs = self.tc.extend(sid, k)
        if pairs is None:
            return
        self.apply_pairs(pairs)
        self.write(sid, s.computed + k, k)

    def op_retract(self) -> None:
        """A step scheduled and never run: extend, then free with what was computed."""
        ids = self.live(prefilled=False)
        if not ids:
            return
        sid = self.rng.choice(ids)
        s = self.seqs[sid]
        if self.tc.extend(sid, len(s.tokens) - s.computed) is not None:
            self.tc.free(sid, num_computed_tokens=s.computed)
            del self.seqs[sid]

    def op_append(self) -> None:
        ids = self.live(prefilled=True)
        if not ids:
            return
        r = self.rng
        batch = r.sample(ids, min(len(ids), r.randrange(1, 4)))
        toks = [r.randrange(50) for _ in batch]
        how = r.choice(["append", "append_batch", "step"])
        if how == "append":
            batch, toks = batch[:1], toks[:1]
            pairs: Any = self.tc.append(batch[0], toks)
        elif how == "append_batch":
            pairs = self.tc.append_batch(batch, toks)
        else:
            out = self.tc.step(self.m.running_batch(batch), toks)
            pairs = None if out is None else out[1]
            if out is None:
                return
        if pairs is None:
            return
        self.apply_pairs(pairs)
        for sid, t in zip(batch, toks, strict=True):
            s = self.seqs[sid]
            s.tokens.append(t)
            self.write(sid, len(s.tokens), 1)

    def op_fork(self) -> None:
        ids = self.live()
        if not ids:
            return
        parent = self.rng.choice(ids)
        child = self.new_sid()
        self.tc.fork(parent, child)
        p = self.seqs[parent]
        self.seqs[child] = Seq(list(p.tokens), p.salt, p.computed)

    def op_truncate(self) -> None:
        ids = self.live()
        if not ids:
            return
        sid = self.rng.choice(ids)
        s = self.seqs[sid]
        keep = self.rng.randrange(1, len(s.tokens) + 1)
        try:
            pairs = self.tc.truncate(sid, keep)
        except InvalidArgumentError:
            return  # a window already released what `keep` needs: refused, nothing changed
        if pairs is None:
            return
        self.apply_pairs(pairs)
        del s.tokens[keep:]
        s.computed = min(s.computed, keep)

    def op_swap(self) -> None:
        r = self.rng
        out = [sid for sid, s in self.seqs.items() if s.swapped]
        if out and r.random() < 0.6:
            sid = r.choice(out)
            pairs = self.tc.swap_in(sid)
            if pairs is not None:
                swap_blocks(self.swap, self.pool, np.asarray(pairs, dtype=np.int64))
                self.seqs[sid].swapped = False
            return
        ids = self.live()
        if ids:
            sid = r.choice(ids)
            pairs = self.tc.swap_out(sid)
            if pairs is not None:
                swap_blocks(self.pool, self.swap, np.asarray(pairs, dtype=np.int64))
                self.seqs[sid].swapped = True

    def op_free(self) -> None:
        if self.seqs:
            sid = self.rng.choice(list(self.seqs))
            self.tc.free(sid)
            s = self.seqs.pop(sid)
            self.recent = [*self.recent[-7:], (list(s.tokens), s.salt)]

    def op_evict_blocks(self) -> None:
        lo = 1 if self.null else 0
        ids = [self.rng.randrange(lo, BLOCKS) for _ in range(self.rng.randrange(1, 4))]
        self.m.evict_blocks(ids)

    OPS = (
        ("op_allocate", 8),
        ("op_plain_allocate", 2),
        ("op_extend", 4),
        ("op_retract", 1),
        ("op_append", 4),
        ("op_fork", 1),
        ("op_truncate", 2),
        ("op_swap", 2),
        ("op_free", 6),
        ("op_evict_blocks", 1),
    )

    def run(self, steps: int) -> None:
        names = [n for n, _ in self.OPS]
        weights = [w for _, w in self.OPS]
        for step in range(steps):
            name = self.rng.choices(names, weights)[0]
            getattr(self, name)()
            self.check_all(f"step {step} after {name}")
        self.tc.close()


def _host_stores() -> list[Any]:
    block = 2 * HEADS * DIM * 4 * BS * 2  # a block's bytes with two rows, a bound for both
    # Small budgets: the tiers evict too (the host tier holds about 12 blocks).
    return [HostTier(12 * (block + 89), NS), CompressedHostTier(40 * (block + 89), NS)]


def _run(layout: str, seed: int, steps: int, stores: list[Any] | None = None, **kw: Any) -> Oracle:
    o = Oracle(LAYOUTS[layout], stores or _host_stores(), random.Random(seed), **kw)
    o.run(steps)
    return o


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_kv_oracle_host_tiers(layout: str) -> None:
    o = _run(layout, 1, 160)
    assert o.tier_hits > 0, "the workload must promote from the tiers"


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_kv_oracle_with_errors_after_the_managers_call(layout: str) -> None:
    """A store whose get raises inside `load`, a copy-out that raises inside `allocate`:
    the sequence is freed with its GPU hit as computed, and no block it registered is
    served afterwards (plain allocations hit whatever stays cached)."""
    _run(layout, 2, 160, inject=True)


def test_a_tier_with_other_hash_settings_is_refused_or_serves_nothing_uncomputed() -> None:
    """Item 3: built with another hash seed. Refused when built (named); a cache that took
    it instead must still never serve a block nothing computed."""
    for kw in ({"hash_seed": 1}, {"hash_algo": "xxh3_128"}):
        try:
            o = Oracle(None, _host_stores(), random.Random(3), tc_kwargs=kw, check_promotion=False)
        except InvalidArgumentError as exc:
            (name,) = kw
            assert name in str(exc) and "manager's" in str(exc)
            continue
        for step in range(200):  # what the code before the fix let through
            name = o.rng.choice(["op_allocate", "op_plain_allocate", "op_free"])
            # Its allocate refuses every prompt, after the manager's call.
            with contextlib.suppress(InvalidArgumentError):
                getattr(o, name)()
            o.check_all(f"step {step} after {name}")


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("seed", [11, 12, 13])
def test_kv_oracle_long(layout: str, seed: int) -> None:
    """Longer runs of both workloads (slow lane: about a minute in all on 2 cores)."""
    _run(layout, seed, 1200)
    _run(layout, seed + 100, 800, inject=True)


@pytest.fixture
def redis_url(tmp_path: Path) -> Iterator[str]:
    from redis_fixtures import running_server, server_binary

    with running_server(server_binary("redis"), tmp_path / "server") as s:
        yield s.url


@pytest.mark.parametrize("layout", ["full+window", "full+full"])
def test_kv_oracle_with_a_redis_tier(layout: str, redis_url: str) -> None:
    """The same workload over a host tier and a real Redis below it, with a second node's
    tier of another secret sharing the server: nothing of it is ever present here."""
    import secrets

    from pagedkv.tiers.remote import RemoteTier

    other = RemoteTier(redis_url, NS, secret=secrets.token_bytes(32))
    remote = RemoteTier(redis_url, NS, secret=secrets.token_bytes(32))
    block = 2 * HEADS * DIM * 4 * BS * 2
    o = Oracle(
        LAYOUTS[layout], [HostTier(6 * (block + 89), NS), remote], random.Random(4), inject=True
    )
    rng = random.Random(5)
    for step in range(120):
        # The other secret's node stores every prompt prefix the workload uses.
        if step % 10 == 0:
            tokens, salt = o.prompt()
            for g in range(o.G):
                for d in hash_blocks(tokens, BS, cache_salt=salt):
                    other.put(TierKey(g, d), rng.randbytes(128))
        name = o.rng.choices([n for n, _ in o.OPS], [w for _, w in o.OPS])[0]
        getattr(o, name)()
        o.check_all(f"step {step} after {name}")
    o.tc.close()
    assert remote.stats().corrupt == 0, "an entry of the other secret was read"
