"""Model-based test of KV-cache groups: the Rust manager against the pure-Python reference.

Seeded random call sequences drive both managers, built with the same groups, through every
operation on tiny pools (few blocks, block size 2 or 4, a three-token vocabulary, so that
hybrid hits, window releases, evictions, copy-on-write, swaps and refusals happen all the
time), with caller-keyed sequences (`block_hashes=`, keys arriving with `append` and
`register`), hit caps, loaded tokens and each group's own hit, held registration, empty
appends with lookahead, and steps that leave the skipped entries to `release_skipped`.
Every return value and exception class, every group's table, slot mapping and page table,
the stats with their per-group figures and every event must be equal, and both managers
must pass `check_invariants()` after every call (docs/semantics.md, "KV-cache groups").
Table digests differ between the implementations by design.
"""

from __future__ import annotations

import random
from typing import Any

import pytest

import pagedkv
from kv_oracle import KVOracle
from pagedkv import KVCacheGroup
from pagedkv.groups import has_null_block
from pagedkv_reference import ReferenceBlockManager
from test_model_based import DUTIES, normalize, run

FULL = KVCacheGroup("full")
CONFIGS: dict[str, tuple[int, list[KVCacheGroup]]] = {
    "full-only": (2, [FULL]),
    "two-full": (2, [FULL, FULL]),
    "full+window": (2, [FULL, KVCacheGroup("sliding_window", window=4)]),
    "window-first": (2, [KVCacheGroup("sliding_window", window=3), FULL]),
    "gemma-like": (
        2,
        [KVCacheGroup("sliding_window", window=4)] * 2 + [FULL],
    ),
    "chunked": (2, [FULL, KVCacheGroup("chunked_local", chunk=4)]),
    "state": (4, [KVCacheGroup("state"), FULL]),
    "all-kinds": (
        2,
        [
            FULL,
            KVCacheGroup("sliding_window", window=2),
            KVCacheGroup("chunked_local", chunk=4),
            KVCacheGroup("state"),
        ],
    ),
    "window-only": (2, [KVCacheGroup("sliding_window", window=5)]),
    # A chunk per block: every block boundary hits with nothing cached and a prompt holds
    # only its last block, so prompts longer than the pool fit.
    "chunked-only": (2, [KVCacheGroup("chunked_local", chunk=2)]),
    # Sparse window retention (`RETENTION`): only the reachable tails, then those and
    # 4-token segments' tails (a window of 3 reads 1 block of 2 tokens).
    "window-sparse": (2, [FULL, KVCacheGroup("sliding_window", window=4)]),
    "window-segments": (2, [KVCacheGroup("sliding_window", window=3), FULL]),
}
# `prefix_cache_retention_interval` per config (None, dense, for the others).
RETENTION = {"window-sparse": 0, "window-segments": 4}
MAX_SEQ = 6


def _tokens(rng: random.Random, lo: int = 1, hi: int = 9) -> list[int]:
    return [rng.randrange(3) for _ in range(rng.randint(lo, hi))]


def _keys(toks: list[int], bs: int, lo: int, hi: int) -> list[bytes]:
    """A caller's chain keys of blocks `lo .. hi - 1` (the prefix's tokens as bytes)."""
    return [b"K" + bytes(toks[: (i + 1) * bs]) for i in range(lo, hi)]


