"""What `import pagedkv` offers: every public name importable, and nothing else listed."""

from __future__ import annotations

import pagedkv
from pagedkv import TenantStats
from pagedkv.stats import TenantStats as Defined


def test_tenant_stats_is_exported() -> None:
    assert TenantStats is Defined
    assert "TenantStats" in pagedkv.__all__
    m = pagedkv.BlockManager(8, 2, tenants=True)
    m.allocate(1, [1, 2, 3], cache_salt="a")
    assert all(isinstance(t, TenantStats) for t in m.tenant_stats())


def test_dir_lists_the_public_names_only() -> None:
    names = dir(pagedkv)
    assert "TYPE_CHECKING" not in names and "annotations" not in names
    assert names == sorted(pagedkv.__all__)
    for name in names:
        if name not in ("KVCachePool", "paged_decode_attention", "swap_blocks"):  # need torch
            assert getattr(pagedkv, name) is not None
