"""The v2 calls of hybrid models: per-pool transfers (`PoolTransfer`) and per-pool hit
policies (ALL_PAGES, TRAILING_PAGES), against SGLang's own file backend (`HiCacheFile`) as the
reference of what `batch_exists_v2` must answer.

The side pools are SGLang MHA host pools of other shapes registered under SGLang's pool names
(SWA's host pool is an MHA pool; the indexer's stands in for DSA's): what the store does
depends on the pool's name, hit policy and page calls, not on its class.
"""

from __future__ import annotations

import random

import pytest

pytest.importorskip("sglang", reason="SGLang 0.5.23 is not installed")

from sglang.srt.mem_cache.hicache_storage import (
    HiCacheFile,
    PoolHitPolicy,
    PoolName,
    PoolTransfer,
)

from sglang_objects import (
    dynamic_extra,
    fill_pages,
    host_pool,
    indices,
    keys,
    make_store,
    page_of,
    storage_config,
)

N = 8


def pools():
    kv = host_pool(layers=2, pages=16)
    swa = host_pool(layers=1, heads=1, head_dim=8, pages=16)
    idx = host_pool(layers=1, heads=1, head_dim=4, pages=16, layout="layer_first")
    for seed, p in enumerate((kv, swa, idx)):
        fill_pages(p, seed=10 + seed)
    return kv, swa, idx


def test_v2_round_trip_per_pool():
    kv, swa, idx = pools()
    store = make_store(kv, dynamic_extra(host_bytes=1 << 22))
    store.register_mem_host_pool_v2(kv, PoolName.KV)
    store.register_mem_host_pool_v2(swa, PoolName.SWA)
    store.register_mem_host_pool_v2(idx, PoolName.INDEXER)
    ks = keys(4)
    src = [1, 2, 3, 4]
    put = [
        PoolTransfer(name=PoolName.SWA, keys=ks, host_indices=indices(src, swa.page_size)),
        PoolTransfer(name=PoolName.INDEXER, keys=ks, host_indices=indices(src, idx.page_size)),
    ]
    assert store.batch_set_v2(put) == {"swa": [True] * 4, "indexer": [True] * 4}
    # The same page keys in another pool are other entries: KV has none of them.
    assert store.batch_exists(ks) == 0
    dst = [10, 11, 12, 13]
    get = [
        PoolTransfer(name=PoolName.SWA, keys=ks, host_indices=indices(dst, swa.page_size)),
        PoolTransfer(name=PoolName.INDEXER, keys=ks, host_indices=indices(dst, idx.page_size)),
    ]
    assert store.batch_get_v2(get) == {"swa": [True] * 4, "indexer": [True] * 4}
    for s, d in zip(src, dst, strict=True):
        assert page_of(swa, d) == page_of(swa, s)
        assert page_of(idx, d) == page_of(idx, s)


def test_v2_of_an_unregistered_pool_raises():
    kv, _, _ = pools()
    store = make_store(kv, dynamic_extra(host_bytes=1 << 22))
    t = PoolTransfer(name=PoolName.MAMBA, keys=keys(1), host_indices=indices([0], 1))
    with pytest.raises(RuntimeError, match="no host pool 'mamba'"):
        store.batch_get_v2([t])


def _write(store, kv, swa, idx, ks, have_kv, have_swa, have_idx, v1: bool):
    def sel(have):
        return [i for i in range(N) if have[i]]

    kv_pages = sel(have_kv)
    if v1:
        store.batch_set_v1([ks[i] for i in kv_pages], indices(kv_pages, kv.page_size))
    else:  # HiCacheFile: the tensor call, as SGLang's generic path
        store.batch_set(
            [ks[i] for i in kv_pages], [kv.get_data_page(i * kv.page_size) for i in kv_pages]
        )
    transfers = []
    for name, pool, have in ((PoolName.SWA, swa, have_swa), (PoolName.INDEXER, idx, have_idx)):
        pages = sel(have)
        transfers.append(
            PoolTransfer(
                name=name, keys=[ks[i] for i in pages], host_indices=indices(pages, pool.page_size)
            )
        )
    store.batch_set_v2(transfers)


@pytest.mark.parametrize("seed", range(12))
def test_batch_exists_v2_answers_as_sglangs_file_backend(seed, tmp_path):
    rng = random.Random(seed)
    kv, swa, idx = pools()
    ks = keys(N, f"s{seed}-")
    # Mostly present, with holes: the runs and windows then end at various places.
    have = [[rng.random() < 0.8 for _ in range(N)] for _ in range(3)]
    window = rng.choice([1, 2, 3])

    ours = make_store(kv, dynamic_extra(host_bytes=1 << 22))
    ref = HiCacheFile(storage_config({"file_storage_path": str(tmp_path / "files")}))
    ref.register_mem_pool_host(kv)
    for store in (ours, ref):
        store.register_mem_host_pool_v2(swa, PoolName.SWA)
        store.register_mem_host_pool_v2(idx, PoolName.INDEXER)
        _write(store, kv, swa, idx, ks, *have, v1=store is ours)

    query = [
        PoolTransfer(name=PoolName.SWA, keys=ks[:window], hit_policy=PoolHitPolicy.TRAILING_PAGES),
        PoolTransfer(name=PoolName.INDEXER, keys=ks, hit_policy=PoolHitPolicy.ALL_PAGES),
    ]
    got, want = ours.batch_exists_v2(ks, query), ref.batch_exists_v2(ks, query)
    assert got.kv_hit_pages == want.kv_hit_pages
    assert got.restorable_prefix_pages == want.restorable_prefix_pages
    assert {str(k): v for k, v in got.extra_pool_hit_pages.items()} == {
        str(k): v for k, v in want.extra_pool_hit_pages.items()
    }


def test_kv_pages_are_one_set_of_entries_for_v1_and_v2():
    """A KV page stored by batch_set_v1 loads through batch_get_v2 of the KV pool, and back."""
    kv, _, _ = pools()
    store = make_store(kv, dynamic_extra(host_bytes=1 << 22))
    store.register_mem_host_pool_v2(kv, PoolName.KV)
    ks = keys(3)
    assert all(store.batch_set_v1(ks[:2], indices([0, 1], kv.page_size)))
    t = PoolTransfer(name=PoolName.KV, keys=ks[2:], host_indices=indices([2], kv.page_size))
    assert store.batch_set_v2([t]) == {"kv": [True]}
    get = PoolTransfer(name=PoolName.KV, keys=ks[:2], host_indices=indices([8, 9], kv.page_size))
    assert store.batch_get_v2([get]) == {"kv": [True, True]}
    assert store.batch_get_v1(ks[2:], indices([10], kv.page_size)) == [True]
    assert [page_of(kv, p) for p in (8, 9, 10)] == [page_of(kv, p) for p in (0, 1, 2)]
