"""`HostKVPool`: a KV pool in host memory held by numpy, for work without torch (the
simulator's tier run, `sim.tier_run`). It has the layout of a CPU `KVCachePool` without KV-cache
groups, `[layers, 2 (K, V), blocks, block_size, kv_heads, head_dim]`, and what
`tiers.blocks` and `tiers.cache.TieredCache` use of one: `block_size`, `num_blocks`,
`null_block` (with `groups=`, the manager's null block), `buffer`, a block's bytes out and
back in (`tiers.blocks` dispatches on a numpy `buffer`), slot writes, copy-on-write copies
and swaps.

bfloat16 has no numpy dtype: its values are kept as their 16 bits (`uint16`), rounded from
float32 to nearest even as torch rounds them, so a block's bytes are the ones a torch
bfloat16 pool would hold.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from pagedkv.errors import InvalidArgumentError
from pagedkv.groups import KVCacheGroup, check_groups, has_null_block

#: dtype name -> the numpy dtype its values are stored as.
_STORAGE = {"bfloat16": np.uint16, "float16": np.float16, "float32": np.float32}


def to_bfloat16_bits(x: npt.NDArray[np.float32]) -> npt.NDArray[np.uint16]:
    """float32 -> bfloat16's bits, rounded to nearest even (finite values)."""
    b = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = b + (np.uint32(0x7FFF) + ((b >> np.uint32(16)) & np.uint32(1)))
    return (rounded >> np.uint32(16)).astype(np.uint16)


class HostKVPool:
    """KV blocks in a numpy array (module docstring). Block ids are checked by the callers
    that take them from outside (`tiers.blocks`); the simulator passes the manager's.

    `groups`: the manager's KV-cache groups, for a manager built with them. Each layer
    keeps its own row (this pool does not share rows between groups as `KVCachePool`
    does: a block's bytes are every row's), and block 0 is the null block exactly when the
    manager has one (`pagedkv.groups.has_null_block`)."""

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: str = "bfloat16",
        *,
        groups: Sequence[KVCacheGroup] | None = None,
    ) -> None:
        if dtype not in _STORAGE:
            raise InvalidArgumentError(f"dtype must be one of {sorted(_STORAGE)}, got {dtype!r}")
        given: tuple[tuple[str, object], ...] = (
            ("num_layers", num_layers),
            ("num_blocks", num_blocks),
            ("block_size", block_size),
            ("num_kv_heads", num_kv_heads),
            ("head_dim", head_dim),
        )
        for name, v in given:
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise InvalidArgumentError(f"{name} must be a positive int, got {v!r}")
        self.num_layers = num_layers
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.groups = None if groups is None else check_groups(groups, block_size)
        #: Whether block 0 is the null block (nothing moves it): the manager's rule.
        self.null_block = has_null_block(self.groups)
        shape = (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim)
        # np.zeros maps untouched pages lazily: a large pool costs what is written.
        self.buffer: npt.NDArray[Any] = np.zeros(shape, dtype=_STORAGE[dtype])

    def __repr__(self) -> str:
        return (
            f"HostKVPool(layers={self.num_layers}, blocks={self.num_blocks}, "
            f"block_size={self.block_size}, kv_heads={self.num_kv_heads}, "
            f"head_dim={self.head_dim}, dtype={self.dtype})"
        )

    def stored(self, x: npt.NDArray[np.float32]) -> npt.NDArray[Any]:
        """float32 values as this pool stores them."""
        if self.dtype == "bfloat16":
            return to_bfloat16_bits(x)
        return np.asarray(x, dtype=_STORAGE[self.dtype])

    def write(
        self,
        layer: int,
        k: npt.NDArray[np.float32],
        v: npt.NDArray[np.float32],
        slots: npt.NDArray[np.int64],
    ) -> None:
        """Write K and V `[n, kv_heads, head_dim]` of layer `layer` into `slots` (block *
        block_size + offset), each slot once."""
        h, d = self.num_kv_heads, self.head_dim
        self.buffer[layer, 0].reshape(-1, h, d)[slots] = self.stored(k)
        self.buffer[layer, 1].reshape(-1, h, d)[slots] = self.stored(v)

    def read(
        self, layer: int, what: int, blocks: npt.NDArray[np.int64], offsets: npt.NDArray[np.int64]
    ) -> npt.NDArray[Any]:
        """The stored K (`what` 0) or V (1) of layer `layer` at each (block, offset)."""
        out: npt.NDArray[Any] = self.buffer[layer, what][blocks, offsets]
        return out

    def copy_blocks(self, pairs: npt.NDArray[np.int64]) -> None:
        """Copy-on-write pairs `(src, dst)` `[n, 2]`: every layer's K and V of src into dst
        (all sources read before any destination is written)."""
        a = np.asarray(pairs, dtype=np.int64).reshape(-1, 2)
        if len(a):
            self.buffer[:, :, a[:, 1]] = self.buffer[:, :, a[:, 0]]

    def swap_pool(self, num_cpu_blocks: int) -> HostKVPool:
        """A pool of the same layout with `num_cpu_blocks` blocks (the CPU swap space)."""
        return HostKVPool(
            self.num_layers,
            num_cpu_blocks,
            self.block_size,
            self.num_kv_heads,
            self.head_dim,
            self.dtype,
        )  # no groups: CPU block ids are all real, there is no null block


def swap_host_blocks(src: HostKVPool, dst: HostKVPool, pairs: npt.NDArray[np.int64]) -> None:
    """Move blocks `(src block, dst block)` `[n, 2]` between two pools of one layout."""
    if src.buffer.shape[3:] != dst.buffer.shape[3:] or src.buffer.shape[:2] != dst.buffer.shape[:2]:
        raise InvalidArgumentError("swap pools must have the same layout")
    a = np.asarray(pairs, dtype=np.int64).reshape(-1, 2)
    if len(a):
        dst.buffer[:, :, a[:, 1]] = src.buffer[:, :, a[:, 0]]


__all__ = ["HostKVPool", "swap_host_blocks", "to_bfloat16_bits"]
