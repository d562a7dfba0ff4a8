"""PagedKVTier on a real Redis / Valkey under vLLM 0.33's TieringOffloadingManager: two
engines sharing a server load each other's chunks, exact; a dead, stalled, unreachable or
full server gives misses and dropped stores, never a wrong block, and no manager call
waits on it (docs/tiers.md, "Under stock vLLM")."""

from __future__ import annotations

import secrets
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from vllm.v1.kv_offload.base import LookupResult, Medium, ReqContext

from pagedkv.tiers.remote import RemoteTier
from pagedkv.vllm.tier import tier_key
from redis_fixtures import (
    ServerProcess,
    free_port,
    running_cluster,
    running_server,
    server_binary,
)
from vllm_tiering import Node, block, key

#: A manager call that waited on the server would take the tier's socket timeout (1 s
#: here); without a fault they take well under a millisecond.
CALL_BOUND = 0.05


@pytest.fixture(autouse=True)
def shared_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PAGEDKV_TIER_SECRET", secrets.token_hex(32))


@pytest.fixture
def server(tmp_path: Path) -> Iterator[ServerProcess]:
    with running_server(server_binary("redis"), tmp_path / "redis") as s:
        yield s


@pytest.fixture
def nodes() -> Iterator[list[Node]]:
    made: list[Node] = []
    yield made
    for n in made:
        n.close()


def remote(url: str, **extra: object) -> dict[str, object]:
    return {"redis_url": url, "redis_timeout_s": 1.0, **extra}


@pytest.mark.parametrize("kind", ["redis", "valkey"])
@pytest.mark.parametrize("codec", ["raw", "shuffle+lz4"])
def test_two_engines_share_a_server(nodes, tmp_path, kind, codec):
    """Engine A offloads; engine B, with an empty CPU tier, promotes A's chunks from the
    server: the same bytes. B's first look-up of a key is RETRY (the EXISTS runs on a
    worker thread after the step), the next one HIT."""
    with running_server(server_binary(kind), tmp_path / kind) as srv:
        a = Node(remote(srv.url, codec=codec), chunks=16)
        b = Node(remote(srv.url), chunks=16)  # a raw reader reads any codec's entries
        nodes += [a, b]
        assert b.tier.medium is Medium.STORAGE and isinstance(b.tier.tier_store, RemoteTier)
        blocks = {key(i): block(i) for i in range(10)}
        a.store(blocks)
        a.settle()
        assert a.tier.tier_stats().puts == 10 and a.tier.tier_stats().dropped_puts == 0
        first = [b.call(b.m.lookup, k, b.ctx) for k in blocks]
        assert first == [LookupResult.RETRY] * 10
        assert b.load(list(blocks)) == blocks
        assert b.tier.tier_stats().hits == 10
        assert max(a.slowest, b.slowest) < CALL_BOUND


def test_another_tenant_or_secret_shares_nothing(nodes, server, monkeypatch):
    a = Node(remote(server.url, tenant="team-a"), chunks=8)
    other_tenant = Node(remote(server.url, tenant="team-b"), chunks=8)
    nodes += [a, other_tenant]
    blocks = {key(i): block(i) for i in range(4)}
    a.store(blocks)
    a.settle()
    assert other_tenant.load(list(blocks)) == dict.fromkeys(blocks)
    # Same namespace, another secret: its keys are other keys (keyed by the secret), so
    # not even a presence check finds A's entries, and nothing is read to fail its MAC.
    monkeypatch.setenv("PAGEDKV_TIER_SECRET", secrets.token_hex(32))
    forger = Node(remote(server.url, tenant="team-a"), chunks=8)
    nodes.append(forger)
    assert forger.load(list(blocks)) == dict.fromkeys(blocks)
    st = forger.tier.tier_stats()
    assert st.corrupt == 0 and st.extra["lookup_hits"] == 0


@pytest.mark.parametrize("fault", ["killed", "stalled", "nothing listening"])
def test_a_dead_server_gives_misses_without_blocking(nodes, server, fault):
    """After the fault, stores are dropped and look-ups settle on MISS; every manager call
    returns within CALL_BOUND although each server call waits up to a second."""
    url = server.url if fault != "nothing listening" else f"redis://127.0.0.1:{free_port()}/0"
    a = Node(remote(url), chunks=16)
    nodes.append(a)
    blocks = {key(i): block(i) for i in range(6)}
    if fault == "killed":
        server.kill()
    elif fault == "stalled":
        server.pause()
    a.slowest = 0.0
    a.store(blocks)
    a.settle(timeout=30)
    st = a.tier.tier_stats()
    assert st.puts == 6 and st.dropped_puts == 6
    a.forget_primary()
    assert a.load(list(blocks)) == dict.fromkeys(blocks)
    assert a.slowest < CALL_BOUND, a.slowest


