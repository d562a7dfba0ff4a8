"""Where each layer of a pool with KV-cache groups keeps its pages, and the checks that a
call passes a layer its own group's tables (docs/kernels.md, "Pools with groups").

A block id belongs to one group at a time (docs/semantics.md, KV-cache groups), so the
layers of different groups can share memory, as in vLLM: the j-th layer of every group
uses buffer row j, and a block's page in row j holds whichever group owns the block now.
The pool has ``max(layers per group)`` rows instead of one per layer. When some group is
not full attention, block 0 is the null block, as in the manager
(``pagedkv.groups.has_null_block``): it sits in every group's tables where the group needs
nothing, nothing writes it, and attention never reads it. With full-attention groups only
there is none, and block 0 is a block like any other.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from pagedkv.errors import InvalidArgumentError
from pagedkv.groups import KVCacheGroup, check_groups


@dataclass(frozen=True)
class PoolLayout:
    """The layer -> (group, buffer row) map of a pool; ``groups`` is None for a pool
    without groups (one row per layer, every layer in the implicit group 0)."""

    groups: tuple[KVCacheGroup, ...] | None
    layer_group: tuple[int, ...]
    layer_row: tuple[int, ...]
    num_rows: int
    #: The state shape of each state group, by group index.
    state_shapes: Mapping[int, tuple[int, ...]]

    def describe(self, layer: int) -> str:
        """``layer 3 (group 1, sliding_window 32)``, for error messages."""
        if self.groups is None:
            return f"layer {layer}"
        g = self.layer_group[layer]
        grp = self.groups[g]
        extra = f" {grp.window}" if grp.window else f" {grp.chunk}" if grp.chunk else ""
        return f"layer {layer} (group {g}, {grp.kind}{extra})"

    def attention_limits(self, layer: int) -> tuple[int, int]:
        """(window, chunk) of the layer's decode attention, 0 for no limit."""
        if self.groups is None:
            return 0, 0
        grp = self.groups[self.layer_group[layer]]
        return grp.window or 0, grp.chunk or 0

    def is_state(self, layer: int) -> bool:
        return self.groups is not None and self.groups[self.layer_group[layer]].kind == "state"

    def check_group_arg(self, layer: int, group: object) -> None:
        """The caller says whose tables or slots it passes; they must be the layer's group's
        (a pool with groups cannot tell one group's table from another's by its values)."""
        if group is not None:
            if isinstance(group, bool) or not isinstance(group, int | np.integer):
                raise InvalidArgumentError(f"group must be an int, got {group!r}")
            group = int(group)
        if self.groups is None:
            if group not in (None, 0):
                raise InvalidArgumentError(f"group={group}: this pool has no groups (only 0)")
            return
        if group is None:
            raise InvalidArgumentError(
                f"this pool has groups: pass group= (the group whose tables or slots these "
                f"are); {self.describe(layer)} needs group={self.layer_group[layer]}"
            )
        if group != self.layer_group[layer]:
            raise InvalidArgumentError(
                f"{self.describe(layer)} is given group {group}'s tables or slots"
            )


def make_layout(
    num_layers: int,
    block_size: int,
    groups: Any,
    layer_groups: Any,
    state_shape: Any,
) -> PoolLayout:
    """The validated layout; every mistake raises InvalidArgumentError naming it."""
    if groups is None:
        if layer_groups is not None:
            raise InvalidArgumentError("layer_groups= needs groups=")
        if state_shape is not None:
            raise InvalidArgumentError("state_shape= needs groups= with a state group")
        rows = tuple(range(num_layers))
        return PoolLayout(None, (0,) * num_layers, rows, num_layers, {})
    gs = check_groups(groups, block_size)
    if layer_groups is None:
        raise InvalidArgumentError("groups= needs layer_groups= (the group of every layer)")
    lg = _layer_groups(layer_groups, num_layers, len(gs))
    counts = [0] * len(gs)
    rows_list = []
    for g in lg:  # the j-th layer of a group goes to row j
        rows_list.append(counts[g])
        counts[g] += 1
    for g, grp in enumerate(gs):
        if counts[g] != grp.num_layers:
            raise InvalidArgumentError(
                f"layer_groups maps {counts[g]} layers to group {g} but groups[{g}].num_layers "
                f"is {grp.num_layers}"
            )
    shapes = _state_shapes(state_shape, [g for g, grp in enumerate(gs) if grp.kind == "state"])
    return PoolLayout(gs, lg, tuple(rows_list), max(counts), shapes)


