"""Every kernel against its CPU reference (pagedkv.device.cpu_ops).

Two backends run the same tests: "host" executes the CUDA sources on the CPU through the
C++ harness (tests/kernels/kernel_host: g++ and a small CUDA shim; every commit), "cuda" runs them
with CuPy on a real GPU (marked gpu, skipped where there is none). Both go through the
same Python launch code (pagedkv.device.device_ops). Practice (see docs/kernels.md): fresh random
data, NaN in every slot that must not be read, exact equality for the copy kernels,
relative error against an fp64 reference for attention, odd sizes.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from devices import cuda_ok as _cuda_ok  # noqa: E402
from pagedkv.device import cpu_ops  # noqa: E402
from pagedkv.device import kernel_loader as K  # noqa: E402
from pagedkv.device.pool import KVCachePool, paged_decode_attention, swap_blocks  # noqa: E402
from pagedkv.errors import InvalidArgumentError  # noqa: E402

DTYPES = ["bfloat16", "float16", "float32"]
#: Relative L2 error of decode attention against an fp64 reference on the same inputs.
ATTN_RTOL = {"bfloat16": 1.5e-2, "float16": 2e-3, "float32": 2e-5}


_HOST: Any = None


def _host_launcher() -> Any:
    global _HOST
    if _HOST is None:
        pytest.importorskip("cuda.bindings")  # the same wheels bring the CUDA headers
        if not K.cuda_include_dirs():
            pytest.skip("CUDA headers (nvidia-cuda-runtime wheel) not installed")
        from kernel_host.harness import HostLauncher

        _HOST = HostLauncher(num_sms=4)
    return _HOST


@pytest.fixture(
    params=[
        pytest.param("host"),
        pytest.param("cuda", marks=pytest.mark.gpu),
    ]
)
def backend(request: pytest.FixtureRequest) -> str:
    if request.param == "cuda" and not _cuda_ok():
        pytest.skip("no CUDA device")
    if request.param == "host":
        _host_launcher()
    return str(request.param)


def make_pool(backend: str, *args: Any, **kw: Any) -> KVCachePool:
    if backend == "host":
        return KVCachePool(*args, device="cpu", launcher=_host_launcher(), **kw)
    return KVCachePool(*args, device="cuda", **kw)


def ref_pool(pool: KVCachePool) -> KVCachePool:
    """A CPU reference pool holding a copy of pool's contents."""
    r = KVCachePool(
        pool.num_layers,
        pool.num_blocks,
        pool.block_size,
        pool.num_kv_heads,
        pool.head_dim,
        pool.dtype_name,
        "cpu",
    )
    r.buffer.copy_(pool.buffer.cpu())
    return r


def tdtype(name: str) -> Any:
    return getattr(torch, name)


def randn(shape: tuple[int, ...], dtype: str, device: Any = "cpu", gen: Any = None) -> Any:
    return torch.randn(shape, generator=gen).to(tdtype(dtype)).to(device)


def fill_random(pool: KVCachePool, gen: Any) -> None:
    pool.buffer.copy_(torch.randn(pool.buffer.shape, generator=gen).to(pool.dtype))


def bits(t: Any) -> Any:
    """The raw bits, so that NaN compares equal to the same NaN."""
    t = t.detach().cpu().contiguous()
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


def assert_same_bits(a: Any, b: Any) -> None:
    assert a.shape == b.shape
    assert torch.equal(bits(a), bits(b))


def poison_except(pool: KVCachePool, keep_slots: np.ndarray) -> None:
    """NaN in every slot of every layer except keep_slots (which keep their values)."""
    flat = pool.buffer.view(pool.num_layers, 2, -1, pool.num_kv_heads, pool.head_dim)
    mask = torch.ones(flat.shape[2], dtype=torch.bool)
    mask[torch.as_tensor(keep_slots, dtype=torch.int64)] = False
    flat[:, :, mask.to(flat.device)] = float("nan")


def table_slots(tables: np.ndarray, lens: np.ndarray, bs: int) -> np.ndarray:
    return (
        cpu_ops.token_slots(torch.from_numpy(tables), torch.from_numpy(lens), bs).numpy()
        if len(lens)
        else np.zeros(0, np.int64)
    )


