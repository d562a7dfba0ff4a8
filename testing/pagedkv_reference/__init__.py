"""The pure-Python reference models of pagedkv: test oracles, not part of the wheel.

They implement docs/semantics.md with plain lists and dicts, so that the tests can drive them
next to the Rust `pagedkv.BlockManager` and compare every answer, and the benchmarks can show
the Rust core's speed-up over them. `pip install pagedkv` does not install this package; a
source checkout puts it on the path for pytest (`pythonpath` in pyproject.toml) and for the
benchmarks (benches/conftest.py).

- `manager`: `ReferenceBlockManager` (one block table per sequence) and `hash_blocks`
- `groups`, `groups_audit`: the same manager with KV-cache groups, and its invariant audit
- `hybrid_hit`: the prefix hit of a manager with groups, as pure functions
- `running`: `ReferenceRunningBatch`, the model of `pagedkv.RunningBatch`
- `eviction`: the eviction policies, retention, pins and tenant quotas of issue 25, plainly
  (docs/eviction.md); the managers evict through one of its policies (`eviction=`)
"""

from __future__ import annotations

from pagedkv_reference.manager import ReferenceBlockManager, hash_blocks

__all__ = ["ReferenceBlockManager", "hash_blocks"]
