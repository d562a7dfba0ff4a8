"""End to end: a decode loop for a hybrid model (full attention + sliding window) on the
CPU KV pool, driven by a manager with KV-cache groups (docs/semantics.md, KV-cache groups;
docs/kernels.md, pools with groups).

Four layers alternate full / sliding window (32 tokens), blocks of 8 tokens, one table per
group. A tiny deterministic "model" gives every position of every layer K, V and a query
that depend on the whole token prefix up to it, so a block served from the prefix cache
holds the right K/V only if it was really written for exactly that prefix and group.

The loop admits prompts that share a system prompt or continue a finished conversation
(hybrid hits: the window group serves only the blocks its window needs, the rest of its
table is the null block), forks, decodes far past the window (the window group's old
entries turn into 0 and their blocks are released and reused), and preempts when the pool
is full. After every step, for every running sequence and every layer, paged decode
attention through that layer's group's table equals dense attention over a dense copy of
the sequence's K/V: causal over everything for full layers, over the last 32 positions
for window layers.

The layers of the two groups share the pool's rows (a block belongs to one group at a
time), so a block handed to both groups at once, or a slot written through the wrong
group, corrupts the other group's K/V and shows in the comparison;
``test_check_has_teeth`` runs sabotaged managers and pools and requires that.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import pagedkv  # noqa: E402
from pagedkv.device.pool import KVCachePool, paged_decode_attention  # noqa: E402
from pagedkv.errors import InvalidArgumentError  # noqa: E402
from pagedkv.groups import KVCacheGroup  # noqa: E402
from pagedkv_reference import ReferenceBlockManager  # noqa: E402

pytestmark = pytest.mark.slow  # hybrid decode loops: minutes on 2 cores; CI runs them

HEADS, KV_HEADS, DIM, BS, WINDOW = 4, 2, 64, 8, 32
GROUPS = [
    KVCacheGroup("full", num_layers=2),
    KVCacheGroup("sliding_window", window=WINDOW, num_layers=2),
]
LAYER_GROUPS = [0, 1, 0, 1]
LAYERS = len(LAYER_GROUPS)
NUM_BLOCKS = 48
MAX_RUNNING = 4
STEPS = 110
TOL = 1e-5
SYSTEM = [int(x) for x in np.random.default_rng(123).integers(0, 1000, 5 * BS)]

# ---- the "model" ----------------------------------------------------------------------------

_ROWS: dict[bytes, np.ndarray] = {}


def _chain(tokens: list[int]) -> list[bytes]:
    out, d = [], b"groups-e2e"
    for t in tokens:
        d = hashlib.blake2b(d + t.to_bytes(4, "little"), digest_size=16).digest()
        out.append(d)
    return out


def _row(d: bytes) -> np.ndarray:
    """``[LAYERS, 2 + HEADS // KV_HEADS, KV_HEADS, DIM]``: K, V and the query heads of the
    token whose prefix digest is ``d``, every layer."""
    r = _ROWS.get(d)
    if r is None:
        rng = np.random.default_rng(int.from_bytes(d[:8], "little"))
        shape = (LAYERS, 2 + HEADS // KV_HEADS, KV_HEADS, DIM)
        r = _ROWS[d] = rng.standard_normal(shape, dtype=np.float32)
    return r


def model_rows(tokens: list[int], positions: range) -> np.ndarray:
    digests = _chain(tokens)
    return np.stack([_row(digests[p]) for p in positions])


def query(tokens: list[int], layer: int) -> np.ndarray:
    """``[HEADS, DIM]``: the query of the last token at ``layer``."""
    q: np.ndarray = _row(_chain(tokens)[-1])[layer, 2:].reshape(HEADS, DIM)
    return q


def dense_attention(tokens: list[int], layer: int) -> np.ndarray:
    """The answer: the last token's query over the K/V of positions ``lo .. n-1`` (lo = 0
    for full layers, ``n - WINDOW`` for window layers), float64, from the token list."""
    n = len(tokens)
    lo = max(0, n - WINDOW) if LAYER_GROUPS[layer] == 1 else 0
    rows = model_rows(tokens, range(lo, n))[:, layer].astype(np.float64)
    k = np.repeat(rows[:, 0], HEADS // KV_HEADS, axis=1)
    v = np.repeat(rows[:, 1], HEADS // KV_HEADS, axis=1)
    s = np.einsum("hd,nhd->hn", query(tokens, layer), k) / math.sqrt(DIM)
    p = np.exp(s - s.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    out: np.ndarray = np.einsum("hn,nhd->hd", p, v)
    return out


# ---- the loop -------------------------------------------------------------------------------


@dataclass
class Report:
    mismatches: list[str] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)

    def count(self, what: str, n: int = 1) -> None:
        self.counts[what] = self.counts.get(what, 0) + n


def write_kv(
    pool: KVCachePool, m: Any, ids: list[int], tokens: dict[int, list[int]], n: Any, r: Report
) -> None:
    """K/V of each sequence's last ``n`` tokens into every layer, through the slots of the
    layer's group (a slot the pool refuses is reported)."""
    counts = [n] * len(ids) if isinstance(n, int) else list(n)
    rows = np.concatenate(
        [
            model_rows(tokens[s], range(len(tokens[s]) - c, len(tokens[s])))
            for s, c in zip(ids, counts, strict=True)
        ]
    )
    slots = [m.slot_mapping(np.array(ids), np.array(counts), group=g) for g in range(len(GROUPS))]
    for layer in range(LAYERS):
        g = pool.group_of(layer)
        k = torch.from_numpy(rows[:, layer, 0].copy()).to(pool.device)
        v = torch.from_numpy(rows[:, layer, 1].copy()).to(pool.device)
        try:
            pool.write(layer, k, v, slots[g], group=g)
        except InvalidArgumentError as e:
            r.mismatches.append(f"layer {layer}: the pool refused the slots: {e}")


