"""The KV pool: one preallocated buffer for every layer's K and V blocks, and the kernels
that work on it.

``KVCachePool(num_layers, num_blocks, block_size, num_kv_heads, head_dim, dtype, device)``
allocates one torch tensor ``[num_layers, 2, num_blocks, block_size, num_kv_heads,
head_dim]``; ``key(layer)``/``value(layer)`` are contiguous views ``[num_blocks,
block_size, num_kv_heads, head_dim]`` (the "flash" layout of vLLM and FlashInfer). On
``device="cuda"`` the operations launch the CuPy kernels of ``kernels/*.cu`` on torch's
current stream; on ``device="cpu"`` they run the torch reference ops of
:mod:`pagedkv.device.cpu_ops`. Block ids, slots, tables and pairs come straight from
:class:`pagedkv.BlockManager` (numpy arrays) or as torch tensors.

Ids given as numpy arrays or CPU tensors are validated on the host (a bad block id, slot
or length raises :class:`pagedkv.InvalidArgumentError` and nothing runs; see
:mod:`pagedkv.device.id_checks`) and reach the GPU through pinned memory with a non-blocking copy,
so no call synchronises with the device. Ids that are already CUDA tensors are checked only
as far as their dtype and shape tell (reading their values would synchronise); the kernels
still skip out-of-range ids and lengths, so nothing is read or written outside the pool.

Ordering: every kernel runs on the current torch stream, so work issued before on that
stream (attention reading a block) completes before a copy that overwrites it, and a block
freed by the manager can be reused by work issued after.

With ``groups=[KVCacheGroup, ...]`` and ``layer_groups=[group of each layer]`` (the
manager's group list) the layers of different groups share buffer rows, every call that
takes tables or slots for a layer takes ``group=`` (which must be the layer's group),
decode attention applies the group's window or chunk, and state layers keep a state per
block; block 0 is the null block exactly when the manager has one (some group is not full
attention: ``pagedkv.groups.has_null_block``), otherwise an ordinary block
(:mod:`pagedkv.device.pool_groups`, docs/kernels.md).
"""

from __future__ import annotations

import math
import os
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

import numpy as np

from pagedkv.device import cpu_ops, cupy_launch, device_ops, id_checks
from pagedkv.device import kernel_loader as K
from pagedkv.device import pool_groups as PG
from pagedkv.device.attention import paged_decode_attention
from pagedkv.errors import InvalidArgumentError
from pagedkv.groups import has_null_block

if TYPE_CHECKING:
    import torch

    from pagedkv.device.kernel_loader import Launcher

__all__ = ["KVCachePool", "paged_decode_attention", "swap_blocks"]

_DTYPE_NAMES = {
    "float32": "float32",
    "fp32": "float32",
    "float": "float32",
    "float16": "float16",
    "fp16": "float16",
    "half": "float16",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
}


def _torch() -> Any:
    import torch

    return torch


def _dtype_name(dtype: Any) -> str:
    if isinstance(dtype, str):
        name = _DTYPE_NAMES.get(dtype.lower())
    else:
        name = _DTYPE_NAMES.get(str(dtype).removeprefix("torch."))
    if name is None:
        raise InvalidArgumentError(f"unsupported dtype {dtype!r}: float16, bfloat16, float32")
    return name


def _positive_int(name: str, v: object) -> int:
    if isinstance(v, bool) or not isinstance(v, int | np.integer) or v < 1:
        raise InvalidArgumentError(f"{name} must be a positive integer, got {v!r}")
    return int(v)


_host_array = id_checks.host_array


