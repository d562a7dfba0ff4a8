"""The real CPU engine's KV event stream (stock vLLM 0.32's own ZMQ publisher, integer
hashes) followed by `pagedkv.router.RouterIndex.follow`: after every round of prompts with
shared prefixes in a pool small enough to evict, the index holds exactly the engine's cached
blocks (read from its block pool, in process); and for probe prompts, the index's leading
blocks for the prompt's hashes (vLLM's own hash function) are the hit the engine then
serves (`num_cached_tokens`, capped below the prompt's length)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from conftest import subprocess_env
from vllm_engine.prompts import BLOCK

pytestmark = pytest.mark.engine


@pytest.fixture(scope="session")
def router_run(models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("router") / "router.json"
    log = out.with_suffix(".log")
    cmd = [sys.executable, "-m", "vllm_engine.router_events", "--model", str(models["plain"])]
    with log.open("w") as fh:
        proc = subprocess.run(
            [*cmd, "--out", str(out)],
            env=subprocess_env("stock"),
            stdout=fh,
            stderr=subprocess.STDOUT,
            timeout=600,
            check=False,
        )
    if proc.returncode != 0 or not out.exists():
        raise AssertionError(f"router run failed ({proc.returncode}):\n{log.read_text()[-4000:]}")
    result: dict[str, Any] = json.loads(out.read_text())
    assert "error" not in result, result.get("traceback", result.get("error"))
    return result


def test_the_index_equals_the_engines_cached_blocks(router_run: dict[str, Any]) -> None:
    rounds = router_run["rounds"]
    assert len(rounds) == 4
    for r in rounds:
        assert r["synced"], r
        assert (r["only_engine"], r["only_index"]) == (0, 0), r
        assert r["engine"] == r["index"] > 0, r
    assert router_run["evicted"] > 0  # the pool evicted, and the removals were followed
    assert router_run["follower"]["batches"] > 0
    assert (router_run["follower"]["lost"], router_run["follower"]["bad_payloads"]) == (0, 0)
    assert router_run["index"] == {"rejected_payloads": 0, "orphans": 0}


def test_match_predicts_the_engines_next_hit(router_run: dict[str, Any]) -> None:
    probes = router_run["probes"]
    for p in probes:
        assert p["num_cached_tokens"] == min(p["predicted_blocks"], p["cap_blocks"]) * BLOCK, p
    predicted = [p["predicted_blocks"] for p in probes]
    assert 0 in predicted and max(predicted) > 3  # misses, head hits and longer hits
