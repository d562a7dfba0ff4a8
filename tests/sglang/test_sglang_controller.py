"""PagedKVStore under SGLang's own cache-controller code: `HiCacheController`'s backup
(`_page_backup`, batches of STORAGE_BATCH_SIZE pages), hit query (`_storage_hit_query`, with
SGLang's page hashes of real token ids) and prefetch transfer (`_page_transfer`), through
both of its page paths (zero-copy `interface_v1` and the generic tensor one).

The controller's constructor needs a device KV pool and process groups; these tests make
the object without it (`object.__new__`) and set only what those methods read: the storage
backend, the host pool, the page size, the page functions SGLang itself selects from
`interface_v1`, and the ack queue. Everything the methods do is SGLang's code.
"""

from __future__ import annotations

import queue
from pathlib import Path

import pytest

pytest.importorskip("sglang", reason="SGLang 0.5.23 is not installed")

from sglang.srt.managers.cache_controller import (
    HiCacheController,
    PrefetchOperation,
    StorageOperation,
)
from sglang.srt.mem_cache.hicache_storage import STORAGE_BATCH_SIZE
from sglang.srt.mem_cache.utils import get_storage_hash_str

from redis_fixtures import running_server, server_binary
from sglang_objects import (
    SECRET_HEX,
    dynamic_extra,
    fill_pages,
    host_pool,
    indices,
    make_store,
    page_of,
)

PAGES = STORAGE_BATCH_SIZE + 12  # two batches


def controller(store, pool, *, v1: bool) -> HiCacheController:
    c = object.__new__(HiCacheController)
    c.storage_backend = store
    c.mem_pool_host = c.storage_host_pool = pool
    c.page_size = pool.page_size
    # What attach_storage_backend selects for a "dynamic" backend by `interface_v1`.
    c.page_get_func = c._page_get_zero_copy if v1 else c._generic_page_get
    c.page_set_func = c._page_set_zero_copy if v1 else c._generic_page_set
    c.prefetch_sync_queue = queue.Queue()
    return c


@pytest.mark.parametrize("v1", [True, False], ids=["interface_v1", "generic"])
def test_backup_then_prefetch_on_another_node(v1, tmp_path: Path, monkeypatch):
    monkeypatch.setenv("PAGEDKV_TIER_SECRET", SECRET_HEX)
    with running_server(server_binary("redis"), tmp_path / "srv") as srv:
        extra = dynamic_extra(redis_url=srv.url, host_bytes=1 << 20)
        if not v1:
            del extra["interface_v1"]
        a_pool, b_pool = host_pool(pages=2 * PAGES + 1), host_pool(pages=2 * PAGES + 1)
        fill_pages(a_pool, seed=30)
        a = controller(make_store(a_pool, extra), a_pool, v1=v1)
        b = controller(make_store(b_pool, extra), b_pool, v1=v1)
        tokens = [(7 * i) % 50_000 for i in range(PAGES * a_pool.page_size)]
        written = 100  # pages of the request that node a backs up

        # Node a backs up the first `written` pages of the prompt, as SGLang's backup thread.
        hashes = get_storage_hash_str(tokens, None, page_size=a_pool.page_size)
        assert len(hashes) == PAGES
        op = StorageOperation(
            indices(list(range(written)), a_pool.page_size),
            tokens[: written * a_pool.page_size],
            hash_value=hashes[:written],
        )
        a._page_backup(op)
        assert op.completed_tokens == written * a_pool.page_size

        # Node b gets the whole prompt: the hit query finds the written prefix only.
        pre = PrefetchOperation("req-1", tokens)
        found, hit_tokens = b._storage_hit_query(pre)
        assert hit_tokens == written * b_pool.page_size
        assert found == hashes[:written]
        pre.hash_value = found
        pre.host_indices = indices(list(range(PAGES, PAGES + written)), b_pool.page_size)
        assert b._page_transfer(pre) == written
        for i in range(written):
            assert page_of(b_pool, PAGES + i) == page_of(a_pool, i)
