"""PagedKVStore from several threads at once, as SGLang's prefetch and backup threads (and
several ranks' threads sharing a server) call it: every page a get reports loaded is exactly
the page that was set under that key."""

from __future__ import annotations

import random
import threading
from pathlib import Path

import pytest

pytest.importorskip("sglang", reason="SGLang 0.5.23 is not installed")

import torch

from redis_fixtures import running_server, server_binary
from sglang_objects import SECRET_HEX, dynamic_extra, host_pool, indices, keys, make_store, page_of

THREADS = 4
ROUNDS = 30
PAGES = 8  # distinct page keys, shared by the threads: they overwrite each other's sets


def _page_for(key_index: int, pool) -> torch.Tensor:
    """The one page of bytes ever stored under key `key_index` (every writer sets the same
    KV for a key, as the same prefix gives the same KV)."""
    g = torch.Generator().manual_seed(1000 + key_index)
    n = pool.get_dummy_flat_data_page().numel()
    return torch.randn(n, generator=g).to(pool.dtype)


@pytest.mark.parametrize("tiers", ["host", "compressed", "host+redis"])
def test_threads_set_and_get_concurrently(tiers, tmp_path: Path, monkeypatch):
    monkeypatch.setenv("PAGEDKV_TIER_SECRET", SECRET_HEX)
    with running_server(server_binary("redis"), tmp_path / "srv") as srv:
        opts = {
            "host": {"host_bytes": 1 << 20},
            "compressed": {"host_bytes": 1 << 20, "codec": "shuffle+lz4"},
            "host+redis": {"host_bytes": 64 << 10, "redis_url": srv.url},  # host tier evicts
        }[tiers]
        pool = host_pool(pages=THREADS * 4 + 2)
        store = make_store(pool, dynamic_extra(**opts))
        ks = keys(PAGES)
        want = [_page_for(i, pool) for i in range(PAGES)]
        want_bytes = [bytes(w.view(torch.uint8).numpy()) for w in want]
        errors: list[str] = []
        loads = [0]
        lock = threading.Lock()

        def work(t: int) -> None:
            rng = random.Random(t)
            mine = list(range(t * 4, t * 4 + 4))  # this thread's own pages of the pool
            for _ in range(ROUNDS):
                chosen = rng.sample(range(PAGES), 2)
                if rng.random() < 0.5:
                    # Stage the pages in this thread's pool pages, then set them.
                    for slot, ki in zip(mine, chosen, strict=False):
                        pool.set_from_flat_data_page(slot * pool.page_size, want[ki])
                    ok = store.batch_set_v1(
                        [ks[k] for k in chosen], indices(mine[:2], pool.page_size)
                    )
                    if not all(ok) and tiers != "host+redis":
                        errors.append(f"set failed: {ok}")
                else:
                    ok = store.batch_get_v1(
                        [ks[k] for k in chosen], indices(mine[2:], pool.page_size)
                    )
                    for hit, slot, ki in zip(ok, mine[2:], chosen, strict=True):
                        if hit:
                            with lock:
                                loads[0] += 1
                            if page_of(pool, slot) != want_bytes[ki]:
                                errors.append(f"thread {t}: wrong page for key {ki}")

        threads = [threading.Thread(target=work, args=(t,)) for t in range(THREADS)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(60)
        assert not any(th.is_alive() for th in threads)
        assert errors == []
        assert loads[0] > 0  # the gets did load pages, and each was checked
