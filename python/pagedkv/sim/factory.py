"""The one place the simulator builds a block manager: Rust or reference, with or without groups.

Both managers take the same arguments (`docs/semantics.md`): `(num_blocks, block_size,
**config.constructor_kwargs())`, plus `groups=[KVCacheGroup, ...]` for a hybrid model
("KV-cache groups"). Without groups the call is exactly the one the simulator always made.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pagedkv.config import BlockManagerConfig
from pagedkv.groups import KVCacheGroup
from pagedkv.sim.scheduler import ManagerLike


def make_manager(
    config: BlockManagerConfig,
    *,
    reference: bool = False,
    groups: Sequence[KVCacheGroup] | None = None,
) -> ManagerLike:
    """A manager for `config`; `reference` picks the pure-Python one; `groups` (None: none)
    makes a manager with one block table per group."""
    cls: Any
    if reference:
        from pagedkv.reference import ReferenceBlockManager

        cls = ReferenceBlockManager
    else:
        from pagedkv.manager import BlockManager

        if groups is None:
            return BlockManager.from_config(config)
        cls = BlockManager
    kwargs = config.constructor_kwargs()
    if groups is not None:
        kwargs["groups"] = list(groups)
    manager: ManagerLike = cls(config.num_blocks, config.block_size, **kwargs)
    return manager


__all__ = ["make_manager"]
