"""CPU reference implementations of the pool's kernels, in plain torch.

They are what a pool on ``device="cpu"`` runs, and the oracle the kernel tests compare
against. Arguments are already validated and already torch tensors on the pool's device
(see :mod:`pagedkv.device.pool`); ``k_cache``/``v_cache`` are one layer's views
``[num_blocks, block_size, num_kv_heads, head_dim]``.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def token_slots(block_tables: torch.Tensor, lens: torch.Tensor, block_size: int) -> torch.Tensor:
    """int64 slots of positions ``0 .. lens[i]-1`` of every sequence, concatenated."""
    import torch

    parts = []
    for i, n in enumerate(lens.tolist()):
        pos = torch.arange(int(n), dtype=torch.int64)
        blocks = block_tables[i].to(torch.int64)[pos // block_size]
        parts.append(blocks * block_size + pos % block_size)
    if not parts:
        return torch.zeros(0, dtype=torch.int64)
    return torch.cat(parts)


def write(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """``cache[slot] = key[token]`` for every token whose slot is not negative."""
    heads, dim = k_cache.shape[2], k_cache.shape[3]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    # index_copy_, not item assignment: torch's CPU index_put is ~100x slower on bf16 (the
    # slots are distinct: the pool checks).
    k_cache.view(-1, heads, dim).index_copy_(0, slots, key[keep].to(k_cache.dtype))
    v_cache.view(-1, heads, dim).index_copy_(0, slots, value[keep].to(v_cache.dtype))


def gather(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seq_lens: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Paged to contiguous: rows ``cu_seq_lens[i] .. cu_seq_lens[i+1]`` hold sequence i."""
    block_size, heads, dim = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
    lens = cu_seq_lens[1:] - cu_seq_lens[:-1]
    slots = token_slots(block_tables.cpu(), lens.cpu(), block_size).to(k_cache.device)
    return (
        k_cache.view(-1, heads, dim)[slots].clone(),
        v_cache.view(-1, heads, dim)[slots].clone(),
    )


def copy_blocks(buffer: torch.Tensor, pairs: torch.Tensor) -> None:
    """Copy-on-write: block ``dst`` of every layer, K and V, becomes a copy of ``src``.
    ``buffer`` is the pool's ``[layers, 2, num_blocks, ...]`` allocation."""
    if pairs.shape[0] == 0:
        return
    src, dst = pairs[:, 0].long(), pairs[:, 1].long()
    buffer.index_copy_(2, dst, buffer.index_select(2, src))


def swap(src_buffer: torch.Tensor, dst_buffer: torch.Tensor, pairs: torch.Tensor) -> None:
    """Block ``dst`` of the destination pool becomes block ``src`` of the source pool."""
    if pairs.shape[0] == 0:
        return
    src = pairs[:, 0].long().to(src_buffer.device)
    dst = pairs[:, 1].long().to(dst_buffer.device)
    dst_buffer.index_copy_(2, dst, src_buffer.index_select(2, src).to(dst_buffer.device))


def attention_start(seq_len: int, window: int = 0, chunk: int = 0) -> int:
    """The first position the query at ``seq_len - 1`` attends to: the last ``window``
    positions (FlashAttention's ``window_left = window - 1``), or its own ``chunk``-token
    chunk; 0 means no limit (full causal attention)."""
    lo = 0
    if seq_len > 0 and window > 0:
        lo = max(lo, seq_len - window)
    if seq_len > 0 and chunk > 0:
        lo = max(lo, (seq_len - 1) // chunk * chunk)
    return lo


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    compute_dtype: torch.dtype | None = None,
    *,
    window: int = 0,
    chunk: int = 0,
) -> torch.Tensor:
    """Softmax attention of each sequence's one query token over its cached tokens
    ``attention_start(seq_lens[i], window, chunk) .. seq_lens[i] - 1`` (all of them by
    default), GQA by repeating each KV head over its group. Table entries before that
    start are not read. Computed in fp32 (or ``compute_dtype``), returned in q's dtype; a
    sequence of length 0 gives 0."""
    import torch

    ct = compute_dtype or torch.float32
    batch, num_heads, dim = q.shape
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // kv_heads
    out = torch.zeros((batch, num_heads, dim), dtype=ct)
    kf = k_cache.view(-1, kv_heads, dim)
    vf = v_cache.view(-1, kv_heads, dim)
    tables = block_tables.cpu()
    for i, n in enumerate(seq_lens.cpu().tolist()):
        if n == 0:
            continue
        pos = torch.arange(attention_start(n, window, chunk), n, dtype=torch.int64)
        blocks = tables[i].to(torch.int64)[pos // block_size]
        slots = (blocks * block_size + pos % block_size).to(kf.device)
        k = kf[slots].to(ct).cpu().repeat_interleave(group, dim=1)  # [n, heads, dim]
        v = vf[slots].to(ct).cpu().repeat_interleave(group, dim=1)
        s = torch.einsum("hd,nhd->hn", q[i].to(ct).cpu(), k) * scale
        p = torch.softmax(s, dim=-1)
        out[i] = torch.einsum("hn,nhd->hd", p, v)
    return out.to(dtype=q.dtype, device=q.device)


def default_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)
