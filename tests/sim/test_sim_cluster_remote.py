"""`simulate --nodes N --remote URL`: the nodes share a real Redis server on loopback
(tests/support/redis_fixtures.py), in one namespace, and get exactly the hits the
in-process shared store gives when neither evicts; with `--cluster-tier per-node` each node
has a namespace of its own on the server and no cross-node hit.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pagedkv.__main__ import main
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