def check(pool: KVCachePool, m: Any, ids: list[int], tokens: dict[int, list[int]], r: Report):
    """Every layer's paged attention against dense attention; the window group's table
    holds nulls only as a leading run, the full group's none."""
    if not ids:
        return
    lens = np.array([len(tokens[s]) for s in ids], np.int32)
    tables = [m.block_tables(np.array(ids), group=g) for g in range(len(GROUPS))]
    if (tables[0] == 0).any():
        r.mismatches.append(f"a full-attention table holds the null block: {tables[0]}")
    for i, row in enumerate(tables[1]):
        nulls = int(np.argmax(row != 0)) if (row != 0).any() else row.size
        if (row[nulls:] == 0).any():
            r.mismatches.append(f"window table of {ids[i]} has a null after a block: {row}")
        r.count("window_nulls", nulls)
    for layer in range(LAYERS):
        g = pool.group_of(layer)
        q = torch.from_numpy(np.stack([query(tokens[s], layer) for s in ids])).to(pool.device)
        try:
            out = paged_decode_attention(q, pool, layer, tables[g], lens, group=g).cpu().double()
        except InvalidArgumentError as e:
            r.mismatches.append(f"layer {layer}: the pool refused the tables: {e}")
            continue
        for i, s in enumerate(ids):
            ref = dense_attention(tokens[s], layer)
            err = float(np.linalg.norm(out[i].numpy() - ref) / np.linalg.norm(ref))
            if err > TOL:
                r.mismatches.append(f"seq {s} len {lens[i]} layer {layer}: error {err:.2e}")
    if (pool.buffer[:, :, 0] != 0).any():
        r.mismatches.append("something wrote the null block 0")


