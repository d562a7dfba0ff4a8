"""Paged decode attention over a :class:`pagedkv.KVCachePool` (docs/kernels.md): one
query token per sequence against its cached K/V, through the manager's block tables, with
the window or chunk of the layer's KV-cache group. On a GPU pool it launches
``kernels/decode_attention.cu``; on a CPU pool it runs the torch reference of
:mod:`pagedkv.device.cpu_ops`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pagedkv.device import cpu_ops, device_ops, id_checks
from pagedkv.device import kernel_loader as K
from pagedkv.device import pool_groups as PG
from pagedkv.device.id_checks import host_array as _host_array
from pagedkv.errors import InvalidArgumentError

if TYPE_CHECKING:
    import torch

    from pagedkv.device.pool import KVCachePool

__all__ = ["paged_decode_attention"]


def paged_decode_attention(
    q: torch.Tensor,
    pool: KVCachePool,
    layer: int,
    block_tables: Any,
    seq_lens: Any,
    scale: float | None = None,
    *,
    max_seq_len: int | None = None,
    num_splits: int | None = None,
    group: int | None = None,
) -> torch.Tensor:
    """Attention of one query token per sequence (``q [batch, num_heads, head_dim]``,
    num_heads a multiple of the pool's num_kv_heads) over its first ``seq_lens[i]`` tokens
    in the pool, through ``block_tables[i]``. Softmax in fp32 with ``scale`` (default
    ``head_dim ** -0.5``); split-KV for long sequences. Returns ``[batch, num_heads,
    head_dim]`` in q's dtype (0 for a sequence of length 0). On a GPU, head_dim must be 64,
    128 or 256. ``max_seq_len`` spares a synchronisation when seq_lens is a device tensor;
    it must be at least every sequence's length: with host seq_lens a shorter one raises,
    with device seq_lens (unread on the host) the kernel gives NaN for a sequence beyond it
    or beyond its table. ``num_splits`` forces the split count.

    With groups, ``group`` must be the layer's group, and the layer's group limits what a
    query reads: the last ``window`` positions (sliding_window) or its own chunk
    (chunked_local); entries before that may be the null block (never read), the ones read
    may not."""
    layer = pool._check_layer(layer)
    pool.layout.check_group_arg(layer, group)
    pool._kv_layer(layer)
    window, chunk = pool.layout.attention_limits(layer)
    pool._check_tensor(q, "q", (None, None, pool.head_dim))
    batch, num_heads, dim = q.shape
    if num_heads % pool.num_kv_heads:
        raise InvalidArgumentError(
            f"num_heads {num_heads} is not a multiple of num_kv_heads {pool.num_kv_heads}"
        )
    if pool._launcher is not None and dim not in K.DECODE_HEAD_DIMS:
        raise InvalidArgumentError(f"head_dim {dim} not supported (64, 128, 256)")
    if batch >= 65536:
        raise InvalidArgumentError("batch must be below 65536")
    import torch

    lens = _host_array(seq_lens, "seq_lens")
    bt = _host_array(block_tables, "block_tables")
    if id_checks.ids_shape(lens, seq_lens) != (batch,):
        raise InvalidArgumentError(f"seq_lens must have shape ({batch},)")
    pool._check_tables(bt, block_tables, lens, batch, "seq_lens")
    if bt is not None and lens is not None and pool.null_block:
        what = f"attention of {pool.layout.describe(layer)}"
        PG.check_attended_not_null(bt, lens, pool.block_size, window, chunk, what)
    bound = id_checks.check_max_seq_len(max_seq_len, lens)
    if lens is not None:
        max_len = int(lens.max()) if lens.size else 0
    else:
        # A device seq_lens longer than max_seq_len cannot be seen here without a
        # synchronisation: the kernel then writes NaN for that sequence, never a truncation.
        max_len = bound if bound is not None else int(seq_lens.max().item())
    if scale is None:
        scale = cpu_ops.default_scale(dim)
    if batch == 0:
        return torch.empty((0, num_heads, dim), dtype=q.dtype, device=q.device)
    with pool._on_device():
        tables = pool._ids(bt, block_tables, torch.int32)
        sl = pool._ids(lens, seq_lens, torch.int32)
        kc, vc = pool.key(layer), pool.value(layer)
        if pool._launcher is None:
            return cpu_ops.paged_decode_attention(
                q, kc, vc, tables, sl, scale, window=window, chunk=chunk
            )
        return device_ops.paged_decode_attention(
            pool._launcher,
            pool.dtype_name,
            q,
            kc,
            vc,
            tables,
            sl,
            max_len,
            float(scale),
            num_splits,
            window,
            chunk,
        )