def test_a_load_that_meets_a_dead_server_fails_cleanly(nodes, server):
    """B's look-up found the chunks (HIT, promotion queued); the server dies before the
    load: the promotion fails, the chunks read as MISS, no row is served."""
    a = Node(remote(server.url), chunks=8)
    b = Node(remote(server.url), chunks=8)
    nodes += [a, b]
    blocks = {key(i): block(i) for i in range(3)}
    a.store(blocks)
    a.settle()
    b.slowest = 0.0
    ks = list(blocks)
    # Bounded by time, not by a count of tries: on a loaded machine the background presence
    # check (RETRY until it answers) can take longer than thousands of quick look-ups.
    deadline = time.monotonic() + 30
    while True:
        res = [b.call(b.m.lookup, k, b.ctx) for k in ks]
        if all(r is LookupResult.HIT_PENDING for r in res):
            break  # promotions initiated, submitted at the step's end
        if time.monotonic() > deadline:
            pytest.fail(f"no promotion started: {res}")
        if LookupResult.HIT_PENDING not in res:  # no step while some are queued: it loads them
            b.step()
        time.sleep(0.001)
    server.kill()
    rows_before = b.rows.copy()
    assert b.resolve(ks) == [LookupResult.MISS] * 3
    assert np.array_equal(b.rows, rows_before)  # nothing was written
    assert b.slowest < CALL_BOUND


def test_a_full_server_drops_stores_and_serves_the_rest(nodes, tmp_path):
    """maxmemory 2 MB, noeviction: of 40 chunks of 64 KiB, those past the limit are
    dropped (OOM replies); the other engine loads the stored ones up to the first dropped,
    exact, and misses the rest."""
    args = ["--maxmemory", "2mb", "--maxmemory-policy", "noeviction"]
    with running_server(server_binary("redis"), tmp_path / "full", args) as srv:
        row = 64 << 10
        a = Node(remote(srv.url), chunks=48, row_bytes=row)
        b = Node(remote(srv.url), chunks=48, row_bytes=row)
        nodes += [a, b]
        blocks = {key(i): block(i, row) for i in range(40)}
        for lo in range(0, 40, 8):
            a.store(dict(list(blocks.items())[lo : lo + 8]))
            a.settle()
        st = a.tier.tier_stats()
        assert 0 < st.dropped_puts < 40 and st.puts == 40
        got = b.load(list(blocks))
        served = {k: v for k, v in got.items() if v is not None}
        assert served and all(served[k] == blocks[k] for k in served)
        # Which landed (the two workers' puts interleave as the memory fills): a look-up
        # serves the leading run of them, the prefix a request can use.
        store = a.tier.tier_store
        landed = [store.count_present([tier_key(k)]) == 1 for k in blocks]
        assert sum(landed) == 40 - st.dropped_puts
        lead = landed.index(False)
        assert list(served) == list(blocks)[:lead]
        assert max(a.slowest, b.slowest) < CALL_BOUND


def test_a_request_gone_before_its_lookups_were_sent_strands_nothing(nodes, server):
    """A request asks (RETRY) and finishes before the step that would send its questions;
    the next request asking for the same keys gets its answer."""
    a = Node(remote(server.url), chunks=8)
    b = Node(remote(server.url), chunks=8)
    nodes += [a, b]
    a.store({key(1): block(1)})
    a.settle()
    assert b.call(b.m.lookup, key(1), b.ctx) is LookupResult.RETRY
    b.m.on_request_finished(b.ctx)  # no step in between: the question was never sent
    b.ctx = ReqContext("second")
    b.m.on_new_request(b.ctx)
    assert b.load([key(1)]) == {key(1): block(1)}


def test_two_engines_share_a_cluster(nodes, tmp_path):
    """``redis_cluster: true``: chunks spread over a three-node Redis Cluster's slots; the
    other engine loads them all, exact."""
    with running_cluster(server_binary("redis"), tmp_path / "cluster") as cluster:
        a = Node(remote(cluster.url, redis_cluster=True), chunks=16)
        b = Node(remote(cluster.url, redis_cluster=True), chunks=16)
        nodes += [a, b]
        blocks = {key(i): block(i) for i in range(12)}
        a.store(blocks)
        a.settle()
        assert a.tier.tier_stats().dropped_puts == 0
        owners = {cluster.owner(a.tier.tier_store.key_name(tier_key(k))) for k in blocks}
        assert len(owners) > 1  # the chunks really are spread over several nodes
        assert b.load(list(blocks)) == blocks
        assert max(a.slowest, b.slowest) < CALL_BOUND