def _layer_groups(layer_groups: Any, num_layers: int, num_groups: int) -> tuple[int, ...]:
    if isinstance(layer_groups, (str, bytes)) or not isinstance(layer_groups, Sequence):
        raise InvalidArgumentError("layer_groups must be a list of group indices, one a layer")
    if len(layer_groups) != num_layers:
        raise InvalidArgumentError(
            f"layer_groups has {len(layer_groups)} entries for {num_layers} layers"
        )
    out = []
    for i, g in enumerate(layer_groups):
        if isinstance(g, bool) or not isinstance(g, int | np.integer):
            raise InvalidArgumentError(f"layer_groups[{i}] must be an int, got {g!r}")
        if not 0 <= g < num_groups:
            raise InvalidArgumentError(
                f"layer_groups[{i}] = {g} is not a group index (0..{num_groups - 1})"
            )
        out.append(int(g))
    return tuple(out)


def _shape(value: Any, what: str) -> tuple[int, ...]:
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence) or not value:
        raise InvalidArgumentError(f"{what} must be a non-empty tuple of sizes, got {value!r}")
    for d in value:
        if isinstance(d, bool) or not isinstance(d, int | np.integer) or d < 1:
            raise InvalidArgumentError(f"{what} must hold positive ints, got {value!r}")
    return tuple(int(d) for d in value)


def _state_shapes(state_shape: Any, state_groups: list[int]) -> dict[int, tuple[int, ...]]:
    """One shape for every state group (a tuple), or one per state group (a mapping)."""
    if not state_groups:
        if state_shape is not None:
            raise InvalidArgumentError("state_shape= given but no group is a state group")
        return {}
    if state_shape is None:
        raise InvalidArgumentError(
            f"groups {state_groups} are state groups: pass state_shape= (one state per block)"
        )
    if isinstance(state_shape, Mapping):
        if sorted(state_shape) != state_groups:
            raise InvalidArgumentError(
                f"state_shape has entries for groups {sorted(state_shape)}, the state groups "
                f"are {state_groups}"
            )
        return {g: _shape(state_shape[g], f"state_shape[{g}]") for g in state_groups}
    shape = _shape(state_shape, "state_shape")
    return dict.fromkeys(state_groups, shape)


def check_state_fits(layout: PoolLayout, half_page_bytes: int, state_itemsize: int) -> None:
    """A state lives in the K half of its block's page (the rows are shared with K/V
    layers, so it cannot take more room than K)."""
    for g, shape in layout.state_shapes.items():
        need = math.prod(shape) * state_itemsize
        if need > half_page_bytes:
            raise InvalidArgumentError(
                f"state_shape {shape} of group {g} takes {need} bytes, more than the "
                f"{half_page_bytes} bytes of a block's K page (raise block_size)"
            )
        if half_page_bytes % state_itemsize:
            raise InvalidArgumentError(
                f"a block's K page ({half_page_bytes} bytes) is not a whole number of "
                f"state elements of {state_itemsize} bytes"
            )


# ---- the null block in host ids -----------------------------------------------------------


def check_attended_not_null(
    tables: np.ndarray, lens: np.ndarray, block_size: int, window: int, chunk: int, what: str
) -> None:
    """Every entry a query reads must be a real block, not the null block 0: a 0 there
    means another group's tables (whose window released it), or a manager that released
    a block the query still needs. Entries before the window are not read and may be 0."""
    if not lens.size:
        return
    n = lens.astype(np.int64)
    lo = np.zeros_like(n)
    if window > 0:
        lo = np.maximum(lo, n - window)
    if chunk > 0:
        lo = np.maximum(lo, np.maximum(n - 1, 0) // chunk * chunk)
    cols = np.arange(tables.shape[1])[None, :]
    read = (n[:, None] > 0) & (cols >= lo[:, None] // block_size)
    read &= cols < -(-n[:, None] // block_size)
    bad = np.argwhere(read & (tables == 0))
    if bad.size:
        i, j = (int(x) for x in bad[0])
        raise InvalidArgumentError(
            f"block_tables[{i}, {j}] is the null block 0 but {what} reads it (positions "
            f"{j * block_size}..{(j + 1) * block_size - 1} of a sequence of {int(n[i])}): "
            "these are not this layer's group's tables, or its window was released"
        )


__all__ = [
    "PoolLayout",
    "check_attended_not_null",
    "check_state_fits",
    "make_layout",
]
