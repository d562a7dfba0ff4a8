"""Launch code of the kernels: picks the instantiation, vector width, grid and block, and
packs the arguments (pointers as ints, sizes as numpy scalars of the exact C type).

The same code drives CuPy on a GPU and, in the tests, the C++ host harness that runs the
same ``.cu`` sources on the CPU, so the CPU tests cover this file as well. Arguments arrive
validated and already on the pool's device (see :mod:`pagedkv.device.pool`).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np

from pagedkv.device import kernel_loader as K

if TYPE_CHECKING:
    import torch

    from pagedkv.device.kernel_loader import Launcher

#: Bytes of K+V tile staged in shared memory per CTA by the decode kernel.
DECODE_TILE_BYTES = 16384
#: Decode splits the KV sequence when fewer than this many CTAs per SM would run.
DECODE_CTAS_PER_SM = 2
#: Smallest number of tokens per split.
DECODE_MIN_SPLIT_TOKENS = 256

_i32 = np.int32
_i64 = np.int64


def _aligned(t: torch.Tensor, nbytes: int) -> bool:
    return t.data_ptr() % nbytes == 0


def _round32(n: int) -> int:
    return max(32, (n + 31) // 32 * 32)


def write(
    launcher: Launcher,
    dtype: str,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    slot_mapping: torch.Tensor,
    first_slot: int = 0,
) -> None:
    """Slots below ``first_slot`` (the null block of a pool with groups) are skipped."""
    tokens, heads, dim = key.shape
    if tokens == 0:
        return
    vec = K.vec_width(dtype)
    ok = (
        dim % vec == 0
        and all(_aligned(t, 16) for t in (key, value, k_cache, v_cache))
        and all(s % vec == 0 for s in (*key.stride()[:2], *value.stride()[:2]))
    )
    if not ok:
        vec = 1
    units = heads * dim // vec
    grid = (min(tokens, launcher.num_sms * 16), 1, 1)
    block = (min(256, _round32(units)), 1, 1)
    num_slots = k_cache.shape[0] * k_cache.shape[1]
    args = (
        key.data_ptr(),
        value.data_ptr(),
        slot_mapping.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        _i32(tokens),
        _i32(heads),
        _i32(dim),
        _i64(key.stride(0)),
        _i64(key.stride(1)),
        _i64(value.stride(0)),
        _i64(value.stride(1)),
        _i64(num_slots),
        _i64(first_slot),
    )
    launcher.kernel(K.write_kv_name(dtype, vec))(grid, block, args, stream=launcher.stream())


def gather(
    launcher: Launcher,
    dtype: str,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seq_lens: torch.Tensor,
    total_tokens: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    import torch

    num_blocks, block_size, heads, dim = k_cache.shape
    out_k = torch.empty((total_tokens, heads, dim), dtype=k_cache.dtype, device=k_cache.device)
    out_v = torch.empty_like(out_k)
    batch = cu_seq_lens.shape[0] - 1
    if total_tokens == 0 or batch == 0:
        return out_k, out_v
    vec = K.vec_width(dtype)
    if (heads * dim) % vec or not all(_aligned(t, 16) for t in (k_cache, v_cache, out_k, out_v)):
        vec = 1
    row_units = heads * dim // vec
    grid = (min(total_tokens, launcher.num_sms * 16), 1, 1)
    block = (min(256, _round32(row_units)), 1, 1)
    args = (
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        block_tables.data_ptr(),
        _i64(block_tables.stride(0)),
        cu_seq_lens.data_ptr(),
        _i32(batch),
        out_k.data_ptr(),
        out_v.data_ptr(),
        _i32(total_tokens),
        _i32(row_units),
        _i32(block_size),
        _i32(num_blocks),
        _i32(block_tables.shape[1]),
    )
    launcher.kernel(K.gather_kv_name(dtype, vec))(grid, block, args, stream=launcher.stream())
    return out_k, out_v


def copy_blocks(
    launcher: Launcher,
    src_buffer: torch.Tensor,
    dst_buffer: torch.Tensor,
    pairs: torch.Tensor,
) -> None:
    """Copy block pairs[i, 0] of every plane (layer x K/V) of src_buffer to block pairs[i, 1]
    of dst_buffer, in one launch. Both buffers are ``[layers, 2, blocks, ...]`` pools (the
    same one for copy-on-write); pairs is an int32 ``[n, 2]`` tensor the kernel can read."""
    n = pairs.shape[0]
    if n == 0:
        return
    planes = src_buffer.shape[0] * 2
    block_bytes = math.prod(src_buffer.shape[3:]) * src_buffer.element_size()
    unit = next(
        u
        for u in (*K.COPY_UNITS, 1)
        if u == 1 or (block_bytes % u == 0 and _aligned(src_buffer, u) and _aligned(dst_buffer, u))
    )
    if unit == 1:  # odd byte sizes cannot happen with 2- and 4-byte dtypes
        raise ValueError("block size in bytes must be even")
    block_units = block_bytes // unit
    grid = (min(n * planes, launcher.num_sms * 32), 1, 1)
    block = (min(256, _round32(block_units)), 1, 1)
    args = (
        src_buffer.data_ptr(),
        dst_buffer.data_ptr(),
        pairs.data_ptr(),
        _i32(n),
        _i32(planes),
        _i32(block_units),
        _i32(src_buffer.shape[2]),
        _i32(dst_buffer.shape[2]),
    )
    launcher.kernel(K.copy_blocks_name(unit))(grid, block, args, stream=launcher.stream())


def decode_launch_shape(dtype: str, head_dim: int, group: int) -> tuple[int, int, int, int]:
    """(BDX, bdz, tile_tokens, shared memory bytes) of the decode kernel for a group size."""
    _vec, bdx = K.decode_shape(dtype, head_dim)
    if bdx * group > 1024:
        raise ValueError(f"GQA group {group} too large for head_dim {head_dim}")
    bdz = 1
    while bdx * group * bdz < 128 or (bdx * group * bdz) % 32:
        bdz *= 2
    # Doubling can overshoot 1024 threads for a large odd group (e.g. BDX 8, group 65); then
    # the CTA keeps one token lane and ends in a partial warp, which the kernel's shuffle
    # mask allows for (tests/kernels/test_kernels.py::test_decode_partial_warp).
    while bdx * group * bdz > 1024:
        bdz //= 2
    row_bytes = 2 * head_dim * K.ITEMSIZE[dtype]
    tile = max(bdz, DECODE_TILE_BYTES // row_bytes // bdz * bdz)
    smem = tile * row_bytes
    if bdz > 1:
        smem = max(smem, bdz * group * (head_dim + 2) * 4)
    return bdx, bdz, tile, smem


def decode_splits(
    batch: int, kv_heads: int, max_len: int, tile: int, num_sms: int, num_splits: int | None
) -> tuple[int, int]:
    """(num_splits, tokens_per_split): split the KV sequence when the grid would not fill
    the GPU (Flash-Decoding), in chunks of whole tiles of at least 256 tokens."""
    max_len = max(max_len, 1)
    if num_splits is None:
        ctas = batch * kv_heads
        target = DECODE_CTAS_PER_SM * num_sms
        if ctas >= target or max_len <= 2 * DECODE_MIN_SPLIT_TOKENS:
            num_splits = 1
        else:
            num_splits = min(-(-target // ctas), max_len // DECODE_MIN_SPLIT_TOKENS)
    num_splits = max(1, min(num_splits, max_len))
    if num_splits == 1:
        return 1, max_len
    per = -(-max_len // num_splits)
    per = -(-per // tile) * tile
    return -(-max_len // per), per


def attended_span(max_len: int, window: int, chunk: int) -> int:
    """The most positions one query attends to: a window or a chunk bounds the span."""
    span = max_len
    if window > 0:
        span = min(span, window)
    if chunk > 0:
        span = min(span, chunk)
    return span


def paged_decode_attention(
    launcher: Launcher,
    dtype: str,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    max_len: int,
    scale: float,
    num_splits: int | None,
    window: int = 0,
    chunk: int = 0,
) -> torch.Tensor:
    """``window`` > 0: attend to the last ``window`` positions only; ``chunk`` > 0: to the
    query's chunk only (0: no limit). The splits cover the longest attended span, not the
    longest sequence."""
    import torch

    batch, num_heads, dim = q.shape
    num_blocks, block_size, kv_heads, _ = k_cache.shape
    out = torch.empty((batch, num_heads, dim), dtype=q.dtype, device=q.device)
    if batch == 0:
        return out
    group = num_heads // kv_heads
    vec, _ = K.decode_shape(dtype, dim)
    if q.stride(-1) != 1 or q.stride(0) % vec or q.stride(1) % vec or not _aligned(q, 16):
        q = q.contiguous()
    bdx, bdz, tile, smem = decode_launch_shape(dtype, dim, group)
    span = attended_span(max_len, window, chunk)
    splits, per = decode_splits(batch, kv_heads, span, tile, launcher.num_sms, num_splits)
    part_o: torch.Tensor | None = None
    part_lse: torch.Tensor | None = None
    if splits > 1:
        part_o = torch.empty((batch, num_heads, splits, dim), dtype=torch.float32, device=q.device)
        part_lse = torch.empty((batch, num_heads, splits), dtype=torch.float32, device=q.device)
    stream = launcher.stream()
    args = (
        q.data_ptr(),
        _i64(q.stride(0)),
        _i64(q.stride(1)),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        block_tables.data_ptr(),
        _i64(block_tables.stride(0)),
        seq_lens.data_ptr(),
        _i32(window),
        _i32(chunk),
        _i32(kv_heads),
        _i32(block_size),
        _i32(num_blocks),
        _i32(block_tables.shape[1]),
        _i32(per),
        _i32(tile),
        np.float32(scale * math.log2(math.e)),
        out.data_ptr(),
        _i64(out.stride(0)),
        _i64(out.stride(1)),
        0 if part_o is None else part_o.data_ptr(),
        0 if part_lse is None else part_lse.data_ptr(),
    )
    launcher.kernel(K.decode_name(dtype, dim))(
        (splits, kv_heads, batch), (bdx, group, bdz), args, shared_mem=smem, stream=stream
    )
    if part_o is not None and part_lse is not None:
        margs = (
            part_o.data_ptr(),
            part_lse.data_ptr(),
            _i32(splits),
            _i32(dim),
            out.data_ptr(),
            _i64(out.stride(0)),
            _i64(out.stride(1)),
        )
        launcher.kernel(K.merge_name(dtype))(
            (num_heads, batch, 1), (_round32(dim), 1, 1), margs, stream=stream
        )
    return out
