"""The snapshot rule of PagedKVTier under threads: a store keeps the bytes its rows held
when it was submitted, whatever is written to those rows afterwards; a load writes a row
only with a checked block and finishes after the write (docs/tiers.md, "Under stock vLLM").

Stores and loads are submitted to the tier (built by vLLM's factory) and polled as vLLM's
manager does, one call at a time, while the tier's worker threads run them and another
thread keeps rewriting the rows the stores were taken from, as a reused primary slot
would be. A sabotaged tier that reads its rows on the worker thread instead, later, is
caught by the same check."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from vllm.v1.kv_offload.tiering.base import TransferJob

from pagedkv.vllm import tier_jobs
from pagedkv.vllm.tier import tier_key
from vllm_tiering import Node, key

STORE_ROWS = range(32)  # what stores read, and the rewriter scribbles on
LOAD_ROWS = range(32, 64)  # what loads write into (nobody else writes there)


def late_gather(self: tier_jobs.TierWorkers, job_id: int, keys: Any, chunk_ids: np.ndarray) -> bool:
    """The sabotage: no copy on submission; the worker gathers the rows when it gets to
    the job (5 ms later here), so what it stores is whatever the rows hold by then."""
    cids = self._chunk_ids(chunk_ids, len(keys))
    with self._idle:
        self._running += 1
    job = tier_jobs._Job(job_id, False, len(keys), 0, 0)

    def part(lo: int, hi: int) -> None:
        time.sleep(0.005)
        assert self.rows is not None
        self._store_part(job, keys, self.rows[cids], lo, hi)

    self._split(job, part)
    return True


@pytest.fixture
def node(request: pytest.FixtureRequest) -> Iterator[Node]:
    n = Node(request.param, chunks=64)
    yield n
    n.close()


def run(node: Node, rounds: int = 30, batch: int = 6) -> tuple[dict[bytes, bytes], int, int]:
    """Stores and loads for `rounds` while a thread rewrites the store rows; returns the
    bytes each key's rows held when its store was submitted, the loads checked, and the
    loaded rows that differed from those bytes."""
    tier = node.tier
    rows = node.rows
    gate = threading.Lock()  # the rewriter stays out while a store is being submitted
    stop = threading.Event()

    def rewrite() -> None:
        rng = np.random.default_rng(1)
        while not stop.is_set():
            r = int(rng.integers(STORE_ROWS.start, STORE_ROWS.stop))
            with gate:
                rows[r] = rng.integers(0, 256, rows.shape[1], dtype=np.uint8)
            time.sleep(0)

    expected: dict[bytes, bytes] = {}
    stored: list[bytes] = []
    storing: dict[int, list[bytes]] = {}
    loading: dict[int, list[tuple[bytes, int]]] = {}
    free_loads = list(LOAD_ROWS)
    rng = np.random.default_rng(0)
    checked = wrong = 0
    job_id = 0
    writer = threading.Thread(target=rewrite, daemon=True)
    writer.start()
    try:
        for rnd in range(rounds + 2000):
            if rnd < rounds:  # a store of fresh keys from random store rows
                keys = [key(rnd * batch + i) for i in range(batch)]
                cids = rng.choice(STORE_ROWS, batch, replace=False)
                with gate:
                    for k, c in zip(keys, cids, strict=True):
                        rows[c] = rng.integers(0, 256, rows.shape[1], dtype=np.uint8)
                        expected[k] = rows[c].tobytes()
                    tier.submit_store(TransferJob(job_id, keys, cids, False, node.ctx))
                storing[job_id] = keys
                job_id += 1
            if stored and len(free_loads) >= batch and rnd < 2 * rounds:  # a load
                keys = [stored[int(i)] for i in rng.choice(len(stored), batch, replace=False)]
                cids = [free_loads.pop() for _ in keys]
                tier.submit_load(TransferJob(job_id, keys, np.array(cids), True, node.ctx))
                loading[job_id] = list(zip(keys, cids, strict=True))
                job_id += 1
            for res in tier.get_finished_jobs():
                if res.job_id in loading:
                    assert res.success, "a load of a stored key failed"
                    for k, c in loading.pop(res.job_id):
                        checked += 1
                        wrong += rows[c].tobytes() != expected[k]
                        free_loads.append(c)
                else:
                    assert res.success, "a store into a roomy host store failed"
                    stored += storing.pop(res.job_id)
            time.sleep(0.001)
            if rnd >= rounds and not loading and not storing:
                break
    finally:
        stop.set()
        writer.join()
    return expected, checked, wrong


HOST = {"host_bytes": 4 << 20}
LZ4 = {"host_bytes": 4 << 20, "codec": "lz4"}


def stored_bytes(node: Node, keys: list[bytes]) -> dict[bytes, bytes | None]:
    return {k: node.tier.tier_store.get(tier_key(k)) for k in keys}  # type: ignore[arg-type]


@pytest.mark.parametrize("node", [HOST, LZ4], ids=["raw", "lz4"], indirect=True)
def test_stores_keep_the_bytes_of_submission(node):
    expected, checked, wrong = run(node)
    assert len(expected) == 180 and checked > 0
    assert stored_bytes(node, list(expected)) == expected
    assert wrong == 0


@pytest.mark.parametrize("node", [HOST], ids=["raw"], indirect=True)
def test_the_check_catches_a_tier_that_copies_late(node, monkeypatch):
    monkeypatch.setattr(tier_jobs.TierWorkers, "store", late_gather)
    expected, _, _ = run(node, rounds=12)
    got = stored_bytes(node, list(expected))
    differ = sum(got[k] != expected[k] for k in expected)
    assert differ > 0, "the rewrites after submission went unnoticed"
