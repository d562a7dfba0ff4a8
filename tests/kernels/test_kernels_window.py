"""Decode attention with a sliding window or chunked-local attention (the layers of
sliding_window and chunked_local groups), kernel source against the CPU reference.

The kernel runs on the C++ host harness ("host", every commit) and on a GPU where there is
one ("cuda"). Each case builds tables the way a manager with groups does: entries wholly
before the attended span hold the null block 0, the rest real blocks. Every slot the query
must not read (block 0 whole, and the positions of a real block before the span) is NaN,
so a kernel that reads one gives NaN; a kernel that drops a position it should read is off
by more than the fp32 tolerance. The CPU reference itself is checked against a formula
written out position by position.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from pagedkv.device import cpu_ops  # noqa: E402
from pagedkv.device.pool import KVCachePool, paged_decode_attention  # noqa: E402
from pagedkv.errors import InvalidArgumentError  # noqa: E402
from pagedkv.groups import KVCacheGroup  # noqa: E402
from test_kernels import ATTN_RTOL, _cuda_ok, _host_launcher, randn, rel_err  # noqa: E402


@pytest.fixture(params=["host", pytest.param("cuda", marks=pytest.mark.gpu)])
def backend(request: pytest.FixtureRequest) -> str:
    if request.param == "cuda" and not _cuda_ok():
        pytest.skip("no CUDA device")
    if request.param == "host":
        _host_launcher()
    return str(request.param)


#: (layer, window, chunk) of the pool below: layer 0 full, 1 sliding window, 2 chunked.
FULL, WINDOW, CHUNK = 0, 1, 2


def group_pool(
    where: str, nb: int, bs: int, kv_heads: int, dim: int, dtype: str, window: int, chunk: int
) -> KVCachePool:
    """Three layers, one per group: full, sliding_window(window), chunked_local(chunk); the
    three share one buffer row (a block belongs to one group at a time)."""
    groups = [
        KVCacheGroup("full"),
        KVCacheGroup("sliding_window", window=window),
        KVCacheGroup("chunked_local", chunk=chunk),
    ]
    kw: dict[str, Any] = {"groups": groups, "layer_groups": [0, 1, 2]}
    if where == "host":
        return KVCachePool(3, nb, bs, kv_heads, dim, dtype, "cpu", launcher=_host_launcher(), **kw)
    if where == "cpu":
        return KVCachePool(3, nb, bs, kv_heads, dim, dtype, "cpu", **kw)
    return KVCachePool(3, nb, bs, kv_heads, dim, dtype, "cuda", **kw)


def null_tables(
    lens: np.ndarray, starts: list[int], bs: int, nb: int, rng: np.random.Generator
) -> np.ndarray:
    """Distinct real blocks (1..nb-1) from each span's first block on, 0 before it, -1 past
    the sequence."""
    width = max(1, int(-(-lens.max() // bs)) + 1)
    tables = np.full((len(lens), width), -1, np.int32)
    free = list(rng.permutation(np.arange(1, nb)))
    for i, (n, lo) in enumerate(zip(lens, starts, strict=True)):
        used = -(-int(n) // bs)
        for j in range(used):
            tables[i, j] = 0 if j < lo // bs else int(free.pop())
    return tables


def poison_outside(pool: KVCachePool, tables: np.ndarray, lens: np.ndarray, starts: list[int]):
    """NaN in every slot of the pool except the positions ``starts[i] .. lens[i]-1``."""
    bs = pool.block_size
    keep = [
        int(tables[i, p // bs]) * bs + p % bs
        for i, n in enumerate(lens)
        for p in range(starts[i], int(n))
    ]
    flat = pool.buffer.view(pool.layout.num_rows, 2, -1, pool.num_kv_heads, pool.head_dim)
    mask = torch.ones(flat.shape[2], dtype=torch.bool)
    mask[torch.tensor(keep, dtype=torch.int64)] = False
    flat[:, :, mask.to(flat.device)] = float("nan")


CASES = [
    # dtype, head_dim, heads, kv_heads, block_size, lens, layer, limit, num_splits
    ("float32", 64, 4, 2, 8, [1, 7, 32, 33, 40, 100], WINDOW, 32, None),
    ("float32", 64, 2, 1, 8, [300, 17, 41], WINDOW, 40, 3),
    ("float32", 64, 2, 2, 16, [700, 650], WINDOW, 600, None),  # auto split over the span
    ("float32", 128, 4, 4, 16, [1, 31, 32, 33, 64, 95], CHUNK, 32, None),
    ("float16", 64, 6, 2, 16, [16, 17, 48, 49, 200], CHUNK, 48, 2),
    ("bfloat16", 128, 8, 2, 16, [5, 64, 65, 129], WINDOW, 24, None),
    ("float32", 64, 4, 2, 8, [9, 50], FULL, 0, None),  # full: no entry may be null
]


@pytest.mark.parametrize(
    ("dtype", "head_dim", "heads", "kv_heads", "bs", "lens", "layer", "limit", "splits"), CASES
)
def test_local_attention_matches_reference(
    backend, dtype, head_dim, heads, kv_heads, bs, lens, layer, limit, splits
):
    rng = np.random.default_rng(head_dim + bs + limit)
    gen = torch.Generator().manual_seed(len(lens) * 7 + limit)
    lens_a = np.array(lens, np.int32)
    window = limit if layer == WINDOW else 0
    chunk = limit if layer == CHUNK else 0
    starts = [cpu_ops.attention_start(int(n), window, chunk) for n in lens_a]
    nb = int(sum(-(-n // bs) for n in lens_a)) + 2
    pool = group_pool(backend, nb, bs, kv_heads, head_dim, dtype, max(window, bs), chunk or bs)
    pool.buffer.copy_(torch.randn(pool.buffer.shape, generator=gen).to(pool.dtype))
    tables = null_tables(lens_a, starts, bs, nb, rng)
    if layer != FULL:
        assert (tables == 0).any(), "the case must hold null entries before a span"
    poison_outside(pool, tables, lens_a, starts)
    q = randn((len(lens), heads, head_dim), dtype, pool.device, gen)
    scale = 0.8 / math.sqrt(head_dim)
    out = paged_decode_attention(
        q, pool, layer, tables, lens_a, scale, num_splits=splits, group=layer
    )
    k = pool.key(layer).cpu()
    v = pool.value(layer).cpu()
    t, sl = torch.from_numpy(tables), torch.from_numpy(lens_a)
    ref = cpu_ops.paged_decode_attention(
        q.cpu(), k, v, t, sl, scale, torch.float64, window=window, chunk=chunk
    )
    assert out.shape == q.shape and out.dtype == q.dtype
    assert torch.isfinite(out.float()).all(), "read a slot outside the attended span"
    assert torch.isfinite(ref).all()
    assert rel_err(out, ref) < ATTN_RTOL[dtype]


def test_reference_is_the_windowed_formula():
    """cpu_ops' window and chunk against softmax over an explicit list of positions."""
    gen = torch.Generator().manual_seed(4)
    bs, n = 4, 23
    pool = KVCachePool(1, 8, bs, 1, 8, "float32", "cpu")
    pool.buffer.copy_(torch.randn(pool.buffer.shape, generator=gen))
    table = torch.tensor([[7, 3, 5, 1, 2, 6]], dtype=torch.int32)
    q = torch.randn((1, 2, 8), generator=gen, dtype=torch.float64)
    k, v = pool.key(0), pool.value(0)
    for window, chunk, first in [(0, 0, 0), (5, 0, 18), (30, 0, 0), (0, 8, 16), (0, 23, 0)]:
        out = cpu_ops.paged_decode_attention(
            q, k, v, table, torch.tensor([n]), 0.5, torch.float64, window=window, chunk=chunk
        )
        assert cpu_ops.attention_start(n, window, chunk) == first
        pos = range(first, n)
        kk = torch.stack([k[table[0, p // bs], p % bs, 0] for p in pos]).double()
        vv = torch.stack([v[table[0, p // bs], p % bs, 0] for p in pos]).double()
        for h in range(2):
            p = torch.softmax(kk @ q[0, h] * 0.5, dim=0)
            torch.testing.assert_close(out[0, h], p @ vv)
    assert cpu_ops.attention_start(0, 4, 0) == 0 and cpu_ops.attention_start(0, 0, 4) == 0


@pytest.mark.slow
def test_decode_split_equals_unsplit_with_window(backend):
    """Splits over the window's span give the answer of one pass."""
    gen = torch.Generator().manual_seed(6)
    pool = group_pool(backend, 42, 16, 2, 64, "float32", 300, 16)
    pool.buffer.copy_(torch.randn(pool.buffer.shape, generator=gen))
    lens = np.array([600, 590], np.int32)
    starts = [cpu_ops.attention_start(int(n), 300, 0) for n in lens]
    tables = null_tables(lens, starts, 16, 42, np.random.default_rng(1))
    q = randn((2, 4, 64), "float32", pool.device, gen)
    base = paged_decode_attention(q, pool, WINDOW, tables, lens, num_splits=1, group=WINDOW)
    for s in (2, 5, 19):
        out = paged_decode_attention(q, pool, WINDOW, tables, lens, num_splits=s, group=WINDOW)
        assert rel_err(out, base.cpu().double()) < 1e-5


@pytest.mark.parametrize("where", ["host", "cpu"])
def test_null_block_where_read_raises(where):
    """A table holding the null block where the query reads it is not the layer's group's
    (or a window was released too early): refused on the host, on both paths."""
    pool = group_pool(where, 10, 8, 1, 64, "float32", 16, 16)
    q = randn((1, 2, 64), "float32")
    lens = np.array([20], np.int32)  # window 16: positions 4..19, blocks 0..2 are read
    with pytest.raises(InvalidArgumentError, match=r"block_tables\[0, 0\] is the null block"):
        paged_decode_attention(q, pool, WINDOW, np.array([[0, 1, 2]]), lens, group=WINDOW)
    with pytest.raises(InvalidArgumentError, match=r"block_tables\[0, 0\] is the null block"):
        paged_decode_attention(q, pool, FULL, np.array([[0, 1, 2]]), np.array([17]), group=FULL)
    # chunk 16, length 20: positions 16..19 only (block 2); blocks 0 and 1 may be null
    out = paged_decode_attention(q, pool, CHUNK, np.array([[0, 0, 2]]), lens, group=CHUNK)
    assert torch.isfinite(out).all()
    with pytest.raises(InvalidArgumentError, match=r"block_tables\[0, 2\] is the null block"):
        paged_decode_attention(q, pool, CHUNK, np.array([[1, 2, 0]]), lens, group=CHUNK)