# ---------------------------------------------------------------------------------------
# write


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("block_size", "heads", "head_dim", "strided"),
    [
        (16, 2, 64, True),
        (8, 3, 128, False),
        (32, 1, 256, True),
        (16, 2, 36, True),
        (8, 2, 34, False),
    ],
)
def test_write(backend, dtype, block_size, heads, head_dim, strided):
    gen = torch.Generator().manual_seed(hash((dtype, block_size, heads, head_dim)) % 2**31)
    pool = make_pool(backend, 2, 9, block_size, heads, head_dim, dtype)
    pool.buffer.fill_(float("nan"))
    fill_random(pool, gen) if strided else None
    ref = ref_pool(pool)
    n = 29
    rng = np.random.default_rng(n + head_dim)
    slots = rng.permutation(pool.num_blocks * block_size)[:n].astype(np.int64)
    slots[[0, 7, n - 1]] = -1
    if strided:  # token stride 3 * heads * dim, head stride dim: views into one tensor
        kv = randn((n, 3, heads, head_dim), dtype, pool.device, gen)
        key, value = kv[:, 0], kv[:, 2]
    else:
        key = randn((n, heads, head_dim), dtype, pool.device, gen)
        value = randn((n, heads, head_dim), dtype, pool.device, gen)
    pool.write(1, key, value, slots)
    ref.write(1, key.cpu(), value.cpu(), slots)
    assert_same_bits(pool.buffer, ref.buffer)
    # written slots hold the tokens, nothing else changed (layer 0 untouched)
    got = pool.key(1).reshape(-1, heads, head_dim)[torch.from_numpy(slots[slots >= 0])]
    assert_same_bits(got, key[torch.from_numpy(slots >= 0).to(key.device)])


def test_write_transposed_heads(backend):
    """Head stride larger than token stride (a [heads, tokens, dim] tensor transposed)."""
    pool = make_pool(backend, 1, 4, 8, 4, 64, "float16")
    ref = ref_pool(pool)
    key = randn((4, 10, 64), "float16", pool.device).transpose(0, 1)
    value = randn((4, 10, 64), "float16", pool.device).transpose(0, 1)
    slots = np.arange(10, dtype=np.int64) * 3
    pool.write(0, key, value, slots)
    ref.write(0, key.cpu(), value.cpu(), slots)
    assert_same_bits(pool.buffer, ref.buffer)


def test_write_empty_and_all_skipped(backend):
    pool = make_pool(backend, 1, 2, 8, 1, 64, "bfloat16")
    before = pool.buffer.clone()
    pool.write(
        0,
        randn((0, 1, 64), "bfloat16", pool.device),
        randn((0, 1, 64), "bfloat16", pool.device),
        np.zeros(0, np.int64),
    )
    kv = randn((3, 1, 64), "bfloat16", pool.device)
    pool.write(0, kv, kv, np.array([-1, -1, -1]))
    assert_same_bits(pool.buffer, before)


