"""End to end: a small decode loop driven by the block manager, with the pool and its
kernels, no glue code: COW pairs go to copy_blocks, swap pairs to swap_blocks, slot
mappings to write, block tables to paged attention. Every step, the paged attention output
of every running sequence equals dense attention over that sequence's full history.

K/V of a token is a deterministic function of the token ids up to it (as in a model), so
blocks served from the prefix cache hold exactly what the sequence would have written.
Runs on the CPU reference path, on the C++ host harness, and on a GPU when there is one.
"""

from __future__ import annotations

import hashlib
import math
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import pagedkv  # noqa: E402
from pagedkv.device import cpu_ops  # noqa: E402
from pagedkv.device.pool import KVCachePool, paged_decode_attention, swap_blocks  # noqa: E402

LAYERS, HEADS, KV_HEADS, DIM, BS = 2, 4, 2, 64, 4


def token_kv(prefix: tuple[int, ...], layer: int) -> tuple[Any, Any]:
    seed = int.from_bytes(hashlib.sha256(repr((prefix, layer)).encode()).digest()[:4], "little")
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn((2, KV_HEADS, DIM), generator=g)
    return kv[0], kv[1]


def make(backend: str, dtype: str) -> tuple[KVCachePool, KVCachePool]:
    if backend == "cpu":
        gpu = KVCachePool(LAYERS, 20, BS, KV_HEADS, DIM, dtype, "cpu")
        return gpu, gpu.swap_pool(12)
    if backend == "host":
        from test_kernels import _host_launcher

        launcher = _host_launcher()
        gpu = KVCachePool(LAYERS, 20, BS, KV_HEADS, DIM, dtype, "cpu", launcher=launcher)
        cpu = gpu.swap_pool(12)
        cpu._launcher = launcher
        return gpu, cpu
    gpu = KVCachePool(LAYERS, 20, BS, KV_HEADS, DIM, dtype, "cuda")
    return gpu, gpu.swap_pool(12)


