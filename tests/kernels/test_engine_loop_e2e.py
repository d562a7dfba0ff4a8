"""End to end: a chunked-prefill plus speculative-decoding engine loop on the CPU KV pool.

A tiny deterministic "model" gives every token position K and V that depend on the whole
token prefix up to it (a chain digest seeds them), so a block served from the prefix cache
holds the right KV only if it was really written for exactly that prefix. The loop drives
the manager the way an engine does (docs/semantics.md, issue 9):

- admission: ``allocate(seq, prompt, num_new_tokens=c)``, the hit plus a first chunk;
  chunked prefill with ``extend``; a per-step token budget;
- decode with drafts: ``append(seq, [t], lookahead=k)``, K/V of ``t`` and of ``k`` drafts
  written into ``slot_mapping(.., 1, lookahead=k)``; ``a`` drafts accepted (appended: their
  KV must already sit in the right slots), then ``truncate`` gives the rejected drafts'
  blocks back; random roll-backs (``truncate`` a few tokens, into shared prompt blocks too);
- parallel sampling (``fork``), multi-turn follow-ups (a later prompt extends a finished
  sequence, so it hits blocks written by decode and by accepted drafts), preemption by
  recompute when a call returns None;
- aborts whose last scheduled step never ran: a chunk (or a decode token) is scheduled, its
  slots are poisoned with NaN instead of written, and ``free(seq, num_computed_tokens=c)``
  says which tokens have KV; a retry of the same prompt follows at once, so a block whose KV
  was never written would be served to it if the manager kept it registered.

Every copy-on-write pair is applied (``copy_blocks``) before the writes of the call that
returned it. After every step, for every live sequence: ``flashinfer_page_table`` must cover
exactly its scheduled tokens, ``gather`` through those pages must return exactly the KV the
model gives its tokens, and ``paged_decode_attention`` (query from its last token) must match
dense attention computed from scratch from its token list.

``test_check_has_teeth`` runs the same loop against sabotaged engines (registration of the
whole prompt at allocate while only a chunk is written, aborts that do not report the
computed tokens, copy pairs not applied) and requires the check to report mismatches.
"""

from __future__ import annotations

import hashlib
import math
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import pagedkv  # noqa: E402
from pagedkv.device.pool import KVCachePool, paged_decode_attention  # noqa: E402

LAYERS, HEADS, KV_HEADS, DIM, BS = 2, 4, 2, 16, 4
NUM_BLOCKS = 20
BUDGET = 12  # tokens computed per step (decode tokens + drafts + prefill chunks)
MAX_CHUNK = 6
MAX_RUNNING = 4
MAX_DRAFTS = 3
MAX_STEPS = 400
TOL = 1e-5

# ---- the "model" ----------------------------------------------------------------------------

_ROOT = hashlib.blake2b(b"engine-loop-e2e", digest_size=16).digest()
_ROWS: dict[bytes, np.ndarray] = {}


def _chain(tokens: list[int]) -> list[bytes]:
    """Digest of every prefix ``tokens[: p + 1]``."""
    out, d = [], _ROOT
    for t in tokens:
        d = hashlib.blake2b(d + t.to_bytes(4, "little"), digest_size=16).digest()
        out.append(d)
    return out


def _row(d: bytes) -> np.ndarray:
    """K and V of the token whose prefix digest is ``d``: ``[LAYERS, 2, KV_HEADS, DIM]``."""
    r = _ROWS.get(d)
    if r is None:
        rng = np.random.default_rng(int.from_bytes(d[:8], "little"))
        r = _ROWS[d] = rng.standard_normal((LAYERS, 2, KV_HEADS, DIM), dtype=np.float32)
    return r


def model_kv(tokens: list[int], positions: range | None = None) -> np.ndarray:
    """``[len(positions), LAYERS, 2, KV_HEADS, DIM]``: the KV of ``tokens`` at ``positions``
    (all of them by default), each a function of the prefix up to and including it."""
    digests = _chain(tokens)
    pos = range(len(tokens)) if positions is None else positions
    if not pos:
        return np.zeros((0, LAYERS, 2, KV_HEADS, DIM), np.float32)
    return np.stack([_row(digests[p]) for p in pos])


