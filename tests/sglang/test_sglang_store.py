"""PagedKVStore in SGLang's hands, host tiers: built by SGLang's StorageBackendFactory from a
`dynamic` extra config, pages moved out of and into SGLang's own MHA host pool, bytes checked.
"""

from __future__ import annotations

import pytest

pytest.importorskip("sglang", reason="SGLang 0.5.23 is not installed")

import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    PoolHitPolicy,
    PoolName,
    PoolTransfer,
)

from pagedkv.sglang import PagedKVStore
from sglang_objects import (
    dynamic_extra,
    fill_pages,
    host_pool,
    indices,
    keys,
    make_store,
    mla_pool,
    page_of,
    storage_config,
)

HOST = {"host_bytes": 1 << 20}
LAYOUTS = ["layer_first", "page_first", "page_first_direct", "page_head"]


def test_factory_loads_the_store_by_module_path():
    pool = host_pool()
    store = make_store(pool, dynamic_extra(**HOST))
    assert type(store) is PagedKVStore
    assert isinstance(store, HiCacheStorage)
    assert store.mem_pool_host is pool


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("codec", ["raw", "shuffle+lz4"])
def test_v1_round_trip_into_another_pool(layout, codec):
    src, dst = host_pool(layout=layout), host_pool(layout=layout)
    fill_pages(src, seed=1)
    extra = dynamic_extra(host_bytes=1 << 20, codec=codec)
    store = make_store(src, extra)
    ks = keys(5)
    assert store.batch_set_v1(ks, indices([3, 7, 8, 1, 20], src.page_size)) == [True] * 5
    assert store.batch_exists(ks) == 5
    # Into other pages of a second pool registered with the same store.
    store.register_mem_pool_host(dst)
    assert store.batch_get_v1(ks, indices([0, 1, 2, 3, 4], dst.page_size)) == [True] * 5
    for i, p in enumerate([3, 7, 8, 1, 20]):
        assert page_of(dst, i) == page_of(src, p)
    assert page_of(dst, 5) == bytes(len(page_of(dst, 5)))  # untouched


@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct"])
def test_mla_pages_round_trip_through_the_pools_own_calls(layout):
    """SGLang's MLA host pool: not the MHA fast path, its own page calls."""
    src, dst = mla_pool(layout=layout), mla_pool(layout=layout)
    fill_pages(src, seed=8)
    store = make_store(src, dynamic_extra(**HOST), is_mla=True)
    ks = keys(4)
    assert store.batch_set_v1(ks, indices([9, 2, 4, 6], src.page_size)) == [True] * 4
    store.register_mem_pool_host(dst)
    assert store.batch_get_v1(ks, indices([0, 1, 2, 3], dst.page_size)) == [True] * 4
    assert [page_of(dst, p) for p in range(4)] == [page_of(src, p) for p in (9, 2, 4, 6)]
    assert page_of(dst, 4) == bytes(len(page_of(dst, 4)))


def test_the_compressed_tier_compresses_and_restores_exactly():
    pool = host_pool(layers=4, head_dim=64)
    # bf16 KV of a small range: the shuffled high bytes compress.
    pool.kv_buffer.copy_((torch.rand(pool.kv_buffer.shape) * 0.1).to(torch.bfloat16))
    store = make_store(pool, dynamic_extra(host_bytes=1 << 22, codec="shuffle+lz4"))
    ks = keys(8)
    assert all(store.batch_set_v1(ks, indices(list(range(8)), pool.page_size)))
    (st,) = store.get_stats().values()
    assert st.compression_ratio > 1.2
    before = [page_of(pool, p) for p in range(8)]
    pool.kv_buffer.zero_()
    assert store.batch_get_v1(ks, indices(list(range(8)), pool.page_size)) == [True] * 8
    assert [page_of(pool, p) for p in range(8)] == before


def test_batch_exists_counts_the_leading_keys_present():
    pool = host_pool()
    fill_pages(pool, seed=2)
    store = make_store(pool, dynamic_extra(**HOST))
    ks = keys(6)
    store.batch_set_v1([ks[0], ks[1], ks[3]], indices([0, 1, 3], pool.page_size))
    assert store.batch_exists(ks) == 2
    assert store.batch_exists(ks[3:]) == 1
    assert store.batch_exists(ks[2:]) == 0
    assert store.batch_exists([]) == 0
    assert store.exists(ks[3]) and not store.exists(ks[2])


def test_a_get_stops_at_the_first_miss_and_writes_nothing_for_it():
    pool = host_pool()
    fill_pages(pool, seed=3)
    store = make_store(pool, dynamic_extra(**HOST))
    ks = keys(4)
    store.batch_set_v1([ks[0], ks[2], ks[3]], indices([0, 2, 3], pool.page_size))
    want0 = page_of(pool, 0)
    pool.kv_buffer.zero_()
    got = store.batch_get_v1(ks, indices([4, 5, 6, 7], pool.page_size))
    assert got == [True, False, False, False]
    assert page_of(pool, 4) == want0
    assert page_of(pool, 6) == page_of(pool, 7) == bytes(len(want0))