class KVCachePool:
    """Preallocated paged KV cache for all layers (see the module docstring).

    ``groups``/``layer_groups``: a pool for a manager with KV-cache groups; ``state_shape``
    (a tuple, or ``{group: tuple}``) and ``state_dtype`` (default ``dtype``) give the state
    of each block of a state group. ``launcher`` (tests only) replaces the device's kernel
    launcher, e.g. with the C++ host harness that runs the CUDA sources on a CPU pool."""

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: Any = "bfloat16",
        device: Any = "cuda",
        *,
        groups: Any = None,
        layer_groups: Any = None,
        state_shape: Any = None,
        state_dtype: Any = None,
        pin_memory: bool = False,
        launcher: Launcher | None = None,
    ) -> None:
        import torch

        for name, v in (
            ("num_layers", num_layers),
            ("num_blocks", num_blocks),
            ("block_size", block_size),
            ("num_kv_heads", num_kv_heads),
            ("head_dim", head_dim),
        ):
            _positive_int(name, v)
        if num_blocks >= 2**31 or num_blocks * block_size >= 2**62:
            raise InvalidArgumentError("num_blocks too large")
        self.num_layers = int(num_layers)
        self.num_blocks = int(num_blocks)
        self.block_size = int(block_size)
        self.num_kv_heads = int(num_kv_heads)
        self.head_dim = int(head_dim)
        self.dtype_name = _dtype_name(dtype)
        self.dtype: torch.dtype = getattr(torch, self.dtype_name)
        #: Where each layer keeps its pages (pagedkv.device.pool_groups).
        self.layout = PG.make_layout(
            self.num_layers, self.block_size, groups, layer_groups, state_shape
        )
        self.state_dtype_name = self.dtype_name if state_dtype is None else _dtype_name(state_dtype)
        PG.check_state_fits(
            self.layout,
            self.block_size * self.num_kv_heads * self.head_dim * K.ITEMSIZE[self.dtype_name],
            K.ITEMSIZE[self.state_dtype_name],
        )
        #: Block 0 is the null block, which nothing writes, exactly when the manager has one:
        #: some group is not full attention (`pagedkv.groups.has_null_block`; its swap pool
        #: has none, as CPU block ids are all real).
        self.null_block = has_null_block(self.layout.groups)
        dev = torch.device(device)
        index = cupy_launch.device_index(dev, torch.cuda.current_device)
        if index is not None:
            dev = torch.device("cuda", index)
        self.device: torch.device = dev
        shape = (
            self.layout.num_rows,
            2,
            self.num_blocks,
            self.block_size,
            self.num_kv_heads,
            self.head_dim,
        )
        pin = pin_memory and self.device.type == "cpu"
        with self._on_device():
            #: The one allocation: [rows, 2 (K, V), num_blocks, block_size, heads, head_dim];
            #: one row per layer, or with groups one per layer of the largest group.
            self.buffer: torch.Tensor = torch.zeros(
                shape, dtype=self.dtype, device=self.device, pin_memory=pin
            )
            if launcher is None and index is not None:
                launcher = cupy_launch.cupy_launcher(index)
        self._launcher = launcher

    # ---- sizing -------------------------------------------------------------------------

    @staticmethod
    def block_bytes(
        num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: Any
    ) -> int:
        """Bytes one block takes across all layers, K and V (with groups pass the rows,
        the most layers of one group, as ``num_layers``: see ``pool.bytes_per_block``)."""
        return (
            2 * num_layers * block_size * num_kv_heads * head_dim * K.ITEMSIZE[_dtype_name(dtype)]
        )

    @property
    def bytes_per_block(self) -> int:
        return self.block_bytes(
            self.layout.num_rows, self.block_size, self.num_kv_heads, self.head_dim, self.dtype_name
        )

    @property
    def nbytes(self) -> int:
        return self.bytes_per_block * self.num_blocks

    @classmethod
    def from_memory(
        cls,
        num_layers: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: Any = "bfloat16",
        device: Any = "cuda",
        *,
        prealloc_ratio: float = 0.9,
        max_blocks: int | None = None,
        groups: Any = None,
        layer_groups: Any = None,
        state_shape: Any = None,
        state_dtype: Any = None,
        pin_memory: bool = False,
        launcher: Launcher | None = None,
    ) -> KVCachePool:
        """A pool that takes ``prealloc_ratio`` of the device's free memory (for "cpu": of
        the available physical memory). ``pool.num_blocks`` says how many blocks it got."""
        if not 0.0 < prealloc_ratio <= 1.0:
            raise InvalidArgumentError("prealloc_ratio must be in (0, 1]")
        import torch

        dev = torch.device(device)
        if dev.type == "cuda":
            free, _total = torch.cuda.mem_get_info(dev)
        else:
            free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        rows = PG.make_layout(num_layers, block_size, groups, layer_groups, state_shape).num_rows
        per = cls.block_bytes(rows, block_size, num_kv_heads, head_dim, dtype)
        n = int(free * prealloc_ratio) // per
        if max_blocks is not None:
            n = min(n, max_blocks)
        if n < 1:
            raise InvalidArgumentError(
                f"{free} free bytes x {prealloc_ratio} holds no block of {per} bytes"
            )
        return cls(
            num_layers,
            n,
            block_size,
            num_kv_heads,
            head_dim,
            dtype,
            dev,
            groups=groups,
            layer_groups=layer_groups,
            state_shape=state_shape,
            state_dtype=state_dtype,
            pin_memory=pin_memory,
            launcher=launcher,
        )

    def swap_pool(self, num_cpu_blocks: int) -> KVCachePool:
        """A CPU pool of the same layout for swap space (pinned when this pool is on a GPU).
        It has no null block: every CPU block id is a real block."""
        lay = self.layout
        pool = KVCachePool(
            self.num_layers,
            num_cpu_blocks,
            self.block_size,
            self.num_kv_heads,
            self.head_dim,
            self.dtype_name,
            "cpu",
            groups=lay.groups,
            layer_groups=None if lay.groups is None else list(lay.layer_group),
            state_shape=dict(lay.state_shapes) or None,
            state_dtype=self.state_dtype_name,
            pin_memory=self.device.type == "cuda",
        )
        pool.null_block = False
        return pool

    def warmup(self) -> None:
        """Compile (or load from CuPy's disk cache) every kernel now, not on a request."""
        launcher = self._launcher
        warm = getattr(launcher, "warmup", None)
        if warm is not None:
            warm()

    def __repr__(self) -> str:
        return (
            f"KVCachePool(num_layers={self.num_layers}, num_blocks={self.num_blocks}, "
            f"block_size={self.block_size}, num_kv_heads={self.num_kv_heads}, "
            f"head_dim={self.head_dim}, dtype={self.dtype_name}, device={self.device}, "
            + ("" if self.layout.groups is None else f"{len(self.layout.groups)} groups, ")
            + f"{self.nbytes / 2**20:.1f} MiB)"
        )

    # ---- views --------------------------------------------------------------------------

    def _check_layer(self, layer: int) -> int:
        if isinstance(layer, bool) or not isinstance(layer, int | np.integer):
            raise InvalidArgumentError(f"layer must be an integer, got {layer!r}")
        if not 0 <= layer < self.num_layers:
            raise InvalidArgumentError(f"layer {layer!r} out of range 0..{self.num_layers - 1}")
        return int(layer)

    def _kv_layer(self, layer: int) -> int:
        """A layer that holds K and V (not a state layer): its buffer row."""
        layer = self._check_layer(layer)
        if self.layout.is_state(layer):
            raise InvalidArgumentError(
                f"{self.layout.describe(layer)} holds a state, not K/V: use pool.state({layer})"
            )
        return self.layout.layer_row[layer]

    def key(self, layer: int) -> torch.Tensor:
        """K of one layer: ``[num_blocks, block_size, num_kv_heads, head_dim]``."""
        return self.buffer[self._kv_layer(layer), 0]

    def value(self, layer: int) -> torch.Tensor:
        """V of one layer: ``[num_blocks, block_size, num_kv_heads, head_dim]``."""
        return self.buffer[self._kv_layer(layer), 1]

    def group_of(self, layer: int) -> int:
        """The group whose tables and slots this layer takes (0 in a pool without groups)."""
        return self.layout.layer_group[self._check_layer(layer)]

    def state(self, layer: int) -> torch.Tensor:
        """The states of a state layer: ``[num_blocks, *state_shape]`` in ``state_dtype``,
        block b's state at the start of block b's K page in the layer's row (a view: write
        it in place; copy_blocks and swap_blocks move it with the block)."""
        layer = self._check_layer(layer)
        if not self.layout.is_state(layer):
            raise InvalidArgumentError(f"{self.layout.describe(layer)} is not a state layer")
        import torch

        shape = self.layout.state_shapes[self.layout.layer_group[layer]]
        sdt = getattr(torch, self.state_dtype_name)
        nbytes = math.prod(shape) * K.ITEMSIZE[self.state_dtype_name]
        page = self.buffer[self.layout.layer_row[layer], 0].view(self.num_blocks, -1)
        raw = page.view(torch.uint8)[:, :nbytes]
        out: torch.Tensor = raw.view(sdt).view(self.num_blocks, *shape)
        return out

    # ---- helpers ------------------------------------------------------------------------

    def _on_device(self) -> AbstractContextManager[Any]:
        """torch's guard for this pool's GPU around every allocation and launch (the CuPy
        side enters the same device in each launch: pagedkv.device.cupy_launch.DeviceKernel)."""
        return cupy_launch.torch_device_guard(self.device)

    def _ids(self, a: np.ndarray | None, x: Any, dtype: Any) -> torch.Tensor:
        """Ids as a contiguous tensor of ``dtype`` on the pool's device, without a sync."""
        import torch

        if a is None:  # already a device tensor
            t: torch.Tensor = x.to(device=self.device, dtype=dtype).contiguous()
            return t
        t = torch.from_numpy(np.ascontiguousarray(a)).to(dtype)
        if self.device.type == "cuda":
            t = t.pin_memory().to(self.device, non_blocking=True)
        return t

    def _check_tensor(self, t: Any, what: str, shape: tuple[int | None, ...]) -> None:
        import torch

        if not isinstance(t, torch.Tensor):
            raise InvalidArgumentError(f"{what} must be a torch tensor")
        if t.dtype != self.dtype:
            raise InvalidArgumentError(f"{what} has dtype {t.dtype}, the pool {self.dtype}")
        if t.device != self.device:
            raise InvalidArgumentError(f"{what} is on {t.device}, the pool on {self.device}")
        if t.dim() != len(shape) or any(
            s is not None and d != s for d, s in zip(t.shape, shape, strict=True)
        ):
            want = ", ".join("*" if s is None else str(s) for s in shape)
            raise InvalidArgumentError(f"{what} has shape {tuple(t.shape)}, expected [{want}]")

    def _check_tables(
        self,
        bt: np.ndarray | None,
        block_tables: Any,
        lens: np.ndarray | None,
        batch: int,
        what: str,
    ) -> None:
        """The table's shape (from the host array or the device tensor's metadata), the
        host lengths against its width, and, when both are on the host, every block a
        sequence uses."""
        max_blocks = id_checks.check_table_shape(id_checks.ids_shape(bt, block_tables), batch)
        if lens is None:
            return
        id_checks.check_lengths_fit(lens, max_blocks, self.block_size, what)
        if bt is not None:
            id_checks.check_used_ids(bt, lens, self.block_size, self.num_blocks)

    # ---- operations ---------------------------------------------------------------------

    def write(
        self,
        layer: int,
        key: torch.Tensor,
        value: torch.Tensor,
        slot_mapping: Any,
        *,
        group: int | None = None,
    ) -> None:
        """Store new tokens' K and V (``[tokens, num_kv_heads, head_dim]``, any token/head
        strides) in their slots (int64 ``slot_mapping``, -1 = skip this token). With groups,
        ``group`` says whose slot mapping it is (it must be the layer's group); in a pool
        with a null block (``null_block``) a slot in it (a position the group released: the
        manager maps it there) is skipped as well: nothing writes the null block."""
        layer = self._check_layer(layer)
        self.layout.check_group_arg(layer, group)
        self._kv_layer(layer)
        shape = (None, self.num_kv_heads, self.head_dim)
        self._check_tensor(key, "key", shape)
        self._check_tensor(value, "value", (key.shape[0], *shape[1:]))
        a = _host_array(slot_mapping, "slot_mapping")
        n = key.shape[0]
        first_slot = self.block_size if self.null_block else 0
        if a is not None:
            if a.shape != (n,):
                raise InvalidArgumentError(f"slot_mapping must have shape ({n},)")
            num_slots = self.num_blocks * self.block_size
            if a.size and (a.min() < -1 or a.max() >= num_slots):
                raise InvalidArgumentError(f"slots must be -1 or in 0..{num_slots - 1}")
            if first_slot:  # released positions share the null block's slots: not a clash
                a = np.where(a < first_slot, -1, a)
            valid = a[a >= 0]
            if np.unique(valid).size != valid.size:
                raise InvalidArgumentError("slot_mapping holds a slot twice")
        import torch

        with self._on_device():
            slots = self._ids(a, slot_mapping, torch.int64)
            kc, vc = self.key(layer), self.value(layer)
            if self._launcher is None:
                cpu_ops.write(kc, vc, key, value, slots)
                return
            if key.stride(-1) != 1:
                key = key.contiguous()
            if value.stride(-1) != 1:
                value = value.contiguous()
            device_ops.write(self._launcher, self.dtype_name, kc, vc, key, value, slots, first_slot)

    def gather(
        self, layer: int, block_tables: Any, cu_seq_lens: Any, *, group: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Paged to contiguous: ``(key, value)``, each ``[cu_seq_lens[-1], num_kv_heads,
        head_dim]``; rows ``cu_seq_lens[i] .. cu_seq_lens[i+1]`` are sequence i's first
        tokens, read through ``block_tables[i]`` (int32 ``[batch, max_blocks]``, padding
        beyond a sequence's blocks is never read). A device ``cu_seq_lens`` costs one
        synchronisation (its last entry sizes the output); pass it on the host to avoid it.
        With groups, ``group`` must be the layer's group; a full-attention layer's tables
        must not hold the null block where they are read, and the rows of a null entry
        (positions a window or chunk released) are block 0's: zeros, as nothing writes it."""
        layer = self._check_layer(layer)
        self.layout.check_group_arg(layer, group)
        self._kv_layer(layer)
        import torch

        cu = _host_array(cu_seq_lens, "cu_seq_lens")
        bt = _host_array(block_tables, "block_tables")
        if cu is not None:
            id_checks.check_cu_seq_lens(cu)
            batch = cu.size - 1
            self._check_tables(bt, block_tables, np.diff(cu), batch, "sequence lengths")
            if bt is not None and self.null_block and self.layout.attention_limits(layer) == (0, 0):
                what = f"gather of {self.layout.describe(layer)}"
                PG.check_attended_not_null(bt, np.diff(cu), self.block_size, 0, 0, what)
            total = int(cu[-1])
        else:
            if cu_seq_lens.dim() != 1 or cu_seq_lens.shape[0] < 1:
                raise InvalidArgumentError("cu_seq_lens must be 1-D with at least one entry")
            batch = int(cu_seq_lens.shape[0]) - 1
            self._check_tables(bt, block_tables, None, batch, "sequence lengths")
            total = int(cu_seq_lens[-1].item())
            if total < 0:
                raise InvalidArgumentError(f"cu_seq_lens ends at {total}, below 0")
        if total >= 2**31:
            raise InvalidArgumentError("too many tokens for one gather")
        if batch == 0:
            empty = torch.empty((0, self.num_kv_heads, self.head_dim), dtype=self.dtype)
            return empty.to(self.device), empty.to(self.device)
        with self._on_device():
            tables = self._ids(bt, block_tables, torch.int32)
            cus = self._ids(cu, cu_seq_lens, torch.int32)
            kc, vc = self.key(layer), self.value(layer)
            if self._launcher is None:
                return cpu_ops.gather(kc, vc, tables, cus)
            return device_ops.gather(self._launcher, self.dtype_name, kc, vc, tables, cus, total)

    def _check_pairs(self, a: np.ndarray | None, src_blocks: int, dst_blocks: int) -> None:
        if a is None:
            return
        if a.ndim != 2 or a.shape[1] != 2:
            if a.size == 0:
                return
            raise InvalidArgumentError("pairs must have shape (k, 2)")
        if a.size == 0:
            return
        src, dst = a[:, 0], a[:, 1]
        if src.min() < 0 or src.max() >= src_blocks or dst.min() < 0 or dst.max() >= dst_blocks:
            raise InvalidArgumentError("pairs hold a block id out of range")
        if np.unique(dst).size != dst.size:
            raise InvalidArgumentError("pairs copy into the same block twice")

    def copy_blocks(self, pairs: Any) -> None:
        """Copy-on-write: for each ``(src, dst)`` (the manager's ``append``/``append_batch``
        pairs, ``(k, 2)``), block dst of every layer, K and V, becomes a copy of block src.
        One launch; no synchronisation."""
        a = _host_array(pairs, "pairs")
        self._check_pairs(a, self.num_blocks, self.num_blocks)
        if a is not None:
            if a.size == 0:
                return
            a = a.reshape(-1, 2)
            if np.intersect1d(a[:, 0], a[:, 1]).size:
                raise InvalidArgumentError("a block is both a source and a destination")
            if self.null_block and (a == 0).any():
                raise InvalidArgumentError("pairs hold the null block 0, which is never copied")
        import torch

        with self._on_device():
            p = self._ids(a, pairs, torch.int32).reshape(-1, 2)
            if self._launcher is None:
                cpu_ops.copy_blocks(self.buffer, p)
                return
            device_ops.copy_blocks(self._launcher, self.buffer, self.buffer, p)


def _same_layout(a: KVCachePool, b: KVCachePool) -> bool:
    def key(p: KVCachePool) -> tuple[Any, ...]:
        lay = p.layout
        groups = (lay.groups, lay.layer_group, dict(lay.state_shapes), p.state_dtype_name)
        return (p.num_layers, p.block_size, p.num_kv_heads, p.head_dim, p.dtype, groups)

    return key(a) == key(b)


def swap_blocks(src_pool: KVCachePool, dst_pool: KVCachePool, pairs: Any) -> None:
    """Copy block ``src`` of ``src_pool`` to block ``dst`` of ``dst_pool`` for each pair
    ``(src, dst)`` (the manager's ``swap_out`` pairs ``(gpu, cpu)`` with (gpu pool, cpu
    pool), its ``swap_in`` pairs ``(cpu, gpu)`` with (cpu pool, gpu pool)), every layer, K and
    V. Between a GPU pool and a pinned CPU pool this is one kernel launch on the current
    stream that reads or writes the pinned memory through the device's mapping of it; the
    caller must not touch the CPU blocks until the stream has passed it (swap-in) or use
    the GPU blocks again before the copy has read them (swap-out: stream order does it)."""
    if not _same_layout(src_pool, dst_pool):
        raise InvalidArgumentError("swap between pools of different layouts")
    a = _host_array(pairs, "pairs")
    src_pool._check_pairs(a, src_pool.num_blocks, dst_pool.num_blocks)
    if a is not None and a.size == 0:
        return
    if a is not None:
        for col, pl in enumerate((src_pool, dst_pool)):
            if pl.null_block and (a.reshape(-1, 2)[:, col] == 0).any():
                raise InvalidArgumentError("pairs hold the null block 0, which is never swapped")
    gpu = next((p for p in (src_pool, dst_pool) if p.device.type == "cuda"), None)
    home = gpu or src_pool
    if gpu is not None:
        for pl in (src_pool, dst_pool):
            if pl.device.type == "cpu" and not pl.buffer.is_pinned():
                raise InvalidArgumentError("the CPU pool of a GPU swap must be pinned")
            if pl.device.type == "cuda" and pl.device != gpu.device:
                raise InvalidArgumentError("swap between two GPUs is not supported")
    import torch

    host_pairs = a.reshape(-1, 2) if a is not None else None
    with home._on_device():
        p = home._ids(host_pairs, pairs, torch.int32).reshape(-1, 2)
        launcher = home._launcher
        if launcher is None:
            cpu_ops.swap(src_pool.buffer, dst_pool.buffer, p)
            return
        device_ops.copy_blocks(launcher, src_pool.buffer, dst_pool.buffer, p)