def query(tokens: list[int]) -> np.ndarray:
    """``[LAYERS, HEADS, DIM]``: the query of the last token (a function of its prefix)."""
    d = _chain(tokens)[-1]
    rng = np.random.default_rng(int.from_bytes(d[8:], "little"))
    return rng.standard_normal((LAYERS, HEADS, DIM), dtype=np.float32)


def dense_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
    """One query ``[HEADS, DIM]`` over ``k, v [n, KV_HEADS, DIM]`` (GQA), float64."""
    group = HEADS // KV_HEADS
    kk = np.repeat(k.astype(np.float64), group, axis=1)
    vv = np.repeat(v.astype(np.float64), group, axis=1)
    s = np.einsum("hd,nhd->hn", q.astype(np.float64), kk) / math.sqrt(DIM)
    p = np.exp(s - s.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    out: np.ndarray = np.einsum("hn,nhd->hd", p, vv)
    return out


# ---- sabotaged engines (for the teeth test) --------------------------------------------------


class EagerRegistration:
    """An engine on the old contract: ``allocate`` schedules (so registers) the whole prompt
    at once while the loop computes it chunk by chunk, and ``free`` does not say which tokens
    were computed. Its own view of the scheduled tokens drives slot mappings and pages."""

    def __init__(self, inner: pagedkv.BlockManager) -> None:
        self.inner = inner
        self.pending: dict[int, int] = {}  # seq -> tokens the loop has scheduled so far

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def allocate(self, seq_id: int, token_ids: list[int], *, num_new_tokens: int) -> int | None:
        hit = self.inner.allocate(seq_id, tuple(token_ids))
        if hit is not None and hit + num_new_tokens < len(token_ids):
            self.pending[seq_id] = hit + num_new_tokens
        return hit

    def extend(self, seq_id: int, num_new_tokens: int) -> list[tuple[int, int]]:
        s = self.pending.pop(seq_id) + num_new_tokens
        if s < self.inner.num_tokens(seq_id):
            self.pending[seq_id] = s
        return []

    def num_scheduled_tokens(self, seq_id: int) -> int:
        return self.pending.get(seq_id, self.inner.num_scheduled_tokens(seq_id))

    def slot_mapping(
        self, seq_ids: list[int], num_new_tokens: int, *, lookahead: int = 0
    ) -> np.ndarray:
        (sid,) = seq_ids
        if sid not in self.pending:
            return self.inner.slot_mapping(tuple(seq_ids), num_new_tokens, lookahead=lookahead)
        assert lookahead == 0  # the loop drafts only after the prompt is scheduled
        s, table = self.pending[sid], self.inner.block_table(sid)
        return np.array([table[p // BS] * BS + p % BS for p in range(s - num_new_tokens, s)])

    def flashinfer_page_table(self, seq_ids: np.ndarray) -> tuple[np.ndarray, ...]:
        indptr, indices, last = [0], [], []
        for sid in seq_ids.tolist():
            s = self.num_scheduled_tokens(sid)
            pages = -(-s // BS)
            indices += self.inner.block_table(sid)[:pages]
            indptr.append(len(indices))
            last.append(s - (pages - 1) * BS)
        return tuple(np.array(x, np.int32) for x in (indptr, indices, last))

    def free(self, seq_id: int, *, num_computed_tokens: int | None = None) -> None:
        self.pending.pop(seq_id, None)
        self.inner.free(seq_id)


class NoRetraction:
    """An engine that frees aborted sequences without saying which tokens were computed."""

    def __init__(self, inner: pagedkv.BlockManager) -> None:
        self.inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def free(self, seq_id: int, *, num_computed_tokens: int | None = None) -> None:
        self.inner.free(seq_id)


# ---- the engine loop -------------------------------------------------------------------------


@dataclass
class Request:
    tokens: list[int]
    target: int  # total length at which the request finishes
    decoded_from: int  # tokens from here on were produced by decode (append, drafts)
    turn: int = 0
    scheduled: int = 0  # tokens scheduled so far; all of them have their KV written


@dataclass
class Result:
    mismatches: list[str] = field(default_factory=list)
    counters: Counter[str] = field(default_factory=Counter)
    finished: int = 0
    steps: int = 0


def _make(kind: str) -> Any:
    if kind == "rust":
        return pagedkv.BlockManager(num_blocks=NUM_BLOCKS, block_size=BS)
    from pagedkv_reference import ReferenceBlockManager

    return ReferenceBlockManager(NUM_BLOCKS, BS)


def run_engine(
    kind: str, seed: int, sabotage: str | None = None, *, nan: bool = True, stop: bool = False
) -> Result:
    """Run the loop; ``nan``: the pool starts as NaN and the slots of a step that never ran
    are set to NaN (else the pool starts as zeros and those slots are just not written);
    ``stop``: return after the first step with a mismatch."""
    mgr = _make(kind)
    m: Any = mgr
    if sabotage == "eager_registration":
        m = EagerRegistration(mgr)
    elif sabotage == "no_retraction":
        m = NoRetraction(mgr)
    apply_copies = sabotage != "skip_copies"

    pool = KVCachePool(LAYERS, NUM_BLOCKS, BS, KV_HEADS, DIM, "float32", "cpu")
    if nan:
        pool.buffer.fill_(float("nan"))  # a slot never written reads as NaN
    rng = np.random.default_rng(seed)
    res = Result()
    cnt = res.counters

    def toks(n: int) -> list[int]:
        return [int(x) for x in rng.integers(0, 1000, n)]

    systems = [toks(10), toks(7), toks(13)]
    waiting: deque[Request] = deque()
    for i in range(12):
        prompt = systems[i % 3] + toks(int(rng.integers(1, 7)))
        waiting.append(Request(prompt, len(prompt) + int(rng.integers(4, 12)), len(prompt)))
    running: dict[int, Request] = {}
    next_sid = 0

    def apply(pairs: Any) -> None:
        assert pairs is not None
        pairs = np.asarray(pairs, np.int32).reshape(-1, 2)
        cnt["copy_pairs"] += len(pairs)
        if apply_copies and len(pairs):
            pool.copy_blocks(pairs)

    def write(tokens: list[int], positions: range, slots: np.ndarray) -> None:
        assert slots.shape == (len(positions),), (slots.shape, positions)
        kv = torch.from_numpy(model_kv(tokens, positions))
        for layer in range(LAYERS):
            pool.write(layer, kv[:, layer, 0], kv[:, layer, 1], slots)

    def poison(slots: np.ndarray) -> None:
        """The step that scheduled these slots never ran: their content is undefined."""
        if not nan:
            return
        nans = torch.full((len(slots), KV_HEADS, DIM), float("nan"))
        for layer in range(LAYERS):
            pool.write(layer, nans, nans, slots)

    def retire(sid: int, computed: int | None = None) -> Request:
        r = running.pop(sid)
        m.free(sid, num_computed_tokens=computed)
        return r

    def preempt(sid: int) -> None:
        """Out of blocks: recompute later (every scheduled token has its KV)."""
        r = retire(sid, running[sid].scheduled)
        waiting.appendleft(Request(r.tokens, r.target, r.decoded_from, r.turn))
        cnt["preemptions"] += 1

    def abort_unwritten(sid: int, slots: np.ndarray, computed: int, tokens: list[int]) -> None:
        """Abort a sequence whose last scheduled step never ran, then retry its prompt."""
        poison(slots)
        r = retire(sid, computed)
        waiting.appendleft(Request(tokens, max(r.target, len(tokens) + 2), r.decoded_from, r.turn))
        cnt["aborts_unwritten"] += 1

    def maybe_fork(sid: int) -> None:
        """Parallel sampling: once its prompt is scheduled, a sequence may get a sibling."""
        r = running[sid]
        if r.scheduled < len(r.tokens) or len(running) > MAX_RUNNING or rng.random() > 0.3:
            return
        nonlocal next_sid
        child = next_sid
        next_sid += 1
        m.fork(sid, child)
        running[child] = Request(list(r.tokens), r.target + 2, r.decoded_from, r.turn, r.scheduled)
        cnt["forks"] += 1

    def check(step: int) -> None:
        ids = sorted(running)
        if not ids:
            return
        arr = np.array(ids, np.int64)
        s = np.array([m.num_scheduled_tokens(i) for i in ids], np.int32)
        for sid, si in zip(ids, s.tolist(), strict=True):
            assert si == running[sid].scheduled, (sid, si, running[sid].scheduled)
        indptr, indices, last = (np.asarray(x) for x in m.flashinfer_page_table(arr))
        pages = -(-s // BS)
        assert np.array_equal(np.diff(indptr), pages)
        assert np.array_equal(last, s - (pages - 1) * BS)
        tables = np.zeros((len(ids), int(pages.max())), np.int32)
        for i, sid in enumerate(ids):
            row = indices[indptr[i] : indptr[i + 1]]
            assert list(row) == m.block_table(sid)[: pages[i]], sid
            tables[i, : pages[i]] = row
        cu = np.concatenate([[0], np.cumsum(s)]).astype(np.int32)
        want = [model_kv(running[sid].tokens[: s[i]]) for i, sid in enumerate(ids)]
        qs = [query(running[sid].tokens[: s[i]]) for i, sid in enumerate(ids)]
        block_tables = m.block_tables(arr)
        for layer in range(LAYERS):
            k, v = pool.gather(layer, tables, cu)
            q = torch.from_numpy(np.stack([x[layer] for x in qs]))
            out = paged_decode_attention(q, pool, layer, block_tables, s).double().numpy()
            for i, sid in enumerate(ids):
                rows = slice(int(cu[i]), int(cu[i + 1]))
                wk, wv = want[i][:, layer, 0], want[i][:, layer, 1]
                bad = ~(
                    np.all(k[rows].numpy() == wk, axis=(1, 2))
                    & np.all(v[rows].numpy() == wv, axis=(1, 2))
                )
                ref = dense_attention(qs[i][layer], wk, wv)
                err = float(np.max(np.abs(out[i] - ref)))
                if bad.any() or not err <= TOL:
                    res.mismatches.append(
                        f"step {step} seq {sid} layer {layer}: positions "
                        f"{np.flatnonzero(bad).tolist()} of {s[i]} differ, attention err {err}"
                    )

    for step in range(MAX_STEPS):
        if not waiting and not running:
            break
        res.steps = step + 1
        budget = BUDGET

        # 1. decode with speculative drafts
        for sid in [x for x, r in running.items() if r.scheduled == len(r.tokens)]:
            if budget < 1:
                break
            r = running[sid]
            k = int(rng.integers(0, min(MAX_DRAFTS, budget - 1) + 1))
            budget -= 1 + k
            n, t, drafts = len(r.tokens), toks(1)[0], toks(k)
            pairs = m.append(sid, [t], lookahead=k)
            if pairs is None:
                preempt(sid)
                continue
            apply(pairs)
            slots = np.asarray(m.slot_mapping([sid], 1, lookahead=k))
            ext = [*r.tokens, t, *drafts]
            if rng.random() < 0.03:  # the forward pass of this step never ran
                abort_unwritten(sid, slots, n, [*r.tokens, t])
                continue
            write(ext, range(n, n + 1 + k), slots)
            r.tokens.append(t)
            r.scheduled += 1
            a = int(rng.integers(0, k + 1))
            if a:
                pairs = m.append(sid, drafts[:a])
                assert pairs == [], pairs  # draft blocks are this sequence's own
                r.tokens += drafts[:a]
                r.scheduled += a
                # the accepted drafts' KV is already where their tokens live
                assert np.array_equal(m.slot_mapping([sid], 1 + a), slots[: 1 + a])
                cnt["accepted"] += a
            cnt["rejected"] += k - a
            if k:
                # the rejected drafts' blocks go back; the partial block is not hashed
                assert m.truncate(sid, len(r.tokens)) == []
                assert len(m.block_table(sid)) == -(-len(r.tokens) // BS)
            if rng.random() < 0.12:  # roll back a few tokens (maybe into the prompt)
                keep = max(1, len(r.tokens) - int(rng.integers(1, 7)))
                pairs = m.truncate(sid, keep)
                if pairs is not None:
                    cnt["rollback_copies"] += len(pairs)
                    apply(pairs)
                    del r.tokens[keep:]
                    r.scheduled = keep
                    cnt["rollbacks"] += 1
            if len(r.tokens) >= r.target:
                retire(sid)
                res.finished += 1
                if r.turn < 2 and rng.random() < 0.5:  # the user answers: a new turn
                    prompt = r.tokens + toks(int(rng.integers(1, 5)))
                    waiting.append(
                        Request(
                            prompt,
                            len(prompt) + int(rng.integers(2, 7)),
                            r.decoded_from,
                            r.turn + 1,
                        )
                    )
            elif rng.random() < 0.02:  # user abort; every scheduled token was computed
                retire(sid)
                cnt["aborts"] += 1

        # 2. chunked prefill of the admitted prompts
        for sid in [x for x, r in running.items() if r.scheduled < len(r.tokens)]:
            if budget < 1:
                break
            r = running[sid]
            c = min(len(r.tokens) - r.scheduled, int(rng.integers(1, MAX_CHUNK + 1)), budget)
            pairs = m.extend(sid, c)
            if pairs is None:
                preempt(sid)
                continue
            apply(pairs)
            slots = np.asarray(m.slot_mapping([sid], c))
            if rng.random() < 0.1:
                abort_unwritten(sid, slots, r.scheduled, r.tokens)
                continue
            write(r.tokens, range(r.scheduled, r.scheduled + c), slots)
            r.scheduled += c
            budget -= c
            maybe_fork(sid)

        # 3. admission: prefix hit plus a first chunk
        while waiting and len(running) < MAX_RUNNING and budget >= 1:
            r = waiting[0]
            n = len(r.tokens)
            c = min(int(rng.integers(1, MAX_CHUNK + 1)), budget)
            expect = m.lookup(r.tokens)
            sid = next_sid
            hit = m.allocate(sid, r.tokens, num_new_tokens=c)
            if hit is None:
                break
            waiting.popleft()
            next_sid += 1
            assert hit == expect, (hit, expect)
            cnt["hit_tokens"] += hit
            cnt["hits_on_decoded_kv"] += hit > r.decoded_from  # KV written by decode
            running[sid] = r
            s = min(hit + c, n)
            slots = np.asarray(m.slot_mapping([sid], s - hit))
            if rng.random() < 0.1:
                abort_unwritten(sid, slots, hit, r.tokens)
                continue
            write(r.tokens, range(hit, s), slots)
            r.scheduled = s
            budget -= s - hit
            maybe_fork(sid)

        check(step)
        mgr.check_invariants()
        if stop and res.mismatches:
            return res

    assert not waiting and not running, f"not done after {MAX_STEPS} steps"
    st = mgr.stats()
    cnt["evictions"] = st.evictions
    cnt["retracted_blocks"] = st.unregistered_blocks
    cnt["truncated_blocks"] = st.truncated_blocks
    return res


MANAGERS = ["rust", "reference"]


@pytest.fixture(autouse=True)
def _one_torch_thread() -> Any:
    """Tiny CPU ops: torch's thread pool only adds overhead (and stalls on busy machines)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.mark.parametrize("kind", MANAGERS)
@pytest.mark.parametrize("seed", [0, 2, 6])
def test_engine_loop_matches_dense_attention(kind: str, seed: int) -> None:
    res = run_engine(kind, seed)
    assert res.mismatches == [], res.mismatches[:5]
    cnt = res.counters
    # the loop really exercised what it is meant to (each path below is taken)
    for what in (
        "hit_tokens",
        "copy_pairs",
        "accepted",
        "rejected",
        "rollbacks",
        "aborts_unwritten",
        "preemptions",
        "forks",
        "retracted_blocks",
        "truncated_blocks",
        "evictions",
        "hits_on_decoded_kv",
        "rollback_copies",
    ):
        assert cnt[what] > 0, (what, dict(cnt))
    assert res.finished >= 12, (res.finished, dict(cnt))


@pytest.mark.parametrize("kind", MANAGERS)
@pytest.mark.parametrize("nan", [True, False], ids=["nan", "stale"])
@pytest.mark.parametrize("sabotage", ["eager_registration", "no_retraction", "skip_copies"])
def test_check_has_teeth(kind: str, sabotage: str, nan: bool) -> None:
    """The same loop with an engine that breaks the contract: the check must see it, also
    when the unwritten slots hold stale KV rather than NaN."""
    res = run_engine(kind, 0, sabotage, nan=nan, stop=True)
    assert len(res.mismatches) > 0, dict(res.counters)
