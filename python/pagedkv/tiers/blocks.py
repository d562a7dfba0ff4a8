"""A block's bytes in a `KVCachePool`, out and back: every layer's K and V of one block, as
one contiguous byte string (the unit a tier stores)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pagedkv.errors import InvalidArgumentError

if TYPE_CHECKING:
    from pagedkv.pool import KVCachePool


def block_nbytes(pool: KVCachePool) -> int:
    """Bytes of one block across every row (layer) of the pool, K and V."""
    per_block: int = pool.buffer[:, :, 0].numel() * pool.buffer.element_size()
    return per_block


def read_block(pool: KVCachePool, block: int) -> bytes:
    """Copy block `block` out of the pool (a device pool copies it to the host)."""
    import torch

    view = pool.buffer[:, :, block].contiguous().view(torch.uint8)
    return bytes(view.cpu().numpy().tobytes())


def write_block(pool: KVCachePool, block: int, data: bytes | memoryview) -> None:
    """Write `data` (as `read_block` gave it) into block `block` of the pool."""
    import torch

    want = block_nbytes(pool)
    if len(data) != want:
        raise InvalidArgumentError(f"a block of this pool is {want} bytes, got {len(data)}")
    raw: Any = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    shape = pool.buffer[:, :, block].shape
    pool.buffer[:, :, block] = raw.view(pool.dtype).reshape(shape).to(pool.device)


__all__ = ["block_nbytes", "read_block", "write_block"]
