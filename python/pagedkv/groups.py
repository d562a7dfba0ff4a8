"""`KVCacheGroup`: one kind of layer of a hybrid model (docs/semantics.md, KV-cache groups)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal, Protocol, TypeAlias

from pagedkv.errors import InvalidArgumentError

GroupKind: TypeAlias = Literal["full", "sliding_window", "chunked_local", "state"]
KINDS: tuple[GroupKind, ...] = ("full", "sliding_window", "chunked_local", "state")
# The most groups one manager takes (keys and events carry the index in a byte).
MAX_GROUPS = 64


def _positive_int(value: object, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidArgumentError(f"{what} must be an int, got {type(value).__name__}")
    if value < 1:
        raise InvalidArgumentError(f"{what} must be >= 1, got {value}")
    return value


@dataclass(frozen=True, slots=True)
class KVCacheGroup:
    """Layers that share one block table: full attention, a sliding window of `window`
    tokens, chunked local attention over `chunk`-token chunks, or a recurrent state.

    `block_size`, when given, must equal the manager's; `num_layers` sizes pools and the
    simulator's memory figures and does not change the bookkeeping.
    """

    kind: GroupKind
    window: int | None = None
    chunk: int | None = None
    block_size: int | None = None
    num_layers: int = 1

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise InvalidArgumentError(f"unknown group kind {self.kind!r}; expected one of {KINDS}")
        if self.kind == "sliding_window":
            if self.window is None:
                raise InvalidArgumentError("a sliding_window group needs window=")
            _positive_int(self.window, "window")
        elif self.window is not None:
            raise InvalidArgumentError(
                f"window= is only for sliding_window groups, not {self.kind}"
            )
        if self.kind == "chunked_local":
            if self.chunk is None:
                raise InvalidArgumentError("a chunked_local group needs chunk=")
            _positive_int(self.chunk, "chunk")
        elif self.chunk is not None:
            raise InvalidArgumentError(f"chunk= is only for chunked_local groups, not {self.kind}")
        if self.block_size is not None:
            _positive_int(self.block_size, "block_size")
        _positive_int(self.num_layers, "num_layers")

    def skipped_tokens(self, position: int) -> int:
        """Leading tokens this group no longer needs when the next token is at `position`."""
        if self.kind == "sliding_window":
            assert self.window is not None
            return max(0, position - self.window + 1)
        if self.kind == "chunked_local":
            assert self.chunk is not None
            return position // self.chunk * self.chunk
        if self.kind == "state":
            return max(0, position - 1)
        return 0


class HasKind(Protocol):
    """A group, or anything that names its kind (a manager's `GroupStats`)."""

    @property
    def kind(self) -> str: ...


def has_null_block(groups: Iterable[HasKind] | None) -> bool:
    """Whether block 0 is the null block of a manager (and of its pool) with these groups:
    exactly when some group is not full attention, so that a table entry can stand for a
    block the group no longer needs. Without groups, or with full-attention groups only,
    block 0 is an ordinary block. The one rule the manager (`BlockManager.groups`), the pool,
    the tiers and the kernels' checks share (docs/semantics.md, "No null block")."""
    return groups is not None and any(g.kind != "full" for g in groups)


def check_groups(groups: object, block_size: int) -> tuple[KVCacheGroup, ...]:
    """The validated group list of a manager with this block size."""
    if isinstance(groups, (str, bytes)) or not hasattr(groups, "__iter__"):
        raise InvalidArgumentError("groups must be a list of KVCacheGroup")
    out = tuple(groups)
    if not out:
        raise InvalidArgumentError("groups must not be empty")
    if len(out) > MAX_GROUPS:
        raise InvalidArgumentError(f"at most {MAX_GROUPS} groups, got {len(out)}")
    for i, g in enumerate(out):
        if not isinstance(g, KVCacheGroup):
            raise InvalidArgumentError(
                f"groups[{i}] must be a KVCacheGroup, got {type(g).__name__}"
            )
        if g.block_size is not None and g.block_size != block_size:
            raise InvalidArgumentError(
                f"groups[{i}] has block_size {g.block_size} but the manager's is {block_size}: "
                "mixed block sizes are not supported (one page size for all groups)"
            )
        if g.kind == "sliding_window" and g.window is not None and g.window < block_size:
            raise InvalidArgumentError(
                f"groups[{i}]: window {g.window} is smaller than a block ({block_size} tokens)"
            )
        if g.kind == "chunked_local" and g.chunk is not None and g.chunk % block_size:
            raise InvalidArgumentError(
                f"groups[{i}]: chunk {g.chunk} is not a multiple of the block size {block_size}"
            )
    return out


__all__ = ["KINDS", "MAX_GROUPS", "GroupKind", "KVCacheGroup", "check_groups", "has_null_block"]
