"""`PagedKVCacheBlocks`: vLLM's `KVCacheBlocks` holding block ids, not block objects.

vLLM's scheduler only asks an allocation result for its ids (`get_block_ids`), adds two
results, or takes an empty one. Holding the ids as plain lists keeps per-block Python objects
off the per-step path; `blocks` builds vLLM `KVCacheBlock` views only when something (a test,
a connector) reads it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.kv_cache_utils import KVCacheBlock

if TYPE_CHECKING:
    from collections.abc import Callable


class PagedKVCacheBlocks(KVCacheBlocks):
    """Per-group block-id lists (vLLM's ids: block 0 is vLLM's null block)."""

    # Not a dataclass field: vLLM's `blocks` field is served by the property below.
    __slots__ = ("_ids", "_views")

    def __init__(
        self,
        ids: tuple[list[int], ...],
        views: Callable[[], tuple[list[KVCacheBlock], ...]] | None = None,
    ) -> None:
        # vLLM's dataclass __init__ would store `blocks`; the ids replace it.
        self._ids = ids
        # Builds the vLLM block objects (the manager's, with their hashes) on demand.
        self._views = views

    @property
    def blocks(self) -> tuple[Sequence[KVCacheBlock], ...]:
        if self._views is not None:
            return self._views()
        return tuple(
            [KVCacheBlock(block_id=b, is_null=b == 0) for b in group] for group in self._ids
        )

    @property
    def ids(self) -> tuple[list[int], ...]:
        return self._ids

    def __add__(self, other: KVCacheBlocks) -> KVCacheBlocks:
        theirs = other.get_block_ids()
        return PagedKVCacheBlocks(tuple(a + b for a, b in zip(self._ids, theirs, strict=True)))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, KVCacheBlocks):
            return bool(self.get_block_ids() == other.get_block_ids())
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"PagedKVCacheBlocks({self._ids!r})"

    def get_block_ids(
        self, allow_none: bool = False, *, group_ids: Sequence[int] | None = None
    ) -> tuple[list[int], ...] | None:
        groups = self._ids if group_ids is None else tuple(self._ids[g] for g in group_ids)
        if allow_none and all(not g for g in groups):
            return None
        return tuple(list(g) for g in groups)

    def get_unhashed_block_ids(self) -> list[int]:
        assert len(self._ids) == 1, "Only one group is supported"
        return self.get_unhashed_block_ids_all_groups()[0]

    def get_unhashed_block_ids_all_groups(self) -> list[list[int]]:
        return [
            [b.block_id for b in group if b.block_hash is None and not b.is_null]
            for group in self.blocks
        ]

    def new_empty(self) -> KVCacheBlocks:
        return PagedKVCacheBlocks(tuple([] for _ in self._ids))


def ids_of(blocks: Any) -> tuple[list[int], ...]:
    """The per-group ids of any `KVCacheBlocks` (ours without building block objects)."""
    if isinstance(blocks, PagedKVCacheBlocks):
        return blocks.ids
    return tuple([b.block_id for b in group] for group in blocks.blocks)


__all__ = ["PagedKVCacheBlocks", "ids_of"]
