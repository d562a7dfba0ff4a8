"""Gather and decode attention never read outside the pool or the block table.

Two layers, each tested here:

- the host check (pool API): bad tables, lengths, ``cu_seq_lens`` and ``max_seq_len`` raise
  InvalidArgumentError before anything runs, on the kernel path ("host": the C++ harness)
  and on the torch path (``device="cpu"``, no launcher) alike. Device tensors are stood in
  for by "meta" tensors: they have a shape and a dtype but no values to read, which is what
  the pool may look at without a synchronisation.
- the kernel guard (device_ops called directly, as with device-tensor ids that the host
  does not read; on the host harness, and on a GPU where there is one): poisoned tables
  and lengths give zero rows (gather) or NaN (attention), and the memory just past the
  table or before the pool, filled with readable ids and values, shows up in the output
  if a kernel reads it.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from pagedkv.device import device_ops  # noqa: E402
from pagedkv.device.pool import KVCachePool, paged_decode_attention  # noqa: E402
from pagedkv.errors import InvalidArgumentError  # noqa: E402
from test_kernels import _cuda_ok, _host_launcher, fill_random, make_pool, randn  # noqa: E402

BS = 16


@pytest.fixture(params=["host", "cpu"])
def pool(request: pytest.FixtureRequest) -> KVCachePool:
    """A 2-layer float32 pool of 6 blocks: "host" launches the CUDA sources on the CPU,
    "cpu" runs the torch reference ops."""
    launcher = _host_launcher() if request.param == "host" else None
    p = KVCachePool(2, 6, BS, 1, 64, "float32", "cpu", launcher=launcher)
    fill_random(p, torch.Generator().manual_seed(3))
    return p


def meta(values: Any, dtype: Any = torch.int32) -> Any:
    """A device-like tensor: shape and dtype, no readable values."""
    return torch.empty(np.shape(values), dtype=dtype, device="meta")


# ---------------------------------------------------------------------------------------
# host checks


def test_gather_host_checks(pool):
    tables = np.array([[0, 1]], np.int32)
    with pytest.raises(InvalidArgumentError, match=r"sequence lengths\[0\] = 33"):
        pool.gather(0, tables, np.array([0, 33]))  # past the 2-block row
    with pytest.raises(InvalidArgumentError, match=r"sequence lengths\[0\] = 33"):
        pool.gather(0, meta(tables), np.array([0, 33]))  # device table, host lengths
    with pytest.raises(InvalidArgumentError, match="block_tables must be"):
        pool.gather(0, meta([0, 1]), np.array([0, 3]))  # a 1-D device table
    with pytest.raises(InvalidArgumentError, match="block_tables must be"):
        pool.gather(0, np.array([[0, 1]] * 2, np.int32), np.array([0, 3]))  # 2 rows, 1 seq
    with pytest.raises(InvalidArgumentError, match="cu_seq_lens must be 1-D"):
        pool.gather(0, tables, np.array([2, 3]))  # does not start at 0
    with pytest.raises(InvalidArgumentError, match="cu_seq_lens must be 1-D"):
        pool.gather(0, tables, meta([[0, 3]]))  # a 2-D device cu_seq_lens
    with pytest.raises(InvalidArgumentError, match="must hold integers"):
        pool.gather(0, tables, meta([0, 3], torch.float32))
    with pytest.raises(InvalidArgumentError, match="block_tables must be"):
        pool.gather(0, meta([[0, 1]] * 2), meta([0, 3]))  # both on the device


def test_decode_host_checks(pool):
    q = randn((2, 2, 64), "float32")
    tables = np.array([[0, 1], [2, 3]], np.int32)
    lens = np.array([20, 32], np.int32)
    with pytest.raises(InvalidArgumentError, match=r"max_seq_len 31 is shorter than seq_lens\[1\]"):
        paged_decode_attention(q, pool, 0, tables, lens, max_seq_len=31)
    with pytest.raises(InvalidArgumentError, match="max_seq_len must not be negative"):
        paged_decode_attention(q, pool, 0, tables, meta(lens), max_seq_len=-1)
    with pytest.raises(InvalidArgumentError, match="max_seq_len must be an integer"):
        paged_decode_attention(q, pool, 0, tables, lens, max_seq_len=32.0)
    with pytest.raises(InvalidArgumentError, match=r"seq_lens\[1\] = 33"):
        paged_decode_attention(q, pool, 0, meta(tables), np.array([20, 33]))
    with pytest.raises(InvalidArgumentError, match=r"seq_lens\[0\] = -1"):
        paged_decode_attention(q, pool, 0, tables, np.array([-1, 3]))
    with pytest.raises(InvalidArgumentError, match="seq_lens must have shape"):
        paged_decode_attention(q, pool, 0, tables, meta([20, 32, 1]))
    with pytest.raises(InvalidArgumentError, match="block_tables must be"):
        paged_decode_attention(q, pool, 0, meta([[0, 1]]), meta(lens), max_seq_len=32)
    # the bound itself is fine when every sequence fits
    out = paged_decode_attention(q, pool, 0, tables, lens, max_seq_len=32)
    assert out.shape == q.shape and not torch.isnan(out).any()


# ---------------------------------------------------------------------------------------
# kernel guards (host harness): what a bad device id or length would do on a GPU


@pytest.fixture(params=["host", pytest.param("cuda", marks=pytest.mark.gpu)])
def hpool(request: pytest.FixtureRequest) -> KVCachePool:
    """A 2-layer float32 pool of 6 blocks on the kernel path: the host harness, or a GPU."""
    if request.param == "cuda" and not _cuda_ok():
        pytest.skip("no CUDA device")
    p = make_pool(str(request.param), 2, 6, BS, 1, 64, "float32")
    fill_random(p, torch.Generator().manual_seed(4))
    return p


def row_view(ids: list[int], width: int, device: Any) -> Any:
    """A [1, width] table whose memory goes on with the rest of ids (valid block ids), so a
    kernel that reads past the row picks up real blocks instead of garbage."""
    return torch.tensor([ids], dtype=torch.int32, device=device)[:, :width]


def ids(values: Any, device: Any) -> Any:
    return torch.tensor(values, dtype=torch.int32, device=device)


def test_gather_guard_sequence_longer_than_its_table(hpool):
    dev = hpool.device
    tables = row_view([0, 3], 1, dev)  # one block in the row, block 3 just past it
    cu = ids([0, 2 * BS], dev)
    k, v = device_ops.gather(
        hpool._launcher, "float32", hpool.key(1), hpool.value(1), tables, cu, 2 * BS
    )
    assert torch.equal(k[:BS], hpool.key(1)[0]) and torch.equal(v[:BS], hpool.value(1)[0])
    assert (k[BS:] == 0).all() and (v[BS:] == 0).all()


def test_gather_guard_cu_seq_lens_not_starting_at_zero(hpool):
    """Rows before cu_seq_lens[0] have negative positions: without the guard they read the
    slots before block 0 of layer 1's K, i.e. layer 0's V."""
    tables = ids([[0]], hpool.device)
    cu = ids([2, 4], hpool.device)
    k, _ = device_ops.gather(
        hpool._launcher, "float32", hpool.key(1), hpool.value(1), tables, cu, 4
    )
    assert (k[:2] == 0).all()
    assert torch.equal(k[2:4], hpool.key(1)[0, :2])


def _decode(pool: KVCachePool, tables: Any, lens: Any, max_len: int, splits: int | None) -> Any:
    gen = torch.Generator().manual_seed(8)
    q = randn((int(lens.shape[0]), 2, 64), "float32", pool.device, gen)
    return device_ops.paged_decode_attention(
        pool._launcher,
        "float32",
        q,
        pool.key(1),
        pool.value(1),
        tables,
        lens,
        max_len,
        0.125,
        splits,
    )


@pytest.mark.parametrize("splits", [1, 2])
def test_decode_guard_sequence_longer_than_its_table(hpool, splits):
    tables = row_view([0, 3, 4], 1, hpool.device)
    out = _decode(hpool, tables, ids([40], hpool.device), 40, splits)
    assert torch.isnan(out).all()


@pytest.mark.parametrize("splits", [1, 2])
def test_decode_guard_max_seq_len_shorter_than_a_sequence(hpool, splits):
    """A device seq_lens beyond max_seq_len: NaN for that sequence, the others exact."""
    tables = ids([[0, 1, 2], [3, 4, 5]], hpool.device)
    lens = ids([40, 10], hpool.device)
    out = _decode(hpool, tables, lens, 16, splits)
    assert torch.isnan(out[0]).all()
    assert not torch.isnan(out[1]).any()
    full = _decode(hpool, tables, lens, 40, splits)
    assert torch.allclose(out[1], full[1], rtol=1e-6, atol=1e-6)


def test_decode_guard_negative_length(hpool):
    out = _decode(hpool, ids([[0]], hpool.device), ids([-5], hpool.device), 16, None)
    assert torch.isnan(out).all()


def test_decode_guard_bad_block_ids_read_nothing(hpool):
    """Ids just past the pool (6) and negative give zero K/V rows. Layer 1's K is followed
    by its V (block 0 poisoned here, unused by the table) and preceded by layer 0's V
    (poisoned); NaN would show in the output if the kernel read either."""
    hpool.buffer[0, 1] = float("nan")
    hpool.buffer[1, 1, 0] = float("nan")
    tables = ids([[1, 6, -1]], hpool.device)
    lens = ids([3 * BS], hpool.device)
    out = _decode(hpool, tables, lens, 3 * BS, None)
    assert not torch.isnan(out).any()
