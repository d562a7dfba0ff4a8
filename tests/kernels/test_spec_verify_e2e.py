"""End to end: speculative decoding's verification pass in a mixed batch, on the CPU KV pool.

Each step is one "forward pass" over every running sequence: prefill chunks (no drafts)
beside decodes with their own number of drafts (docs/semantics.md, "Speculative decoding
and FlashInfer"). The manager is asked once per step, with one lookahead per sequence:
``slot_mapping(ids, cs, lookahead=ks)`` says where the pass writes the K/V of each
sequence's computed tokens and drafts (one ``pool.write``), and
``flashinfer_page_table(ids, lookahead=ks)`` gives the pages the verification attends over.
The check, after every write: gathering through those pages returns exactly the K/V the
"model" (``test_engine_loop_e2e``'s: K/V of a position depend on its whole prefix) gives the
sequence's tokens plus its drafts, and decode attention from the last draft through the same
pages equals dense attention over them. Then the first ``a`` drafts are accepted
(``append``: their K/V is already in place, which the next step's check sees) and
``truncate`` gives the rejected drafts' blocks back.

``test_check_has_teeth``: an engine that leaves the lookahead out of the page table (the
page table before issue 21) must be caught.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import pagedkv  # noqa: E402
from pagedkv.device.pool import KVCachePool, paged_decode_attention  # noqa: E402
from pagedkv_reference import ReferenceBlockManager  # noqa: E402
from test_engine_loop_e2e import (  # noqa: E402
    BS,
    DIM,
    KV_HEADS,
    LAYERS,
    TOL,
    dense_attention,
    model_kv,
    query,
)

NUM_BLOCKS = 48
STEPS = 40
MAX_RUNNING = 4
MAX_DRAFTS = 5


def run_loop(kind: str, seed: int, sabotage: bool = False) -> tuple[list[str], dict[str, int]]:
    m: Any = (
        pagedkv.BlockManager(NUM_BLOCKS, BS)
        if kind == "rust"
        else ReferenceBlockManager(NUM_BLOCKS, BS)
    )
    pool = KVCachePool(LAYERS, NUM_BLOCKS, BS, KV_HEADS, DIM, "float32", "cpu")
    pool.buffer.fill_(float("nan"))  # a slot never written reads as NaN
    rng = np.random.default_rng(seed)
    tokens: dict[int, list[int]] = {}
    mismatches: list[str] = []
    seen = {"mixed_steps": 0, "accepted": 0, "crossings": 0, "copies": 0}
    next_id = 0
    shared = [int(x) for x in rng.integers(0, 1000, 9)]  # a system prompt: prefix hits

    for step in range(STEPS):
        ids: list[int] = []
        cs: list[int] = []
        ks: list[int] = []
        drafts: dict[int, list[int]] = {}
        if len(tokens) < MAX_RUNNING:  # admission: the hit plus a first chunk
            prompt = shared + [int(x) for x in rng.integers(0, 1000, int(rng.integers(1, 8)))]
            hit = m.allocate(next_id, prompt, num_new_tokens=int(rng.integers(1, 7)))
            if hit is not None:
                tokens[next_id] = prompt
                ids.append(next_id)
                cs.append(m.num_scheduled_tokens(next_id) - hit)
                ks.append(0)
                next_id += 1
        for sid in [s for s in tokens if s not in ids]:
            s = m.num_scheduled_tokens(sid)
            if s < len(tokens[sid]):  # the next prefill chunk
                c = min(len(tokens[sid]) - s, int(rng.integers(1, 7)))
                pairs, k = m.extend(sid, c), 0
            else:  # a decode: its new token plus k drafts
                c, k = 1, int(rng.integers(0, MAX_DRAFTS + 1))
                t = int(rng.integers(0, 1000))
                pairs = m.append(sid, [t], lookahead=k)
                if pairs is not None:
                    tokens[sid].append(t)
                    drafts[sid] = [int(x) for x in rng.integers(0, 1000, k)]
            if pairs is None:
                continue
            if len(pairs):
                seen["copies"] += len(pairs)
                pool.copy_blocks(np.asarray(pairs, np.int32).reshape(-1, 2))
            ids.append(sid)
            cs.append(c)
            ks.append(k)
        if not ids:
            continue
        seen["mixed_steps"] += 0 in ks and any(ks)
        ext = {sid: tokens[sid] + drafts.get(sid, []) for sid in ids}  # tokens, then drafts
        sched = [m.num_scheduled_tokens(sid) for sid in ids]
        lens = [s + k for s, k in zip(sched, ks, strict=True)]

        # The forward pass: one write of every computed token and draft.
        slots = np.asarray(m.slot_mapping(ids, cs, lookahead=np.asarray(ks)))
        assert len(slots) == sum(cs) + sum(ks)
        rows_of = zip(ids, sched, cs, lens, strict=True)
        kv = np.concatenate([model_kv(ext[sid], range(s - c, n)) for sid, s, c, n in rows_of])
        kv_t = torch.from_numpy(kv)
        for layer in range(LAYERS):
            pool.write(layer, kv_t[:, layer, 0], kv_t[:, layer, 1], slots)

        # The verification's pages, and attention through them.
        page_table = m.flashinfer_page_table(ids) if sabotage else None
        if page_table is None:
            page_table = m.flashinfer_page_table(ids, lookahead=ks)
        indptr, indices, last = (np.asarray(x) for x in page_table)
        n_pages = np.diff(indptr)
        covered = (n_pages - 1) * BS + last  # the positions the pages hold, per sequence
        seen["crossings"] += sum(
            k > 0 and (s - 1) // BS != (n - 1) // BS
            for s, k, n in zip(sched, ks, lens, strict=True)
        )
        tables = np.zeros((len(ids), int(n_pages.max())), np.int32)
        for i in range(len(ids)):
            tables[i, : n_pages[i]] = indices[indptr[i] : indptr[i + 1]]
        cu = np.concatenate([[0], np.cumsum(covered)]).astype(np.int32)
        qs = [query(ext[sid][:n]) for sid, n in zip(ids, lens, strict=True)]
        for layer in range(LAYERS):
            k_all, v_all = pool.gather(layer, tables, cu)
            q = torch.from_numpy(np.stack([x[layer] for x in qs]))
            out = paged_decode_attention(q, pool, layer, tables, covered).double().numpy()
            for i, (sid, n) in enumerate(zip(ids, lens, strict=True)):
                want = model_kv(ext[sid][:n])
                rows = slice(int(cu[i]), int(cu[i + 1]))
                same = (
                    covered[i] == n
                    and np.array_equal(k_all[rows].numpy(), want[:, layer, 0])
                    and np.array_equal(v_all[rows].numpy(), want[:, layer, 1])
                )
                ref = dense_attention(qs[i][layer], want[:, layer, 0], want[:, layer, 1])
                err = float(np.max(np.abs(out[i] - ref)))
                if not same or not err <= TOL:
                    mismatches.append(
                        f"step {step} seq {sid} layer {layer}: pages cover {covered[i]} of "
                        f"{n} positions, attention err {err}"
                    )

        # Verification's outcome: the first `a` drafts are accepted, the rest rejected.
        for sid, k in zip(ids, ks, strict=True):
            if sid not in drafts:
                continue
            a = int(rng.integers(0, k + 1))
            if a:
                assert m.append(sid, drafts[sid][:a]) == []
                tokens[sid] += drafts[sid][:a]
                seen["accepted"] += a
            if k:
                assert m.truncate(sid, len(tokens[sid])) == []
            if len(tokens[sid]) > 40 or rng.random() < 0.05:
                m.free(sid)
                del tokens[sid]
        m.check_invariants()
    return mismatches, seen


@pytest.fixture(autouse=True)
def _one_torch_thread() -> Any:
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.mark.parametrize("kind", ["rust", "reference"])
@pytest.mark.parametrize("seed", [0, 1])
def test_verification_pass_reads_the_drafts_it_wrote(kind: str, seed: int) -> None:
    mismatches, seen = run_loop(kind, seed)
    assert mismatches == [], mismatches[:5]
    # the loop really mixed prefills with drafting decodes, crossed blocks, accepted drafts
    assert seen["mixed_steps"] >= 5 and seen["crossings"] >= 5 and seen["accepted"] >= 10, seen


@pytest.mark.parametrize("kind", ["rust", "reference"])
def test_check_has_teeth(kind: str) -> None:
    """Pages of the scheduled tokens only: the verification misses the drafts' slots."""
    mismatches, _ = run_loop(kind, 0, sabotage=True)
    assert mismatches
