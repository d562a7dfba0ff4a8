"""Validation of the ids a pool operation takes (block tables, sequence lengths,
``cu_seq_lens``, ``max_seq_len``) before anything is launched.

Ids on the host (numpy arrays, lists, CPU tensors) are checked value by value. Ids that are
already device tensors are checked only for what their metadata tells without a
synchronisation (dtype, rank, shape, and the lengths a host-side length array implies for
a device table); their values are guarded inside the kernels instead, so that a bad id or
length never reads outside the pool. Every failure raises
:class:`pagedkv.InvalidArgumentError` naming the argument, and nothing has run.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from pagedkv.errors import InvalidArgumentError


def host_array(x: Any, what: str) -> np.ndarray | None:
    """The ids as a numpy array when they are on the host (numpy, list, CPU tensor), else
    None (a device tensor: its values are not read, to avoid a synchronisation)."""
    import torch

    if isinstance(x, torch.Tensor):
        if x.device.type != "cpu":
            check_device_ids(x, what)
            return None
        x = x.numpy()
    a = np.asarray(x)
    if a.dtype.kind not in "iu" and a.size:
        raise InvalidArgumentError(f"{what} must hold integers, got dtype {a.dtype}")
    return a


def check_device_ids(t: Any, what: str) -> None:
    """A device tensor of ids must at least hold integers (its values stay on the device)."""
    if t.dtype.is_floating_point or t.dtype.is_complex or str(t.dtype) == "torch.bool":
        raise InvalidArgumentError(f"{what} must hold integers, got dtype {t.dtype}")


def ids_shape(host: np.ndarray | None, x: Any) -> tuple[int, ...]:
    """The shape of ids given either as a host array or as a device tensor."""
    return tuple(host.shape) if host is not None else tuple(x.shape)


def check_table_shape(shape: tuple[int, ...], batch: int) -> int:
    """A block table is ``[batch, max_blocks]``; returns max_blocks."""
    if len(shape) != 2 or shape[0] != batch:
        raise InvalidArgumentError(
            f"block_tables must be [{batch}, max_blocks], got shape {list(shape)}"
        )
    return int(shape[1])


def check_lengths_fit(lens: np.ndarray, max_blocks: int, block_size: int, what: str) -> None:
    """Each length must be in 0 .. max_blocks * block_size: a longer sequence would read
    past the end of its table row."""
    if not lens.size:
        return
    cap = max_blocks * block_size
    bad = np.flatnonzero((lens < 0) | (lens > cap))
    if bad.size:
        i = int(bad[0])
        raise InvalidArgumentError(
            f"{what}[{i}] = {int(lens[i])} is outside 0..{cap} "
            f"(block_tables hold {max_blocks} blocks of {block_size} tokens)"
        )


def check_used_ids(tables: np.ndarray, lens: np.ndarray, block_size: int, num_blocks: int) -> None:
    """Every block a sequence of length lens[i] uses must be an id of the pool; padding
    beyond a sequence's blocks is never read, so it is not checked."""
    used = np.arange(tables.shape[1])[None, :] < -(-lens[:, None] // block_size)
    ids = tables[used]
    if ids.size and (ids.min() < 0 or ids.max() >= num_blocks):
        raise InvalidArgumentError(f"block_tables hold ids outside 0..{num_blocks - 1}")


def check_cu_seq_lens(cu: np.ndarray) -> None:
    if cu.ndim != 1 or cu.size < 1 or cu[0] != 0 or np.any(np.diff(cu) < 0):
        raise InvalidArgumentError("cu_seq_lens must be 1-D, start at 0 and not decrease")


def check_max_seq_len(max_seq_len: Any, lens: np.ndarray | None) -> int | None:
    """``max_seq_len`` bounds the work of decode attention: a sequence longer than it would
    be cut short, so that is an error, never a silent truncation."""
    if max_seq_len is None:
        return None
    if isinstance(max_seq_len, bool) or not isinstance(max_seq_len, int | np.integer):
        raise InvalidArgumentError(f"max_seq_len must be an integer, got {max_seq_len!r}")
    if max_seq_len < 0:
        raise InvalidArgumentError(f"max_seq_len must not be negative, got {max_seq_len}")
    if lens is not None and lens.size and int(lens.max()) > max_seq_len:
        i = int(np.argmax(lens))
        raise InvalidArgumentError(
            f"max_seq_len {max_seq_len} is shorter than seq_lens[{i}] = {int(lens[i])}"
        )
    return int(max_seq_len)
