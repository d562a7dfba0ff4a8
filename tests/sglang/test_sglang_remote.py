"""PagedKVStore over a real Redis (and Valkey) started by the test: nodes sharing a server hit
each other's pages, models, ranks and page formats never do, and a dead or full server gives
misses and dropped sets, bounded in time, never a wrong page."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("sglang", reason="SGLang 0.5.23 is not installed")


from redis_fixtures import ServerProcess, running_cluster, running_server, server_binary
from sglang_objects import (
    SECRET_HEX,
    dynamic_extra,
    fill_pages,
    host_pool,
    indices,
    keys,
    make_store,
    mla_pool,
    page_of,
)

TIMEOUT = 0.3
SLACK = 1.5  # a loaded 2-core machine


@pytest.fixture(autouse=True)
def _secret(monkeypatch):
    monkeypatch.setenv("PAGEDKV_TIER_SECRET", SECRET_HEX)


@pytest.fixture(params=["redis", "valkey"])
def server(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[ServerProcess]:
    with running_server(server_binary(request.param), tmp_path / "server") as s:
        yield s


def remote(url: str, **more: object) -> dict:
    return dynamic_extra(
        redis_url=url, timeout=TIMEOUT, connect_timeout=TIMEOUT, retry_after=0.5, **more
    )


def test_two_nodes_sharing_a_server_hit_each_others_pages(server):
    a_pool, b_pool = host_pool(), host_pool()
    fill_pages(a_pool, seed=20)
    a = make_store(a_pool, remote(server.url, host_bytes=1 << 20))
    b = make_store(b_pool, remote(server.url, host_bytes=1 << 20))
    ks = keys(6)
    assert a.batch_set_v1(ks, indices([0, 1, 2, 3, 4, 5], a_pool.page_size)) == [True] * 6
    assert b.batch_exists(ks) == 6
    assert b.batch_get_v1(ks, indices([10, 11, 12, 13, 14, 15], b_pool.page_size)) == [True] * 6
    for i in range(6):
        assert page_of(b_pool, 10 + i) == page_of(a_pool, i)
    # b's remote hits were copied into b's host tier.
    host, _ = b.get_stats().values()
    assert host.entries == 6


def test_models_ranks_and_page_formats_never_share_pages(server):
    pool = host_pool()
    fill_pages(pool, seed=21)
    writer = make_store(pool, remote(server.url), tp_rank=0, tp_size=2)
    ks = keys(3)
    assert all(writer.batch_set_v1(ks, indices([0, 1, 2], pool.page_size)))

    def hits(p, **config: object) -> int:
        return make_store(p, remote(server.url), **config).batch_exists(ks)

    assert hits(host_pool(), tp_rank=0, tp_size=2) == 3  # the same shard on another node
    assert hits(host_pool(), tp_rank=1, tp_size=2) == 0  # another shard
    assert hits(host_pool(), tp_rank=0, tp_size=4) == 0
    assert hits(host_pool(), tp_rank=0, tp_size=2, model="other/model") == 0
    assert hits(host_pool(layout="layer_first"), tp_rank=0, tp_size=2) == 0  # other byte order
    assert hits(host_pool(head_dim=8), tp_rank=0, tp_size=2) == 0  # other page size
    other_tenant = make_store(
        host_pool(), remote(server.url, namespace="tenant-b"), tp_rank=0, tp_size=2
    )
    assert other_tenant.batch_exists(ks) == 0


def test_mla_kv_is_one_shard_for_every_tp_rank(server):
    pool = mla_pool()
    fill_pages(pool, seed=22)
    rank0 = make_store(pool, remote(server.url), tp_rank=0, tp_size=4, is_mla=True)
    ks = keys(2)
    assert all(rank0.batch_set_v1(ks, indices([3, 4], pool.page_size)))
    other = mla_pool()
    rank3 = make_store(other, remote(server.url), tp_rank=3, tp_size=4, is_mla=True)
    assert rank3.batch_get_v1(ks, indices([0, 1], other.page_size)) == [True, True]
    assert page_of(other, 1) == page_of(pool, 4)


def test_a_dead_server_gives_misses_in_bounded_time(server):
    pool = host_pool()
    fill_pages(pool, seed=23)
    store = make_store(pool, remote(server.url))
    ks = keys(4)
    assert all(store.batch_set_v1(ks[:2], indices([0, 1], pool.page_size)))
    server.kill()
    before = page_of(pool, 8)
    t0 = time.monotonic()
    assert store.batch_set_v1(ks[2:], indices([2, 3], pool.page_size)) == [False, False]
    assert store.batch_exists(ks) == 0
    assert store.batch_get_v1(ks[:2], indices([8, 9], pool.page_size)) == [False, False]
    assert not store.exists(ks[0])
    assert time.monotonic() - t0 < 4 * TIMEOUT + SLACK
    assert page_of(pool, 8) == before  # nothing written into the pool
    # Back on the same port: the store recovers by itself and its pages are there again.
    server.restart()
    deadline = time.monotonic() + 10
    while store.batch_exists(ks[:1]) == 0 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert store.batch_set_v1(ks[2:], indices([2, 3], pool.page_size)) == [True, True]


def test_the_host_tier_still_serves_while_the_server_is_dead(server):
    pool = host_pool()
    fill_pages(pool, seed=24)
    store = make_store(pool, remote(server.url, host_bytes=1 << 20))
    ks = keys(3)
    assert all(store.batch_set_v1(ks, indices([0, 1, 2], pool.page_size)))
    server.kill()
    assert store.batch_exists(ks) == 3
    assert store.batch_get_v1(ks, indices([5, 6, 7], pool.page_size)) == [True] * 3
    assert page_of(pool, 6) == page_of(pool, 1)


@pytest.mark.parametrize("policy", ["noeviction", "allkeys-lru"])
def test_a_full_server_drops_or_evicts_never_serves_a_wrong_page(tmp_path, policy):
    args = ["--maxmemory", "2mb", "--maxmemory-policy", policy]
    with running_server(server_binary("redis"), tmp_path / "full", args) as srv:
        pool = host_pool(layers=4, heads=4, head_dim=64, page_size=8, pages=40)  # 64 KiB pages
        fill_pages(pool, seed=25)
        store = make_store(pool, remote(srv.url))
        ks = keys(40)
        stored = store.batch_set_v1(ks, indices(list(range(40)), pool.page_size))
        if policy == "noeviction":
            assert not all(stored) and any(stored)  # the server refused what did not fit
        want = [page_of(pool, p) for p in range(40)]
        pool.kv_buffer.zero_()
        got = []
        for i, k in enumerate(ks):  # one by one: a miss must not hide later pages
            ok = store.batch_get_v1([k], indices([i], pool.page_size))[0]
            got.append(ok)
            assert page_of(pool, i) == (want[i] if ok else bytes(len(want[i])))
        assert any(got) and not all(got)
        assert all(s for s, g in zip(stored, got, strict=True) if g)  # a hit was a stored page


def test_a_redis_cluster_by_configuration(tmp_path):
    with running_cluster(server_binary("redis"), tmp_path / "cluster") as cluster:
        a_pool, b_pool = host_pool(), host_pool()
        fill_pages(a_pool, seed=26)
        a = make_store(a_pool, remote(cluster.url, redis_cluster=True))
        b = make_store(b_pool, remote(cluster.url, redis_cluster=True))
        ks = keys(12)
        assert a.batch_set_v1(ks, indices(list(range(12)), a_pool.page_size)) == [True] * 12
        assert b.batch_exists(ks) == 12
        assert b.batch_get_v1(ks, indices(list(range(12, 24)), b_pool.page_size)) == [True] * 12
        assert [page_of(b_pool, 12 + i) for i in range(12)] == [
            page_of(a_pool, i) for i in range(12)
        ]


def test_a_stalled_server_costs_one_timeout_then_misses(server):
    pool = host_pool()
    fill_pages(pool, seed=27)
    store = make_store(pool, remote(server.url))
    ks = keys(8)
    assert all(store.batch_set_v1(ks, indices(list(range(8)), pool.page_size)))
    pool.kv_buffer.zero_()
    server.pause()
    try:
        t0 = time.monotonic()
        assert store.batch_get_v1(ks, indices(list(range(10, 18)), pool.page_size)) == [False] * 8
        assert store.batch_exists(ks) == 0
        assert store.batch_set_v1(ks, indices(list(range(8)), pool.page_size)) == [False] * 8
        # One read timed out; the server then rests and the other calls miss at once.
        assert time.monotonic() - t0 < 2 * TIMEOUT + SLACK
    finally:
        server.resume()
    assert page_of(pool, 10) == bytes(len(page_of(pool, 10)))