def run_loop(m: Any, pool: KVCachePool, seed: int = 0, steps: int = STEPS) -> Report:
    rng = np.random.default_rng(seed)
    r = Report()
    tokens: dict[int, list[int]] = {}
    running: list[int] = []
    finished: list[int] = []
    next_id = 0
    seen_in: dict[int, set[int]] = {}  # block id -> the groups whose tables held it
    for step in range(steps):
        # admission: the system prompt plus a question, or a finished conversation continued
        if len(running) < MAX_RUNNING and step % 5 == 0:
            if finished and rng.random() < 0.6:
                prompt = tokens[finished.pop(0)] + [int(x) for x in rng.integers(0, 1000, 3)]
            else:
                prompt = SYSTEM + [int(x) for x in rng.integers(0, 1000, int(rng.integers(1, 12)))]
            sid, next_id = next_id, next_id + 1
            hit = m.allocate(sid, prompt)
            if hit is not None:
                tokens[sid] = prompt
                write_kv(pool, m, [sid], tokens, len(prompt) - hit, r)
                running.append(sid)
                r.count("hits", hit > 0)
                r.count("hits_past_window", hit > WINDOW)
                r.count("follow_up_hits", hit > len(SYSTEM))
                r.count("null_at_admission", int(m.block_table(sid, group=1)[0] == 0))
        # parallel sampling: the child diverges from its parent with copy-on-write
        if step % 17 == 8 and running and len(running) < MAX_RUNNING:
            child, next_id = next_id, next_id + 1
            m.fork(running[0], child)
            tokens[child] = list(tokens[running[0]])
            running.append(child)
        # finish the oldest now and then: its blocks stay cached for follow-ups
        if step % 9 == 6 and len(running) > 2:
            sid = running.pop(0)
            m.free(sid)
            finished.append(sid)
        if running:
            new = [int(x) for x in rng.integers(0, 1000, len(running))]
            pairs = m.append_batch(np.array(running), np.array(new))
            while pairs is None:  # preemption by recompute: drop the newest
                m.free(running.pop())
                r.count("preempted")
                if not running:
                    break
                new = new[: len(running)]
                pairs = m.append_batch(np.array(running), np.array(new))
            if running and pairs is not None:
                pool.copy_blocks(pairs)
                r.count("cow", len(pairs))
                for s, t in zip(running, new, strict=True):
                    tokens[s].append(t)
                write_kv(pool, m, running, tokens, 1, r)
        check(pool, m, running, tokens, r)
        m.check_invariants()
        for g in range(len(GROUPS)):
            for s in running:
                for b in m.block_table(s, group=g):
                    seen_in.setdefault(b, set()).add(g)
    # blocks released by the window and reused by the full group, or the other way round
    r.count("cross_group_reuse", sum(len(gs) > 1 for b, gs in seen_in.items() if b))
    r.count("longest", max(len(t) for t in tokens.values()))
    return r


def make_pool(backend: str = "cpu") -> KVCachePool:
    """ "cpu": the torch reference ops; "host": the kernel sources on the C++ harness;
    "cuda": the kernels on a GPU."""
    launcher = None
    if backend == "host":
        from test_kernels import _host_launcher

        launcher = _host_launcher()
    device = "cuda" if backend == "cuda" else "cpu"
    return KVCachePool(
        LAYERS,
        NUM_BLOCKS,
        BS,
        KV_HEADS,
        DIM,
        "float32",
        device,
        groups=GROUPS,
        layer_groups=LAYER_GROUPS,
        launcher=launcher,
    )


MANAGERS: dict[str, Callable[[], Any]] = {
    "rust": lambda: pagedkv.BlockManager(NUM_BLOCKS, BS, groups=GROUPS),
    "reference": lambda: ReferenceBlockManager(NUM_BLOCKS, BS, groups=GROUPS),
}


@pytest.mark.parametrize("impl", sorted(MANAGERS))
@pytest.mark.parametrize("seed", [0, 1])
def test_hybrid_decode_loop_matches_dense_attention(impl, seed):
    """On the CPU pool, with both managers."""
    r = run_loop(MANAGERS[impl](), make_pool(), seed)
    assert not r.mismatches, r.mismatches[:5]
    c = r.counts
    # the loop did what it claims: hybrid hits (the window group's table starts with the
    # null block at admission), decode well past the window (released entries), forks
    # with copy-on-write, and a full pool
    assert c.get("hits_past_window", 0) > 0 and c.get("null_at_admission", 0) > 0, c
    assert c.get("follow_up_hits", 0) > 0, c
    assert c["longest"] > 3 * WINDOW and c.get("window_nulls", 0) > 0, c
    assert c.get("cross_group_reuse", 0) > 0, c
    assert c.get("cow", 0) > 0 and c.get("preempted", 0) > 0, c


