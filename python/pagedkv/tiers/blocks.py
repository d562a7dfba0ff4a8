"""Blocks' bytes in a `KVCachePool`, out and back: every layer's K and V of one block, as one
contiguous byte string (the unit a tier stores), moved in batches.

`copy_out` gathers a batch of blocks into one host buffer. On a GPU pool it runs on a side
stream of its own: the side stream first waits for the work already issued on the current
(compute) stream, so the copy reads the KV those steps wrote; the compute stream then waits
for the copy's event, so no later kernel on it (the next step's writes into a reused block,
a load into it) can overwrite a block before the copy has read it. Neither wait blocks the
CPU: the caller goes on at once and `BlockCopy.wait()` (on a background thread) waits for
the bytes. On a CPU pool the copy is done when `copy_out` returns.

`copy_in` writes a batch of blocks back, on the current stream, so the step's kernels issued
after it read the loaded KV.

A pool whose `buffer` is a numpy array (`tiers.host_pool.HostKVPool`, torch-free) is copied
with numpy: done when the call returns, as for a CPU `KVCachePool`, with the same bytes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from pagedkv.errors import InvalidArgumentError

if TYPE_CHECKING:
    import torch

    from pagedkv.device.pool import KVCachePool
    from pagedkv.tiers.host_pool import HostKVPool

    Pool = KVCachePool | HostKVPool


def block_nbytes(pool: Pool) -> int:
    """Bytes of one block across every row (layer) of the pool, K and V."""
    if isinstance(pool.buffer, np.ndarray):
        return int(pool.buffer[:, :, 0].nbytes)
    per_block: int = pool.buffer[:, :, 0].numel() * pool.buffer.element_size()
    return per_block


@dataclass
class BlockCopy:
    """Blocks copied out of a pool: `host[i]` holds the i-th block's bytes once `wait()` has
    returned (a GPU copy may still be in flight before). `host` is pinned for a GPU pool."""

    host: torch.Tensor | np.ndarray  # uint8 [n, block_nbytes]
    event: Any  # torch.cuda.Event the copy records, or None (done at once)

    def __len__(self) -> int:
        return int(self.host.shape[0])

    @property
    def nbytes(self) -> int:
        return int(self.host.nbytes)

    def wait(self) -> None:
        """Block the calling thread until the bytes are on the host."""
        if self.event is not None:
            self.event.synchronize()

    def block(self, i: int) -> memoryview:
        """The i-th block's bytes (call `wait()` first); a view of `host`, not a copy."""
        row = self.host[i]
        view: memoryview = row.data if isinstance(row, np.ndarray) else row.numpy().data
        return view


def _check_blocks(pool: Pool, blocks: Sequence[int]) -> np.ndarray:
    ids = np.asarray(blocks, dtype=np.int64).reshape(-1)
    if ids.size and (ids.min() < 0 or ids.max() >= pool.num_blocks):
        raise InvalidArgumentError(f"block ids must be in [0, {pool.num_blocks})")
    if pool.null_block and (ids == 0).any():
        raise InvalidArgumentError("block 0 is the null block: it holds no KV to move")
    return ids


def _side_stream(pool: KVCachePool) -> Any:
    """The pool's demotion stream (made on first use, one per pool)."""
    import torch

    stream = getattr(pool, "_tier_stream", None)
    if stream is None:
        stream = torch.cuda.Stream(device=pool.device)  # type: ignore[no-untyped-call]
        pool._tier_stream = stream  # type: ignore[attr-defined]
    return stream


def copy_out(pool: Pool, blocks: Sequence[int]) -> BlockCopy:
    """Gather `blocks` (each once) into one host buffer (module docstring for the order)."""
    ids = _check_blocks(pool, blocks)
    n, nbytes = len(ids), block_nbytes(pool)
    if isinstance(pool.buffer, np.ndarray):
        rows = np.ascontiguousarray(np.moveaxis(pool.buffer[:, :, ids], 2, 0))
        return BlockCopy(rows.view(np.uint8).reshape(n, nbytes), None)
    import torch

    idx = torch.from_numpy(ids)
    if pool.device.type != "cuda":
        gathered = pool.buffer.index_select(2, idx).movedim(2, 0).contiguous()
        return BlockCopy(gathered.view(torch.uint8).reshape(n, nbytes), None)
    compute = torch.cuda.current_stream(pool.device)
    side = _side_stream(pool)
    side.wait_stream(compute)
    with torch.cuda.stream(side):
        dev_idx = idx.pin_memory().to(pool.device, non_blocking=True)
        gathered = pool.buffer.index_select(2, dev_idx).movedim(2, 0).contiguous()
        host = torch.empty((n, nbytes), dtype=torch.uint8, pin_memory=True)
        host.copy_(gathered.view(torch.uint8).reshape(n, nbytes), non_blocking=True)
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record(side)
    compute.wait_event(event)
    return BlockCopy(host, event)


def copy_in(pool: Pool, blocks: Sequence[int], data: Sequence[bytes | memoryview]) -> None:
    """Write `data[i]` (a block's bytes, as `copy_out` gave them) into `blocks[i]`, on the
    current stream."""
    ids = _check_blocks(pool, blocks)
    if len(data) != len(ids):
        raise InvalidArgumentError(f"{len(ids)} blocks but {len(data)} byte strings")
    if len(np.unique(ids)) != len(ids):
        raise InvalidArgumentError("copy_in writes each block once")
    want = block_nbytes(pool)
    for d in data:
        if len(d) != want:
            raise InvalidArgumentError(f"a block of this pool is {want} bytes, got {len(d)}")
    if not len(ids):
        return
    if isinstance(pool.buffer, np.ndarray):
        shape = (len(ids), *pool.buffer[:, :, 0].shape)
        rows = np.frombuffer(b"".join(data), dtype=pool.buffer.dtype).reshape(shape)
        pool.buffer[:, :, ids] = np.moveaxis(rows, 0, 2)
        return
    import torch

    raw = torch.frombuffer(bytearray(b"".join(data)), dtype=torch.uint8)
    idx = torch.from_numpy(ids)
    if pool.device.type == "cuda":
        raw = raw.pin_memory().to(pool.device, non_blocking=True)
        idx = idx.pin_memory().to(pool.device, non_blocking=True)
    shape = (len(ids), *pool.buffer[:, :, 0].shape)
    values = raw.view(pool.dtype).reshape(shape).movedim(0, 2)
    pool.buffer.index_copy_(2, idx, values)


def read_block(pool: Pool, block: int) -> bytes:
    """Copy block `block` out of the pool and wait for it."""
    copy = copy_out(pool, [block])
    copy.wait()
    return bytes(copy.block(0))


def write_block(pool: Pool, block: int, data: bytes | memoryview) -> None:
    """Write `data` (as `read_block` gave it) into block `block` of the pool."""
    copy_in(pool, [block], [data])


__all__ = ["BlockCopy", "block_nbytes", "copy_in", "copy_out", "read_block", "write_block"]
