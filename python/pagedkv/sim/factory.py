"""The one place the simulator builds a block manager: Rust or reference, with or without groups.

Both managers take the same arguments (`docs/semantics.md`): `(num_blocks, block_size,
**config.constructor_kwargs())`, plus `groups=[KVCacheGroup, ...]` for a hybrid model
("KV-cache groups"). Without groups the call is exactly the one the simulator always made.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path
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
        cls = _reference_class()
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


def _reference_class() -> Any:
    """`ReferenceBlockManager`, from the test-support package `pagedkv_reference`: it is not
    in the wheel, so look for it next to this package in a source checkout."""
    try:
        from pagedkv_reference import ReferenceBlockManager
    except ModuleNotFoundError as exc:
        if exc.name != "pagedkv_reference":
            raise
        testing = Path(__file__).resolve().parents[3] / "testing"
        if not (testing / "pagedkv_reference" / "__init__.py").is_file():
            raise ImportError(
                "--reference needs the pure-Python reference model, which the wheel does not "
                "install: add the testing/ folder of a pagedkv source checkout to PYTHONPATH"
            ) from None
        sys.path.append(str(testing))
        from pagedkv_reference import ReferenceBlockManager
    return ReferenceBlockManager


__all__ = ["make_manager"]