@pytest.mark.parametrize(
    "backend",
    [
        pytest.param("host", marks=[pytest.mark.slow, pytest.mark.manual]),
        pytest.param("cuda", marks=pytest.mark.gpu),
    ],
)
def test_hybrid_decode_loop_on_the_kernels(backend):
    """The same loop through the CUDA kernel sources: on the C++ harness (about two minutes
    on two cores, so left out of CI: marked manual) and on a GPU."""
    if backend == "cuda":
        from test_kernels import _cuda_ok

        if not _cuda_ok():
            pytest.skip("no CUDA device")
    r = run_loop(MANAGERS["rust"](), make_pool(backend))
    assert not r.mismatches, r.mismatches[:5]
    assert r.counts.get("window_nulls", 0) > 0 and r.counts.get("hits_past_window", 0) > 0


# ---- teeth ------------------------------------------------------------------------------------


class OneBlockTwoGroups:
    """A manager bug: the window group is given the full group's blocks (one block in two
    groups' tables at once)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def block_tables(self, ids: Any, pad: int = -1, *, group: int = 0) -> np.ndarray:
        return self.inner.block_tables(ids, pad, group=0)

    def slot_mapping(self, ids: Any, n: Any, *, lookahead: int = 0, group: int = 0) -> Any:
        return self.inner.slot_mapping(ids, n, lookahead=lookahead, group=0)


class SlotOffByOne(OneBlockTwoGroups):
    """A manager bug: the window group's slots point one position too far."""

    def block_tables(self, ids: Any, pad: int = -1, *, group: int = 0) -> np.ndarray:
        return self.inner.block_tables(ids, pad, group=group)

    def slot_mapping(self, ids: Any, n: Any, *, lookahead: int = 0, group: int = 0) -> Any:
        s = self.inner.slot_mapping(ids, n, lookahead=lookahead, group=group)
        return s + 1 if group == 1 else s


class ReleasesEarly(SlotOffByOne):
    """A manager bug: the window group's first block still in the window reads as null."""

    def slot_mapping(self, ids: Any, n: Any, *, lookahead: int = 0, group: int = 0) -> Any:
        return self.inner.slot_mapping(ids, n, lookahead=lookahead, group=group)

    def block_tables(self, ids: Any, pad: int = -1, *, group: int = 0) -> np.ndarray:
        t = self.inner.block_tables(ids, pad, group=group).copy()
        if group == 1:
            for row in t:
                real = np.flatnonzero(row > 0)
                if real.size > 1:
                    row[real[0]] = 0
        return t


def narrow_window(pool: KVCachePool) -> KVCachePool:
    """A pool bug: the window layers attend to one block fewer than the model's window."""
    narrow = KVCacheGroup("sliding_window", window=WINDOW - BS, num_layers=2)
    object.__setattr__(pool.layout, "groups", (GROUPS[0], narrow))
    return pool


def one_row(pool: KVCachePool) -> KVCachePool:
    """A pool bug: both layers of a group in the same row (they overwrite each other)."""
    object.__setattr__(pool.layout, "layer_row", (0, 0, 0, 0))
    return pool


def keep(x: Any) -> Any:
    return x


SABOTAGE = {
    "one_block_two_groups": (OneBlockTwoGroups, keep),
    "slot_off_by_one": (SlotOffByOne, keep),
    "releases_early": (ReleasesEarly, keep),
    "narrow_window": (keep, narrow_window),
    "one_row": (keep, one_row),
}


@pytest.mark.parametrize("name", sorted(SABOTAGE))
def test_check_has_teeth(name):
    wrap_manager, wrap_pool = SABOTAGE[name]
    r = run_loop(wrap_manager(MANAGERS["rust"]()), wrap_pool(make_pool()), steps=30)
    assert r.mismatches, f"sabotage {name} went unnoticed"