# ---------------------------------------------------------------------------------------
# gather


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("block_size", "heads", "head_dim"), [(16, 2, 128), (8, 1, 36), (64, 3, 64)]
)
def test_gather(backend, dtype, block_size, heads, head_dim):
    gen = torch.Generator().manual_seed(7 + head_dim)
    rng = np.random.default_rng(head_dim + block_size)
    nb = 12
    pool = make_pool(backend, 2, nb, block_size, heads, head_dim, dtype)
    fill_random(pool, gen)
    # lengths: one token, an empty sequence, a multiple of block_size +- 1, a partial block
    lens = np.array([1, 0, 2 * block_size - 1, 2 * block_size + 1, 5, block_size], np.int32)
    max_blocks = int(-(-lens.max() // block_size))
    tables = rng.integers(0, nb, size=(len(lens), max_blocks + 1)).astype(np.int32)  # replacement
    for i, n in enumerate(lens):  # padding beyond a sequence's blocks must never be read
        tables[i, -(-n // block_size) :] = -1
    poison_except(pool, table_slots(tables, lens, block_size))
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    k, v = pool.gather(1, tables, cu)
    rk, rv = ref_pool(pool).gather(1, tables, cu)
    assert k.shape == (int(cu[-1]), heads, head_dim)
    assert not torch.isnan(k).any() and not torch.isnan(v).any()
    assert_same_bits(k, rk)
    assert_same_bits(v, rv)


def test_gather_empty_batch(backend):
    pool = make_pool(backend, 1, 2, 8, 1, 64, "float32")
    k, v = pool.gather(0, np.zeros((0, 1), np.int32), np.array([0]))
    assert k.shape == (0, 1, 64) and v.shape == (0, 1, 64)
    k, v = pool.gather(0, np.zeros((2, 1), np.int32), np.array([0, 0, 0]))
    assert k.shape == (0, 1, 64)


# ---------------------------------------------------------------------------------------
# copy_blocks and swap


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("block_size", "heads", "head_dim"), [(16, 2, 64), (1, 1, 1), (8, 3, 6)])
def test_copy_blocks(backend, dtype, block_size, heads, head_dim):
    gen = torch.Generator().manual_seed(3)
    pool = make_pool(backend, 3, 16, block_size, heads, head_dim, dtype)
    fill_random(pool, gen)
    ref = ref_pool(pool)
    pairs = np.array([[1, 9], [1, 10], [4, 2], [15, 0], [7, 11]], np.int32)  # src repeats: fork
    pool.copy_blocks(pairs)
    ref.copy_blocks(pairs)
    assert_same_bits(pool.buffer, ref.buffer)
    pool.copy_blocks(np.zeros((0, 2), np.int32))
    assert_same_bits(pool.buffer, ref.buffer)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_swap_out_and_in(backend, dtype):
    gen = torch.Generator().manual_seed(11)
    gpu = make_pool(backend, 2, 10, 16, 2, 64, dtype)
    fill_random(gpu, gen)
    cpu = gpu.swap_pool(7)
    cpu.buffer.fill_(float("nan"))
    if backend == "host":  # the harness launches from the source pool's launcher
        cpu._launcher = gpu._launcher
    out_pairs = np.array([[3, 6], [0, 2], [9, 0], [4, 1]], np.int32)  # (gpu, cpu)
    swap_blocks(gpu, cpu, out_pairs)
    if backend == "cuda":
        torch.cuda.synchronize()
    for g, c in out_pairs:
        assert_same_bits(cpu.buffer[:, :, c], gpu.buffer[:, :, g].cpu())
    untouched = [b for b in range(7) if b not in out_pairs[:, 1]]
    assert torch.isnan(cpu.buffer[:, :, untouched]).all()
    # swap in to other GPU blocks
    in_pairs = np.array([[6, 5], [2, 7], [0, 8], [1, 3]], np.int32)  # (cpu, gpu)
    expect = ref_pool(gpu)
    cpu_ref = cpu.buffer.clone()
    expect.buffer[:, :, in_pairs[:, 1]] = cpu_ref[:, :, in_pairs[:, 0]]
    swap_blocks(cpu, gpu, in_pairs)
    if backend == "cuda":
        torch.cuda.synchronize()
    assert_same_bits(gpu.buffer, expect.buffer)


# ---------------------------------------------------------------------------------------
# paged decode attention


def dense_reference(
    q: Any, pool: KVCachePool, layer: int, tables: np.ndarray, lens: np.ndarray, scale: float
) -> Any:
    r = ref_pool(pool)
    return cpu_ops.paged_decode_attention(
        q.cpu(),
        r.key(layer),
        r.value(layer),
        torch.from_numpy(tables),
        torch.from_numpy(lens),
        scale,
        torch.float64,
    )


def rel_err(out: Any, ref: Any) -> float:
    out = out.cpu().double()
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))


DECODE_CASES = [
    # dtype, head_dim, heads, kv_heads, block_size, lens, num_splits
    ("bfloat16", 128, 8, 2, 16, [37, 1, 0, 64, 65], None),
    ("bfloat16", 128, 4, 4, 8, [300, 17], 4),
    ("float16", 64, 6, 2, 32, [95, 96, 97, 1], None),
    ("float16", 256, 8, 1, 64, [130, 3], 3),
    ("float32", 64, 2, 1, 8, [200, 8, 9], 5),
    ("float32", 128, 16, 2, 16, [41, 2], None),
    ("float32", 256, 3, 3, 16, [33], 2),
    ("bfloat16", 64, 32, 8, 8, [70, 12], 2),
    ("float16", 128, 12, 4, 16, [1], None),
]


@pytest.mark.parametrize(
    ("dtype", "head_dim", "heads", "kv_heads", "block_size", "lens", "splits"), DECODE_CASES
)
def test_paged_decode_attention(
    backend, dtype, head_dim, heads, kv_heads, block_size, lens, splits
):
    gen = torch.Generator().manual_seed(head_dim * heads + block_size)
    rng = np.random.default_rng(len(lens) + heads)
    lens_a = np.array(lens, np.int32)
    max_blocks = int(-(-max(lens_a.max(), 1) // block_size))
    nb = max(4, max_blocks + 2)
    pool = make_pool(backend, 2, nb, block_size, kv_heads, head_dim, dtype)
    fill_random(pool, gen)
    tables = rng.integers(0, nb, size=(len(lens), max_blocks + 1)).astype(np.int32)
    tables[:, -1] = 10**6  # padding beyond each sequence: never read, not validated
    for i, n in enumerate(lens_a):
        tables[i, -(-n // block_size) :] = -1
    poison_except(pool, table_slots(tables, lens_a, block_size))
    scale = 0.7 / math.sqrt(head_dim)
    q = randn((len(lens), heads, head_dim), dtype, pool.device, gen)
    out = paged_decode_attention(q, pool, 1, tables, lens_a, scale, num_splits=splits)
    ref = dense_reference(q, pool, 1, tables, lens_a, scale)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert not torch.isnan(out).any()
    assert rel_err(out, ref) < ATTN_RTOL[dtype]
    zero = lens_a == 0
    if zero.any():
        assert (out.cpu()[torch.from_numpy(zero)] == 0).all()


@pytest.mark.slow
def test_decode_split_equals_unsplit(backend):
    """Split-KV with a reduction gives the same answer as one pass, several split counts."""
    gen = torch.Generator().manual_seed(5)
    pool = make_pool(backend, 1, 40, 16, 2, 128, "float32")
    fill_random(pool, gen)
    tables = np.arange(40, dtype=np.int32).reshape(2, 20)
    lens = np.array([300, 313], np.int32)
    q = randn((2, 8, 128), "float32", pool.device, gen)
    base = paged_decode_attention(q, pool, 0, tables, lens, num_splits=1)
    for s in (2, 3, 7, 20):
        out = paged_decode_attention(q, pool, 0, tables, lens, num_splits=s)
        assert rel_err(out, base.cpu().double()) < 1e-5


def test_decode_strided_q_and_default_scale(backend):
    gen = torch.Generator().manual_seed(9)
    pool = make_pool(backend, 1, 6, 16, 2, 64, "float16")
    fill_random(pool, gen)
    big = randn((3, 4, 2, 64), "float16", pool.device, gen)
    q = big[:, :, 1]  # batch stride 512, head stride 128
    tables = np.array([[0, 1], [2, 3], [4, 5]], np.int32)
    lens = np.array([20, 32, 7], np.int32)
    out = paged_decode_attention(q, pool, 0, tables, lens)
    ref = dense_reference(q, pool, 0, tables, lens, 64**-0.5)
    assert rel_err(out, ref) < ATTN_RTOL["float16"]


def test_decode_empty_batch(backend):
    pool = make_pool(backend, 1, 2, 8, 1, 64, "bfloat16")
    q = randn((0, 2, 64), "bfloat16", pool.device)
    out = paged_decode_attention(q, pool, 0, np.zeros((0, 1), np.int32), np.zeros(0, np.int32))
    assert out.shape == (0, 2, 64)


# ---------------------------------------------------------------------------------------
# host-side validation: a bad id raises and nothing is launched or changed


def test_bad_ids_raise_and_change_nothing(backend):
    pool = make_pool(backend, 1, 4, 8, 1, 64, "float32")
    fill_random(pool, torch.Generator().manual_seed(1))
    before = pool.buffer.clone()
    kv = randn((2, 1, 64), "float32", pool.device)
    with pytest.raises(InvalidArgumentError):
        pool.write(0, kv, kv, np.array([0, 32]))  # slot past the pool
    with pytest.raises(InvalidArgumentError):
        pool.write(0, kv, kv, np.array([-2, 1]))
    with pytest.raises(InvalidArgumentError):
        pool.write(0, kv, kv, np.array([3, 3]))
    with pytest.raises(InvalidArgumentError):
        pool.copy_blocks(np.array([[0, 4]]))
    with pytest.raises(InvalidArgumentError):
        pool.copy_blocks(np.array([[0, 1], [2, 1]]))
    with pytest.raises(InvalidArgumentError):
        pool.gather(0, np.array([[5]], np.int32), np.array([0, 3]))
    with pytest.raises(InvalidArgumentError):
        pool.gather(0, np.array([[0]], np.int32), np.array([0, 9]))  # longer than its table
    q = randn((1, 2, 64), "float32", pool.device)
    with pytest.raises(InvalidArgumentError):
        paged_decode_attention(q, pool, 0, np.array([[0, -1]], np.int32), np.array([9]))
    with pytest.raises(InvalidArgumentError):
        paged_decode_attention(
            randn((1, 2, 32), "float32", pool.device),
            pool,
            0,
            np.array([[0]], np.int32),
            np.array([1]),
        )
    with pytest.raises(InvalidArgumentError):
        pool.key(1)
    assert_same_bits(pool.buffer, before)


def test_kernel_guards_skip_bad_ids(backend):
    """Ids given as device tensors are not validated on the host (that would synchronise);
    the kernels themselves skip out-of-range ids, so nothing outside the pool is written."""
    from pagedkv.device import device_ops

    pool = make_pool(backend, 1, 4, 8, 1, 64, "float32")
    fill_random(pool, torch.Generator().manual_seed(2))
    before = pool.buffer.clone()
    dev = pool.device
    kv = randn((2, 1, 64), "float32", dev)
    slots = torch.tensor([32, 10**9], dtype=torch.int64, device=dev)
    device_ops.write(pool._launcher, "float32", pool.key(0), pool.value(0), kv, kv, slots)
    pairs = torch.tensor([[0, 4], [9, 1], [-3, 2]], dtype=torch.int32, device=dev)
    device_ops.copy_blocks(pool._launcher, pool.buffer, pool.buffer, pairs)
    assert_same_bits(pool.buffer, before)
    k, _ = device_ops.gather(
        pool._launcher,
        "float32",
        pool.key(0),
        pool.value(0),
        torch.tensor([[7]], dtype=torch.int32, device=dev),
        torch.tensor([0, 2], dtype=torch.int32, device=dev),
        2,
    )
    assert (k == 0).all()  # a bad block id reads nothing and gives zero rows


# ---------------------------------------------------------------------------------------
# pool sizing and views


def test_pool_layout_and_sizing():
    pool = KVCachePool(3, 5, 16, 2, 64, "bfloat16", "cpu")
    assert pool.key(2).shape == (5, 16, 2, 64) and pool.key(2).is_contiguous()
    assert pool.value(0).data_ptr() == pool.key(0).data_ptr() + 5 * 16 * 2 * 64 * 2
    assert pool.bytes_per_block == 3 * 2 * 16 * 2 * 64 * 2
    assert pool.nbytes == pool.buffer.numel() * 2
    p = KVCachePool.from_memory(2, 16, 1, 64, "float32", "cpu", prealloc_ratio=0.5, max_blocks=7)
    assert p.num_blocks == 7
    sw = pool.swap_pool(4)
    assert sw.device.type == "cpu" and sw.buffer.shape[2] == 4
    with pytest.raises(InvalidArgumentError):
        KVCachePool(1, 0, 16, 1, 64, "float32", "cpu")
    with pytest.raises(InvalidArgumentError):
        KVCachePool(1, 1, 16, 1, 64, "int8", "cpu")


def test_host_harness_checks_argument_sizes():
    launcher = _host_launcher()
    k = launcher.kernel(K.copy_blocks_name(16))
    with pytest.raises(TypeError):
        k(
            (1, 1, 1),
            (32, 1, 1),
            (0, 0, 0, np.int64(0), np.int32(0), np.int32(0), np.int32(0), np.int32(0)),
        )


# ---------------------------------------------------------------------------------------
# partial warps: a CTA whose size is not a multiple of 32 must not shuffle with a full mask


@pytest.mark.parametrize(
    ("dtype", "head_dim", "group"),
    [("float16", 64, 65), ("float32", 64, 33), ("bfloat16", 128, 35)],
)
def test_decode_partial_warp(backend, dtype, head_dim, group):
    """GQA groups whose CTA cannot be rounded to whole warps (BDX * group not a multiple of
    32, and doubling the token lanes would pass 1024 threads): the last warp is partial, and
    the host shim fails the launch if a shuffle names lanes that do not exist."""
    from pagedkv.device import device_ops

    bdx, bdz, _tile, _smem = device_ops.decode_launch_shape(dtype, head_dim, group)
    assert (bdx * group * bdz) % 32, "the case must produce a partial warp"
    gen = torch.Generator().manual_seed(group)
    pool = make_pool(backend, 1, 6, 16, 1, head_dim, dtype)
    fill_random(pool, gen)
    tables = np.array([[0, 1, 2], [3, 4, 5]], np.int32)
    lens = np.array([40, 17], np.int32)
    q = randn((2, group, head_dim), dtype, pool.device, gen)
    out = paged_decode_attention(q, pool, 0, tables, lens)
    ref = dense_reference(q, pool, 0, tables, lens, head_dim**-0.5)
    assert rel_err(out, ref) < ATTN_RTOL[dtype]