def test_tensor_calls_share_pages_with_the_zero_copy_ones():
    """SGLang's generic path (no interface_v1): batch_set of get_data_page tensors and
    batch_get into get_dummy_flat_data_page targets, then set_from_flat_data_page."""
    pool = host_pool(layout="layer_first")
    fill_pages(pool, seed=4)
    extra = dynamic_extra(**HOST)
    del extra["interface_v1"]
    store = make_store(pool, extra)
    ks = keys(3)
    pages = [pool.get_data_page(p * pool.page_size) for p in (2, 5, 9)]
    assert store.batch_set(ks, pages)
    targets = [pool.get_dummy_flat_data_page() for _ in ks]
    got = store.batch_get(ks, targets)
    assert [g is t for g, t in zip(got, targets, strict=True)] == [True] * 3
    for g, p in zip(got, (2, 5, 9), strict=True):
        assert bytes(g.view(torch.uint8).numpy()) == page_of(pool, p)
    # The same keys read through the zero-copy call.
    assert store.batch_get_v1(ks, indices([20, 21, 22], pool.page_size)) == [True] * 3
    assert page_of(pool, 21) == page_of(pool, 5)
    assert store.get(keys(1, "absent")[0], pool.get_dummy_flat_data_page()) is None
    assert store.set(ks[0], pool.get_data_page(0)) is True


def test_bad_input_raises_and_stores_nothing():
    pool = host_pool()
    store = make_store(pool, dynamic_extra(**HOST))
    ks = keys(2)
    with pytest.raises(ValueError, match="host_indices holds"):
        store.batch_set_v1(ks, indices([0], pool.page_size))
    with pytest.raises(ValueError, match="host_indices holds"):
        store.batch_get_v1(ks, indices([0, 1, 2], pool.page_size))
    with pytest.raises(TypeError, match="strings"):
        store.batch_exists([b"not a str"])
    with pytest.raises(ValueError, match="bytes"):
        store.set(ks[0], torch.zeros(3, dtype=torch.bfloat16))
    assert store.batch_exists(ks) == 0


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        ({}, "needs a tier"),
        ({"host_bytes": 1 << 20, "hots_bytes": 1}, "unknown PagedKVStore option"),
        ({"host_bytes": -1}, "host_bytes"),
        ({"host_bytes": 1 << 20, "codec": "zip"}, "codec"),
        ({"redis_url": "redis://127.0.0.1:1", "secret_env": "PAGEDKV_TEST_NO_SUCH_VAR"}, "secret"),
        ({"host_bytes": 1 << 20, "timeout": 0}, "timeout"),
    ],
)
def test_bad_options_are_refused_by_name(extra, match):
    with pytest.raises(ValueError, match=match):
        make_store(host_pool(), dynamic_extra(**extra))


def test_host_bytes_accepts_units():
    store = make_store(host_pool(), dynamic_extra(host_bytes="2MiB"))
    assert store.options.host_bytes == 2 << 20


def test_a_store_without_a_model_name_is_refused():
    with pytest.raises(ValueError, match="model"):
        PagedKVStore(storage_config(dynamic_extra(**HOST), model=None), {})


def test_unimplemented_hit_policy_raises():
    pool = host_pool()
    fill_pages(pool, seed=5)
    store = make_store(pool, dynamic_extra(**HOST))
    store.register_mem_host_pool_v2(host_pool(), PoolName.SWA)
    ks = keys(2)
    store.batch_set_v1(ks, indices([0, 1], pool.page_size))
    t = PoolTransfer(name=PoolName.SWA, keys=ks, hit_policy=PoolHitPolicy.BLOCK_GROUPS)
    with pytest.raises(ValueError, match="hit policy"):
        store.batch_exists_v2(ks, [t])


def test_clear_forgets_the_host_pages():
    pool = host_pool()
    fill_pages(pool, seed=6)
    store = make_store(pool, dynamic_extra(**HOST))
    ks = keys(3)
    store.batch_set_v1(ks, indices([0, 1, 2], pool.page_size))
    store.clear()
    assert store.batch_exists(ks) == 0


def test_pools_of_other_classes_go_through_their_own_page_calls():
    """The store writes MHA pages in place with numpy; any other pool class gets its own
    set_from_flat_data_page. A subclass that overrides it (counting the calls) must be
    called, and the bytes must land the same."""
    calls = []

    class CountingPool(type(host_pool())):
        def set_from_flat_data_page(self, index, data_page):
            calls.append(index)
            super().set_from_flat_data_page(index, data_page)

    src = host_pool()
    fill_pages(src, seed=7)
    dst = host_pool()
    dst.__class__ = CountingPool
    store = make_store(src, dynamic_extra(**HOST))
    ks = keys(3)
    assert all(store.batch_set_v1(ks, indices([1, 2, 3], src.page_size)))
    store.register_mem_pool_host(dst)
    assert store.batch_get_v1(ks, indices([5, 6, 7], dst.page_size)) == [True] * 3
    assert calls == [5 * dst.page_size, 6 * dst.page_size, 7 * dst.page_size]
    assert [page_of(dst, p) for p in (5, 6, 7)] == [page_of(src, p) for p in (1, 2, 3)]


def test_import_pagedkv_never_imports_sglang():
    """With SGLang installed and importable, `import pagedkv` (and its tiers) leaves it
    alone; `import pagedkv.sglang` is what brings it in."""
    import os
    import subprocess
    import sys

    code = (
        "import sys, pagedkv, pagedkv.tiers, pagedkv.tiers.host\n"
        "print('sglang' in sys.modules)\n"
        "import pagedkv.sglang\n"
        "print('sglang' in sys.modules)\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True
    )
    assert out.stdout.split() == ["False", "True"]