def _keyed_call(
    rng: random.Random, sid: int, bs: int, ref: Any
) -> tuple[str, tuple[Any, ...], dict[str, Any]]:
    """A call of the caller-keyed API: keyed allocate (prompts from a two-token vocabulary,
    so that keys repeat), append with late keys or slots only, register, keyed lookup."""
    op = rng.randrange(4)
    if op == 0:
        toks = [rng.randrange(2) for _ in range(rng.randint(1, 6))]
        count = max(0, len(toks) // bs - rng.choice([0, 0, 0, 0, 0, 0, 1, -1]))
        kw: dict[str, Any] = {"block_hashes": _keys(toks, bs, 0, count)}
        kw["max_hit_tokens"] = rng.choice([None, None, 0, 2, 4])
        kw["register"] = rng.random() < 0.6
        if rng.random() < 0.3:
            kw["num_new_tokens"] = rng.randint(1, len(toks))
        return "allocate", (sid, toks), kw
    seq = ref._seqs.get(sid)
    if op == 1:
        new = [rng.randrange(2) for _ in range(rng.choice([0, 0, 1, 2]))]
        kw = {"lookahead": rng.choice([0, 1, 3])}
        if seq is not None and rng.random() < 0.7:
            toks = list(seq.tokens) + new
            have = len(seq.digests)
            kw["block_hashes"] = _keys(toks, bs, have, max(have, len(toks) // bs))
        return "append", (sid, new), kw
    if op == 2:
        kw = {}
        if rng.random() < 0.5:
            kw["num_tokens"] = rng.randint(0, 9)
        if seq is not None and rng.random() < 0.3:
            have = len(seq.digests)
            kw["block_hashes"] = _keys(list(seq.tokens), bs, have, len(seq.tokens) // bs)
        return "register", (sid,), kw
    toks = [rng.randrange(2) for _ in range(rng.randint(1, 6))]
    kw = {"block_hashes": _keys(toks, bs, 0, len(toks) // bs)}
    kw["max_hit_tokens"] = rng.choice([None, 0, 2])
    return rng.choice(["lookup", "can_allocate"]), (toks,), kw


def _pool_call(
    rng: random.Random, num_blocks: int, ref: Any
) -> tuple[str, tuple[Any, ...], dict[str, Any]]:
    """`evict_blocks` (mostly real ids, now and then the null block or one past the pool, or
    one group's blocks of a cached prefix, so that the groups' hits diverge),
    `allocation_cost` and `lookup_blocks` (with `max_hit_tokens` now and then)."""
    op = rng.randrange(3)
    if op == 0 and rng.random() < 0.5:
        _, tables = ref.lookup_blocks(_tokens(rng, 4, 9))
        group = [b for b in tables[rng.randrange(len(tables))] if b]
        if group:
            return "evict_blocks", (rng.sample(group, rng.randint(1, len(group))),), {}
    if op == 0:
        hi = num_blocks + (1 if rng.random() < 0.1 else 0)
        lo = 0 if rng.random() < 0.1 else 1
        return "evict_blocks", ([rng.randrange(lo, hi) for _ in range(rng.randint(1, 3))],), {}
    kw: dict[str, Any] = {}
    if rng.random() < 0.4:
        kw["max_hit_tokens"] = rng.randint(-1, 8)
    if op == 1:
        if rng.random() < 0.3:
            kw["num_new_tokens"] = rng.randint(1, 4)
        if rng.random() < 0.3:
            kw["lookahead"] = rng.randint(0, 3)
        arg: Any = _tokens(rng) if rng.random() < 0.8 else rng.randint(1, 20)
        return "allocation_cost", (arg,), kw
    if rng.random() < 0.3:
        return "lookup_blocks_per_group", (_tokens(rng),), kw
    if rng.random() < 0.3:
        kw["loaded_tokens"] = rng.randint(0, 4)
    return "lookup_blocks", (_tokens(rng),), kw


def _call(
    rng: random.Random, n_groups: int, bs: int, ref: Any, num_blocks: int
) -> tuple[str, tuple[Any, ...], dict[str, Any]]:
    sid = rng.randrange(MAX_SEQ)
    op = rng.randrange(25)
    if op == 24:
        # A caller releasing on its own schedule (steps with release=False).
        return "release_skipped", (sid, rng.randint(0, 12)), {}
    if op >= 21:
        return _pool_call(rng, num_blocks, ref)
    if op >= 17:
        return _keyed_call(rng, sid, bs, ref)
    if op < 4:
        kw: dict[str, Any] = {}
        if rng.random() < 0.4:
            kw["num_new_tokens"] = rng.randint(0, 9)
        if rng.random() < 0.2:
            kw["lookahead"] = rng.randint(0, 3)
        if rng.random() < 0.1:
            kw["cache_salt"] = "s"
        toks = _tokens(rng)
        if rng.random() < 0.5:
            # KV loaded past the hit (a connector's): now and then more than is scheduled.
            kw["loaded_tokens"] = rng.randint(0, (kw.get("num_new_tokens") or len(toks)) + 1)
        if rng.random() < 0.4:
            # Where later hits resume (sparse window retention); now and then past the prompt.
            kw["reachable_tokens"] = [
                rng.randint(0, len(toks) + 1) for _ in range(rng.randint(0, 2))
            ]
        return "allocate", (sid, toks), kw
    release = {"release": False} if rng.random() < 0.3 else {}
    if op == 4:
        return "extend", (sid, rng.randint(0, 4)), {"lookahead": rng.randint(0, 2), **release}
    if op in (5, 6):
        kw = {"lookahead": rng.choice([0, 0, 1, 3]), **release}
        return "append", (sid, _tokens(rng, 1, 3)), kw
    if op == 7:
        return "append_batch", (rng.sample(range(MAX_SEQ), rng.randint(1, 3)),), {}
    if op == 8:
        return "truncate", (sid, rng.randint(0, 12)), {}
    if op == 9:
        return "fork", (sid, rng.randrange(MAX_SEQ)), {}
    if op == 10:
        kw = {} if rng.random() < 0.5 else {"num_computed_tokens": rng.randint(0, 12)}
        return "free", (sid,), kw
    if op == 11:
        return rng.choice(["swap_out", "swap_in", "can_swap_in"]), (sid,), {}
    if op == 12:
        return "lookup", (_tokens(rng),), {}
    if op == 13:
        arg: Any = _tokens(rng) if rng.random() < 0.7 else rng.randint(1, 20)
        return "can_allocate", (arg,), {}
    if op == 14:
        return "free_batch", (rng.sample(range(MAX_SEQ), rng.randint(1, 2)),), {}
    if op == 15:
        return "reset_prefix_cache", (), {}
    if op == 16:
        # A step's queries with draft slots per sequence (past a table's room now and then).
        ids = rng.sample(range(MAX_SEQ), rng.randint(1, 3))
        kw = {"lookahead": [rng.choice([0, 0, 1, 2, 4]) for _ in ids]}
        kw["group"] = rng.randrange(n_groups)
        if rng.random() < 0.5:
            return "flashinfer_page_table", (ids,), kw
        return "slot_mapping", (ids, 1), kw
    return "block_table", (sid,), {"group": rng.randrange(n_groups + 1)}


def _observe(m: Any, n_groups: int) -> Any:
    """Everything a caller can see, per sequence and per group."""
    seen: list[Any] = [
        normalize(m.stats()),
        normalize(m.drain_events()),
    ]
    for sid in range(MAX_SEQ):
        if sid not in m:
            continue
        seen.append(run(m, "num_tokens", sid).key())
        seen.append(run(m, "num_scheduled_tokens", sid).key())
        seen.append(run(m, "block_hashes", sid).key())
        seen.append(run(m, "num_block_hashes", sid).key())
        for g in range(n_groups):
            seen.append(run(m, "block_table", sid, group=g).key())
            seen.append(run(m, "slot_mapping", [sid], 1, group=g).key())
            seen.append(run(m, "flashinfer_page_table", [sid], group=g).key())
    live = [s for s in range(MAX_SEQ) if s in m]
    seen.extend(run(m, "block_tables", live, group=g).key() for g in range(n_groups))
    # Every draft slot each resident sequence's table holds (its own room, one per sequence).
    resident = [s for s in live if not m.is_swapped(s)]
    rooms = [len(m.block_table(s)) * m.block_size - m.num_scheduled_tokens(s) for s in resident]
    for g in range(n_groups):
        seen.append(run(m, "slot_mapping", resident, 1, lookahead=rooms, group=g).key())
        seen.append(run(m, "flashinfer_page_table", resident, lookahead=rooms, group=g).key())
    return seen


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_rust_matches_the_reference(config: str, seed: int) -> None:
    block_size, groups = CONFIGS[config]
    n_groups = len(groups)
    rng = random.Random(f"{config}-{seed}")
    num_blocks = rng.randint(2 + n_groups, 6 + 3 * n_groups)
    kw = {
        "num_cpu_blocks": rng.randint(0, 8),
        "enable_kv_events": True,
        "record_evictions": True,
        "groups": groups,
        "prefix_cache_retention_interval": RETENTION.get(config),
    }
    if seed % 3 == 2:
        kw["enable_prefix_caching"] = False
    rust = pagedkv.BlockManager(num_blocks, block_size, **kw)
    ref = ReferenceBlockManager(num_blocks, block_size, **kw)
    # The KV is the oracle: each manager drives its own shadow pool (block 0 is the null
    # block exactly when some group is not full attention).
    null = has_null_block(groups)
    oracles = [
        (KVOracle(block_size, n_groups, null_block=null, groups=groups), m) for m in (rust, ref)
    ]
    evictions = 0
    for step in range(250):
        name, args, kwargs = _call(rng, n_groups, block_size, ref, num_blocks)
        if name == "append_batch":
            ids = args[0]
            args = (ids, [rng.randrange(3) for _ in ids])
        rust_ev: list[Any] = []
        ref_ev: list[Any] = []
        duty = name in DUTIES
        for kv, m in oracles:
            kv.before(m, name, args, kwargs)
        got = run(rust, name, *args, **kwargs, **({"evicted": rust_ev} if duty else {}))
        want = run(ref, name, *args, **kwargs, **({"evicted": ref_ev} if duty else {}))
        where = f"step {step}: {name}{args} {kwargs}"
        for (kv, m), out, ev in zip(oracles, (got, want), (rust_ev, ref_ev), strict=True):
            try:
                kv.after(m, name, args, kwargs, out.raw, out.exc, evicted=ev)
            except AssertionError as e:
                raise AssertionError(f"{where} ({type(m).__name__}): {e}") from None
        assert got.key() == want.key(), f"{where}: rust {got.describe()} != ref {want.describe()}"
        # Each call's own evictions (block, group, digest), in order: the same in both.
        assert normalize(rust_ev) == normalize(ref_ev), f"{where}: {rust_ev} != {ref_ev}"
        evictions += len(ref_ev)
        rust.check_invariants()
        ref.check_invariants()
        assert _observe(rust, n_groups) == _observe(ref, n_groups), where
    # Every eviction was reported to exactly the call that made it.
    assert evictions == rust.stats().evictions
    assert all(kv.checked > 0 for kv, _ in oracles), "the KV oracle checked nothing"
