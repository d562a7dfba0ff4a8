"""vLLM's OpenAI server, stock and with `PAGEDKV_VLLM_SCHEDULER=1` (the variable alone: no
scheduler flag), side by side: the probe that only pagedkv's manager answers with a 32-token
hit, concurrent clients with identical token ids, streams dropped mid-generation (vLLM
aborts them) and every block back afterwards."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from conftest import KINDS, subprocess_env
from vllm_engine import probe, prompts
from vllm_engine.server import NUM_BLOCKS, Server

pytestmark = pytest.mark.engine


def _session(server: Server) -> dict[str, Any]:
    out: dict[str, Any] = {}
    # The probe first: it needs an empty cache.
    out["probe"] = {
        name: server.complete(p, 1)["cached"] for name, p in probe.requests(NUM_BLOCKS - 1)
    }
    batch = prompts.shared_prefixes(seed=11, groups=3, per_group=8, prefix=2 * prompts.BLOCK)
    with ThreadPoolExecutor(max_workers=24) as pool:
        out["concurrent"] = [r["tokens"] for r in pool.map(lambda p: server.complete(p, 16), batch)]
    cut = prompts.distinct(seed=12, count=8, lo=40, hi=90)
    with ThreadPoolExecutor(max_workers=8) as pool:
        out["streamed_chunks"] = list(
            pool.map(lambda p: server.stream_then_disconnect(p, 200, 3), cut)
        )
    # vLLM frees an aborted request's blocks once it sees the disconnect.
    deadline = time.monotonic() + 30
    while server.metric("vllm:kv_cache_usage_perc") > 0 and time.monotonic() < deadline:
        time.sleep(0.5)
    out["usage_after_aborts"] = server.metric("vllm:kv_cache_usage_perc")
    out["after"] = [server.complete(p, 8)["tokens"] for p in cut]
    return out


@pytest.fixture(scope="module")
def sessions(models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory):
    logs = tmp_path_factory.mktemp("server")
    servers = {k: Server(models["plain"], subprocess_env(k), logs / f"{k}.log") for k in KINDS}
    try:
        for s in servers.values():
            s.wait_ready()
        return {k: _session(s) for k, s in servers.items()}
    finally:
        for s in servers.values():
            s.stop()


def test_the_variable_alone_runs_pagedkv_in_the_server(sessions):
    for kind in KINDS:
        assert sessions[kind]["probe"]["D"] == probe.EXPECTED_D_HIT[kind], sessions[kind]["probe"]


def test_concurrent_clients_get_identical_tokens(sessions):
    stock, ours = sessions["stock"]["concurrent"], sessions["pagedkv"]["concurrent"]
    assert len(ours) == 24 and all(len(t) == 16 for t in ours)
    assert ours == stock


def test_dropped_streams_free_their_blocks(sessions):
    for kind in KINDS:
        s = sessions[kind]
        assert all(n == 3 for n in s["streamed_chunks"])
        assert s["usage_after_aborts"] == 0.0, kind
    assert sessions["pagedkv"]["after"] == sessions["stock"]["after"]
