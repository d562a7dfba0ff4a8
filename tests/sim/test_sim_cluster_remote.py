"""`simulate --nodes N --remote URL`: the nodes share a real Redis server on loopback
(tests/support/redis_fixtures.py), in one namespace, and get exactly the hits the
in-process shared store gives when neither evicts; with `--cluster-tier per-node` each node
has a namespace of its own on the server and no cross-node hit.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pagedkv.__main__ import main
from pagedkv.sim.cluster import ClusterOptions, build_stores
from pagedkv.tiers.base import TierKey
from redis_fixtures import ServerProcess, running_server, server_binary

pytestmark = pytest.mark.slow  # a real server and several hundred round trips a run

BASE = [
    "simulate",
    "--no-progress",
    "--requests",
    "60",
    "--doc-tokens",
    "2048",
    "--num-blocks",
    "128",
    "--nodes",
    "3",
    "--routing",
    "least-loaded",
]
COMPARED = (
    "workload_hit_tokens",
    "tier_tokens",
    "tier_tokens_cross",
    "tier_tokens_by_origin",
    "blocks_demoted",
    "blocks_promoted",
    "preemptions",
)


@pytest.fixture
def server(tmp_path: Path) -> Iterator[ServerProcess]:
    with running_server(server_binary("redis"), tmp_path / "server") as s:
        yield s


def _doc(capsys: pytest.CaptureFixture[str], path: Path, *argv: str) -> dict[str, Any]:
    rc = main([*BASE, *argv, "--json", str(path)])
    err = capsys.readouterr().err
    assert rc == 0, err
    doc: dict[str, Any] = json.loads(path.read_text())
    return doc


def _namespaces(server: ServerProcess) -> set[str]:
    client = server.client()
    return {k.decode().split(":")[1] for k in client.scan_iter("pagedkv:*", count=1000)}


def test_a_shared_redis_gives_the_hits_of_the_in_process_store(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, server: ServerProcess
) -> None:
    local = _doc(capsys, tmp_path / "local.json", "--shared-tier-bytes", "1TiB")
    remote = _doc(capsys, tmp_path / "remote.json", "--remote", server.url)
    assert local["stores"][0]["evictions"] == 0  # neither store evicted: same contents
    for a, b in zip(local["nodes"], remote["nodes"], strict=True):
        for key in COMPARED:
            assert a[key] == b[key], key
    total = remote["total"]
    assert total["tier_tokens_cross"] > 0
    (store,) = remote["stores"]
    assert store["medium"] == "REMOTE" and store["errors"] == 0 and store["corrupt"] == 0
    assert store["hits"] == total["blocks_promoted"]
    # Every node wrote into one namespace on the server.
    assert len(_namespaces(server)) == 1
    # The server holds the blocks the in-process store held at the end, no more, no less.
    assert server.client().dbsize() == local["stores"][0]["entries"]


def test_per_node_namespaces_on_redis_share_nothing(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, server: ServerProcess
) -> None:
    doc = _doc(capsys, tmp_path / "p.json", "--remote", server.url, "--cluster-tier", "per-node")
    assert doc["total"]["tier_tokens_cross"] == 0
    assert doc["total"]["tier_tokens"] > 0  # each node still reads back its own blocks
    assert len(doc["stores"]) == 3
    assert len(_namespaces(server)) == 3


def _keys(server: ServerProcess) -> set[bytes]:
    return set(server.client().scan_iter("*", count=1000))


def test_a_run_says_where_its_keys_stay_and_cleanup_deletes_them(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, server: ServerProcess
) -> None:
    kept = _doc(capsys, tmp_path / "kept.json", "--remote", server.url)
    (store,) = kept["stores"]
    prefix = store["key_prefix"]
    before = _keys(server)
    assert before and all(k.decode().startswith(prefix) for k in before)
    assert store["deleted_keys"] is None and store["ttl_s"] == 3600.0
    assert all(0 < server.client().pttl(k) <= 3_600_000 for k in list(before)[:20])

    rc = main([*BASE, "--remote", server.url, "--remote-cleanup", "--json", str(tmp_path / "c")])
    out = capsys.readouterr().out
    assert rc == 0
    (cleaned,) = json.loads((tmp_path / "c").read_text())["stores"]
    assert cleaned["key_prefix"] != prefix  # a run of its own: another namespace
    assert cleaned["deleted_keys"] > 0
    assert f"--remote-cleanup deleted this run's {cleaned['deleted_keys']} keys" in out
    assert _keys(server) == before  # its own keys gone, the earlier run's untouched


def test_the_kept_keys_line_names_their_prefix(
    capsys: pytest.CaptureFixture[str], server: ServerProcess
) -> None:
    assert main([*BASE, "--remote", server.url]) == 0
    out = capsys.readouterr().out
    key = next(iter(_keys(server))).decode()
    prefix = key[: key.index(":", len("pagedkv:")) + 1]  # pagedkv:{namespace id}:
    assert f"this run's keys stay on the server ({prefix}*), each expiring 3600 s" in out
    assert "--remote-cleanup deletes them at the end" in out


def test_remote_timeout_bounds_each_reply(server: ServerProcess) -> None:
    """A stalled server: a put waits --remote-timeout, not the default half second."""
    options = ClusterOptions(2, remote=server.url, remote_timeout=0.05)
    (store, _) = build_stores(options, 16)
    try:
        assert store.put(TierKey(0, bytes(32)), b"ab")  # the server answers: stored
        server.pause()
        t0 = time.perf_counter()
        assert not store.put(TierKey(0, bytes([1]) * 32), b"ab")
        assert time.perf_counter() - t0 < 0.3
        assert store.stats().dropped_puts == 1 and store.stats().errors == 1
    finally:
        server.resume()
        store.close()  # type: ignore[attr-defined]  # a RemoteTier's


def test_dropped_puts_and_errors_are_explained(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """No server at the address: every put is dropped, and the output says what that means
    and which timeout applied."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again below: nothing listens there
    url = f"redis://127.0.0.1:{port}/0"
    doc = _doc(capsys, tmp_path / "d.json", "--remote", url, "--remote-timeout", "0.2")
    (store,) = doc["stores"]
    assert store["dropped_puts"] > 0 and store["errors"] > 0 and store["timeout_s"] == 0.2
    rc = main([*BASE, "--remote", url, "--remote-timeout", "0.2"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "dropped puts are blocks the server did not store: it did not reply within " in out
    assert "--remote-timeout (0.2 s), refused or reset the connection" in out