@pytest.mark.parametrize(
    ("backend", "dtype"),
    [
        ("cpu", "float32"),
        ("host", "bfloat16"),
        pytest.param("cuda", "bfloat16", marks=pytest.mark.gpu),
        pytest.param("cuda", "float16", marks=pytest.mark.gpu),
    ],
)
def test_decode_loop_matches_dense_attention(backend, dtype):
    if backend == "cuda":
        from test_kernels import _cuda_ok

        if not _cuda_ok():
            pytest.skip("no CUDA device")
    gpu, cpu = make(backend, dtype)
    dev = gpu.device
    tdt = getattr(torch, dtype)
    m = pagedkv.BlockManager(num_blocks=20, block_size=BS, num_cpu_blocks=12)
    rng = np.random.default_rng(0)
    tokens: dict[int, list[int]] = {}
    qgen = torch.Generator().manual_seed(1)
    counters = {"hits": 0, "cow": 0, "swap_out": 0, "swap_in": 0, "evict_steps": 0}

    def write_tokens(sid: int, start: int) -> None:
        toks = tokens[sid]
        n = len(toks) - start
        slots = m.slot_mapping(np.array([sid]), n)
        for layer in range(LAYERS):
            kv = [token_kv(tuple(toks[: p + 1]), layer) for p in range(start, len(toks))]
            k = torch.stack([a for a, _ in kv]).to(tdt).to(dev)
            v = torch.stack([b for _, b in kv]).to(tdt).to(dev)
            gpu.write(layer, k, v, slots)

    def check(ids: list[int]) -> None:
        if not ids:
            return
        arr = np.array(ids)
        tables = m.block_tables(arr)
        lens = np.array([len(tokens[s]) for s in ids], np.int32)
        for layer in range(LAYERS):
            q = torch.randn((len(ids), HEADS, DIM), generator=qgen).to(tdt)
            out = paged_decode_attention(q.to(dev), gpu, layer, tables, lens).cpu().double()
            for i, s in enumerate(ids):
                kv = [token_kv(tuple(tokens[s][: p + 1]), layer) for p in range(len(tokens[s]))]
                k = torch.stack([a for a, _ in kv]).to(tdt).double().repeat_interleave(2, dim=1)
                v = torch.stack([b for _, b in kv]).to(tdt).double().repeat_interleave(2, dim=1)
                p = torch.softmax(
                    torch.einsum("hd,nhd->hn", q[i].double(), k) / math.sqrt(DIM), dim=-1
                )
                ref = torch.einsum("hn,nhd->hd", p, v)
                err = float((out[i] - ref).norm() / ref.norm())
                assert err < (2e-2 if dtype == "bfloat16" else 1e-4), (s, layer, err)

    system = [int(x) for x in rng.integers(0, 1000, 9)]
    next_id = 0
    running: list[int] = []
    swapped: list[int] = []
    for step in range(14):
        # admit a request sharing the system prompt (prefix hits once blocks are cached)
        if step % 3 == 0:
            sid = next_id
            next_id += 1
            prompt = system + [int(x) for x in rng.integers(0, 1000, int(rng.integers(1, 6)))]
            hit = m.allocate(sid, prompt)
            if hit is not None:
                tokens[sid] = prompt
                counters["hits"] += hit > 0
                write_tokens(sid, hit)
                running.append(sid)
        # parallel sampling: fork, the child diverges with copy-on-write
        if step == 4 and running:
            child = next_id
            next_id += 1
            m.fork(running[0], child)
            tokens[child] = list(tokens[running[0]])
            running.append(child)
        # preempt by swap, and bring it back later
        if step == 6 and len(running) > 1:
            sid = running.pop(1)
            pairs = m.swap_out(sid)
            if pairs is not None:
                swap_blocks(gpu, cpu, pairs)
                counters["swap_out"] += 1
                swapped.append(sid)
            else:
                running.insert(1, sid)
        if step == 10 and swapped:
            sid = swapped[0]
            pairs = m.swap_in(sid)
            if pairs is not None:
                swap_blocks(cpu, gpu, pairs)
                counters["swap_in"] += 1
                swapped.pop(0)
                running.append(sid)
        # finish the oldest sequence now and then: its full blocks stay cached
        if step % 4 == 3 and len(running) > 2:
            m.free(running.pop(0))
        # one decode step for all running sequences
        if running:
            ev = m.stats().evictions
            new = [int(x) for x in rng.integers(0, 1000, len(running))]
            pairs = m.append_batch(np.array(running), np.array(new))
            while pairs is None:  # preempt by recompute: drop the newest
                m.free(running.pop())
                if not running:
                    break
                pairs = m.append_batch(np.array(running), np.array(new[: len(running)]))
            if running and pairs is not None:
                gpu.copy_blocks(pairs)
                counters["cow"] += len(pairs)
                for sid, t in zip(running, new, strict=False):
                    tokens[sid].append(t)
                slots = m.slot_mapping(np.array(running), 1)
                for layer in range(LAYERS):
                    kv = [token_kv(tuple(tokens[s]), layer) for s in running]
                    k = torch.stack([a for a, _ in kv]).to(tdt).to(dev)
                    v = torch.stack([b for _, b in kv]).to(tdt).to(dev)
                    gpu.write(layer, k, v, slots)
            counters["evict_steps"] += m.stats().evictions > ev
        check(running)
        m.check_invariants()
    stats = m.stats()
    assert counters["hits"] > 0 and counters["cow"] > 0
    assert counters["swap_out"] == 1 and counters["swap_in"] == 1
    assert stats.evictions > 0, counters


def test_cpu_reference_matches_dense_numpy():
    """The CPU reference itself against a direct numpy formula (one sequence, GQA 2)."""
    g = torch.Generator().manual_seed(0)
    pool = KVCachePool(1, 3, 4, 1, 8, "float32", "cpu")
    pool.buffer.copy_(torch.randn(pool.buffer.shape, generator=g))
    q = torch.randn((1, 2, 8), generator=g)
    out = paged_decode_attention(q, pool, 0, np.array([[2, 0]]), np.array([6]), scale=0.5)
    k = pool.key(0).reshape(-1, 1, 8)[[8, 9, 10, 11, 0, 1], 0].numpy()
    v = pool.value(0).reshape(-1, 1, 8)[[8, 9, 10, 11, 0, 1], 0].numpy()
    for h in range(2):
        s = k @ q[0, h].numpy() * 0.5
        p = np.exp(s - s.max())
        p /= p.sum()
        np.testing.assert_allclose(out[0, h].numpy(), p @ v, rtol=1e-5, atol=1e-6)
    assert cpu_ops.default_scale(64) == 0.125
