"""PagedKVTier under vLLM 0.33's real TieringOffloadingManager, on host-memory stores: the
factory loads it by module_path, chunks cascade into it, come back through promotion with
their exact bytes, and bad options fail when the engine starts (docs/tiers.md)."""

from __future__ import annotations

import time
from collections.abc import Iterator

import numpy as np
import pytest
from vllm.v1.kv_offload.base import LookupResult, Medium, make_offload_key
from vllm.v1.kv_offload.tiering.base import SecondaryTierManager, TransferJob
from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory

from pagedkv.tiers.host import CompressedHostTier, HostTier
from pagedkv.vllm import PagedKVTier
from pagedkv.vllm.tier import offload_key, tier_key
from vllm_tiering import ROW, Node, block, key

HOST = {"host_bytes": 1 << 20}
LZ4 = {"host_bytes": "1MiB", "codec": "shuffle+lz4"}


@pytest.fixture
def nodes() -> Iterator[list[Node]]:
    made: list[Node] = []
    yield made
    for n in made:
        n.close()


def compressible(seed: int) -> bytes:
    """bf16-like rows whose high bytes repeat: shuffle + lz4 shrinks them."""
    rng = np.random.default_rng(seed)
    words = (rng.integers(0, 256, ROW // 2, dtype=np.uint16)) | np.uint16(0x3F00)
    return words.tobytes()


def test_factory_loads_the_tier_by_module_path(nodes):
    cls = SecondaryTierFactory.get_tier_class(
        {"type": "PagedKVTier", "module_path": "pagedkv.vllm"}
    )
    assert cls is PagedKVTier and issubclass(cls, SecondaryTierManager)
    node = Node(HOST)
    nodes.append(node)
    assert isinstance(node.tier, PagedKVTier)
    assert isinstance(node.tier.tier_store, HostTier)
    assert node.tier.medium is Medium.CPU and node.tier.block_size_bytes == ROW


@pytest.mark.parametrize("opts", [HOST, LZ4], ids=["raw", "shuffle+lz4"])
def test_store_then_load_round_trip(nodes, opts):
    node = Node(opts, chunks=16)
    nodes.append(node)
    data = compressible if "codec" in opts else block
    blocks = {key(i): data(i) for i in range(12)}
    assert node.store(blocks) == list(blocks)
    node.settle()
    st = node.tier.tier_stats()
    assert st.puts == 12 and st.dropped_puts == 0
    if "codec" in opts:
        assert isinstance(node.tier.tier_store, CompressedHostTier)
        assert st.compression_ratio > 1.2
    node.forget_primary()  # vLLM's CPU tier is empty: every hit must come from pagedkv
    got = node.load(list(blocks))
    assert got == blocks
    assert node.tier.tier_stats().hits == 12


def test_chunks_evicted_from_the_cpu_tier_come_back(nodes):
    """A primary tier of 8 chunks holds 8 of 24 stored blocks; the other 16 are promoted
    from pagedkv's store, exact."""
    node = Node(HOST, chunks=8)
    nodes.append(node)
    blocks = {key(i): block(100 + i) for i in range(24)}
    for lo in range(0, 24, 4):
        part = dict(list(blocks.items())[lo : lo + 4])
        node.store(part)
        node.settle()
    for lo in range(0, 24, 4):
        keys = list(blocks)[lo : lo + 4]
        assert node.load(keys) == {k: blocks[k] for k in keys}


def test_unknown_key_misses_and_never_writes_a_row(nodes):
    node = Node(HOST, chunks=8)
    nodes.append(node)
    node.store({key(1): block(1)})
    node.settle()
    before = node.rows.copy()
    assert node.resolve([key(2), key(1, group=1)]) == [LookupResult.MISS, LookupResult.MISS]
    assert np.array_equal(node.rows, before)


def test_hybrid_groups_do_not_collide(nodes):
    """One block hash in two KV-cache groups: two keys, two blocks, each loaded as its own."""
    node = Node(HOST, chunks=8, groups=3)
    nodes.append(node)
    blocks = {key(7, group=g): block(70 + g) for g in range(3)}
    node.store(blocks)
    node.settle()
    node.forget_primary()
    assert node.load(list(blocks)) == blocks
    assert {tier_key(k).group for k in blocks} == {0, 1, 2}  # type: ignore[union-attr]


def test_offload_keys_map_both_ways():
    k = make_offload_key(b"\xab" * 32, 5)
    tk = tier_key(k)
    assert tk is not None and tk.group == 5 and tk.digest == b"\xab" * 32
    assert offload_key(tk) == k
    assert tier_key(make_offload_key(b"x" * 32, 256)) is None  # past one byte: never stored
    long = tier_key(make_offload_key(b"y" * 40, 0))
    assert (
        long is not None and len(long.digest) == 32 and offload_key(long) == long.digest + bytes(4)
    )


def test_a_load_that_misses_reports_the_keys_it_wrote(nodes):
    """A job whose second key is gone: the first is loaded and named in successful_keys,
    the second's row is left as it was, and the tier then answers MISS for it."""
    node = Node(HOST, chunks=8)
    nodes.append(node)
    node.store({key(1): block(1), key(2): block(2)})
    node.settle()
    node.tier.tier_store.discard(tier_key(key(2)))
    rows = node.rows
    rows[5] = 0xEE
    rows[6] = 0xEE
    tier = node.tier
    tier.submit_load(TransferJob(900, [key(1), key(2)], np.array([5, 6]), True, node.ctx))
    tier.drain_jobs()
    (res,) = list(tier.get_finished_jobs())
    assert res.job_id == 900 and not res.success and list(res.successful_keys) == [key(1)]
    assert rows[5].tobytes() == block(1) and (rows[6] == 0xEE).all()
    assert tier.lookup(key(2), node.ctx) is LookupResult.MISS


def test_store_events_name_the_keys(nodes):
    node = Node(HOST, chunks=8)
    nodes.append(node)
    node.store({key(1): block(1), key(2): block(2)})
    node.settle()
    events = [e for e in node.m.take_events() if e.medium is Medium.CPU and e.locality]
    stored = {k for e in events if not e.removed for k in e.keys}
    assert stored == {key(1), key(2)}


def test_host_budget_evicts_and_reports_removals(nodes):
    """A store that holds 3 rows: the oldest go, their removal is an event, and they miss.
    One worker, so the five puts reach the store in the job's order ("oldest" is defined;
    with two workers the job is split in two parts that race, CI 2026-12-02)."""
    node = Node({"host_bytes": 3 * (ROW + 89), "workers": 1}, chunks=8)
    nodes.append(node)
    blocks = {key(i): block(i) for i in range(5)}
    node.store(blocks)
    node.settle()
    removed = {k for e in node.m.take_events() if e.removed and e.locality for k in e.keys}
    assert removed == {key(0), key(1)}
    node.forget_primary()
    got = node.load(list(blocks))
    assert got == {**dict.fromkeys(list(blocks)[:2]), **dict(list(blocks.items())[2:])}


def test_host_budget_with_racing_workers_keeps_three_and_reports_the_rest(nodes):
    """Two workers put the job's halves in either order: whichever two keys go, exactly
    those are reported removed and miss, and the three kept load exact."""
    node = Node({"host_bytes": 3 * (ROW + 89), "workers": 2}, chunks=8)
    nodes.append(node)
    blocks = {key(i): block(i) for i in range(5)}
    node.store(blocks)
    node.settle()
    removed = {k for e in node.m.take_events() if e.removed and e.locality for k in e.keys}
    assert len(removed) == 2 and removed <= set(blocks)
    node.forget_primary()
    got = node.load(list(blocks))
    assert got == {k: (None if k in removed else v) for k, v in blocks.items()}


@pytest.mark.parametrize(
    ("opts", "match"),
    [
        ({"host_bytes": 1 << 20, "hots_bytes": 1}, "unknown PagedKVTier option"),
        ({}, "exactly one of 'host_bytes'"),
        ({"host_bytes": 1 << 20, "redis_url": "redis://127.0.0.1:1"}, "exactly one"),
        ({"host_bytes": 1 << 20, "codec": "zstd"}, "unknown codec"),
        ({"host_bytes": "1G"}, "ambiguous"),
        ({"host_bytes": 1 << 20, "workers": 0}, "positive int"),
        ({"redis_url": "redis://127.0.0.1:1", "secret_env": "PAGEDKV_NO_SUCH_VAR"}, "secret"),
    ],
)
def test_bad_options_fail_at_startup(opts, match):
    with pytest.raises((ValueError, TypeError), match=match):
        Node(opts)


def test_stats_reach_vllm(nodes):
    node = Node(HOST, chunks=8)
    nodes.append(node)
    node.store({key(1): block(1)})
    node.settle()
    stats = node.tier.get_stats()
    assert stats is not None
    flat = stats.reduce()
    assert flat["pagedkv:tier_puts:('host',)"] == 1
    assert flat["pagedkv:tier_entries:('host',)"] == 1
    assert node.tier.get_stats() is not None  # the gauges again, no new counts
    defs = PagedKVTier.build_metric_definitions({})
    assert set(defs) >= {"pagedkv:tier_puts", "pagedkv:tier_stored_bytes"}


def job(job_id, keys, cids, node, promotion=False):
    return TransferJob(job_id, keys, np.array(cids), promotion, node.ctx)


def test_bad_jobs_raise_and_change_nothing(nodes):
    node = Node(HOST, chunks=8)
    nodes.append(node)
    tier = node.tier
    with pytest.raises(ValueError, match="2 keys, 1 chunk ids"):
        tier.submit_store(job(1, [key(1), key(2)], [0], node))
    with pytest.raises(ValueError, match="out of the primary tier's 8 rows"):
        tier.submit_store(job(2, [key(1)], [8], node))
    with pytest.raises(ValueError, match="out of the primary tier's 8 rows"):
        tier.submit_load(job(3, [key(1)], [-1], node, True))
    assert list(tier.get_finished_jobs()) == [] and not tier.has_pending_work()
    assert tier.tier_stats().puts == 0


def test_a_store_past_max_pending_bytes_is_dropped_whole(nodes):
    node = Node({**HOST, "max_pending_bytes": ROW}, chunks=8)
    nodes.append(node)
    node.rows[0:2] = 1
    node.tier.submit_store(job(5, [key(1), key(2)], [0, 1], node))
    (res,) = list(node.tier.get_finished_jobs())
    assert res.job_id == 5 and not res.success
    node.tier.drain_jobs()
    assert node.tier.tier_stats().puts == 0


def test_drain_waits_for_every_job_and_aborts_none(nodes, monkeypatch):
    """Stores that take 50 ms each: drain_jobs returns once all landed, each reported."""
    node = Node(HOST, chunks=16)
    nodes.append(node)
    store = node.tier.tier_store
    put = store.put

    def slow_put(k, data):
        time.sleep(0.05)
        return put(k, data)

    monkeypatch.setattr(store, "put", slow_put)
    for j in range(4):
        node.rows[j] = j
        node.tier.submit_store(job(j, [key(j)], [j], node))
    assert node.tier.has_pending_work()
    node.tier.drain_jobs()
    assert sorted(r.job_id for r in node.tier.get_finished_jobs() if r.success) == [0, 1, 2, 3]
    assert store.stats().puts == 4 and not node.tier.has_pending_work()
