"""Store and load throughput of pagedkv's tiers through vLLM 0.33's interface (its real
TieringOffloadingManager with PagedKVTier below its CPU tier) next to pagedkv's own calls
(the same store's put and get) on the same blocks, per block size (docs/tiers.md).

- `vllm store`: the cascade of 32 chunks already in vLLM's CPU tier into PagedKVTier
  (`complete_store`, then steps until the tier reports the jobs done): the snapshot copy
  on the scheduler thread, then the workers' encode, MAC and put.
- `vllm load`: 32 chunks that vLLM's CPU tier no longer holds, looked up, promoted from
  PagedKVTier and reported done (steps until every look-up is a HIT).
- `pagedkv put` / `pagedkv get`: the same store's `put` and `get` of those 32 blocks in
  one thread.

The blocks are bf16 values of a normal distribution (the high bytes compress under
shuffle + lz4, as KV does). `pytest benches/test_bench_vllm_tier.py` times them; CI runs
each once (`--benchmark-disable`). The table of GB/s:

    PYTHONPATH=python:tests/support:testing python benches/test_bench_vllm_tier.py \
        [--repeat 5] [--redis redis://127.0.0.1:6379/0]
"""

from __future__ import annotations

import argparse
import os
import secrets
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import vllm_env

vllm_env.prepare()  # before vLLM is first imported (benches/conftest.py did it under pytest)
pytest.importorskip("vllm")
pytest.importorskip("lz4")

from vllm.v1.kv_offload.base import LookupResult  # noqa: E402 (after vLLM's environment)

from pagedkv.tiers.base import TierKey  # noqa: E402 (after vLLM's environment)
from pagedkv.vllm.tier import tier_key  # noqa: E402 (after vLLM's environment)
from vllm_tiering import Node, key  # noqa: E402 (after vLLM's environment)

SIZES = (16 << 10, 128 << 10, 1 << 20)
N = 32
CODECS = {"raw": {}, "shuffle+lz4": {"codec": "shuffle+lz4"}}


def kv_blocks(n: int, size: int, seed: int = 0) -> list[bytes]:
    """`n` blocks of `size` bytes of bf16 N(0, 1) values."""
    rng = np.random.default_rng(seed)
    f32 = rng.standard_normal(n * size // 2, dtype=np.float32)
    bf16 = (f32.view(np.uint32) >> 16).astype(np.uint16)
    return [bf16[i * size // 2 : (i + 1) * size // 2].tobytes() for i in range(n)]


class Rig:
    """One engine (a `Node`) with a PagedKVTier on `opts`, and a fresh set of keys per
    store round, so that no store is skipped as present."""

    def __init__(self, size: int, opts: dict[str, Any]) -> None:
        budget = {"host_bytes": 4 * N * (size + 128)} if "redis_url" not in opts else {}
        self.node = Node({**budget, **opts}, chunks=N, row_bytes=size)
        self.blocks = kv_blocks(N, size)
        self.round = 0
        self.keys: list[bytes] = []
        self.pending: list[bytes] = []

    # vLLM's interface: the timed parts, and what each round needs done before them

    def stage_store(self) -> None:
        """Empty the CPU tier and put fresh chunks in it, as a GPU offload would."""
        n = self.node
        n.forget_primary()
        self.round += 1
        keys = [key(self.round * 1000 + i) for i in range(N)]
        out = n.m.prepare_store(keys, n.ctx)
        assert out is not None and len(out.keys_to_store) == N
        for i, cid in enumerate(out.store_spec.block_ids):
            n.rows[cid] = np.frombuffer(self.blocks[i], dtype=np.uint8)
        self.pending = list(out.keys_to_store)

    def vllm_store(self) -> None:
        self.node.m.complete_store(self.pending, self.node.ctx)
        self.node.settle(poll=0.0)
        self.keys = self.pending

    def stage_load(self) -> None:
        if not self.keys:
            self.stage_store()
            self.vllm_store()
        self.node.forget_primary()

    def vllm_load(self) -> None:
        res = self.node.resolve(self.keys, poll=0.0)
        assert res == [LookupResult.HIT] * N, res

    # pagedkv's own calls on the same store

    def tier_keys(self) -> list[TierKey]:
        return [tier_key(k) or TierKey(0, b"") for k in self.keys]

    def pagedkv_put(self) -> None:
        store = self.node.tier.tier_store
        for k, b in zip(self.tier_keys(), self.blocks, strict=True):
            assert store.put(k, b)

    def pagedkv_get(self) -> None:
        store = self.node.tier.tier_store
        for k in self.tier_keys():
            assert store.get(k) is not None

    def close(self) -> None:
        self.node.close()


@pytest.fixture(params=SIZES, ids=[f"{s >> 10}KiB" for s in SIZES])
def size(request: pytest.FixtureRequest) -> int:
    return int(request.param)


@pytest.fixture(params=list(CODECS))
def rig(request: pytest.FixtureRequest, size: int) -> Any:
    r = Rig(size, dict(CODECS[request.param]))
    yield r
    r.close()


def _gbps(benchmark: Any, size: int) -> None:
    stats = getattr(getattr(benchmark, "stats", None), "stats", None)
    mean = getattr(stats, "mean", None)
    if mean:
        benchmark.extra_info["GB/s"] = round(N * size / mean / 1e9, 3)


def test_vllm_store(benchmark, rig, size):
    benchmark.group = f"vllm tier store, {size >> 10} KiB"
    benchmark.pedantic(rig.vllm_store, setup=rig.stage_store, rounds=5, iterations=1)
    _gbps(benchmark, size)
    assert rig.node.tier.tier_stats().dropped_puts == 0


def test_vllm_load(benchmark, rig, size):
    benchmark.group = f"vllm tier load, {size >> 10} KiB"
    benchmark.pedantic(rig.vllm_load, setup=rig.stage_load, rounds=5, iterations=1)
    _gbps(benchmark, size)
    got = rig.node.fetch(rig.keys)
    assert got == rig.blocks


def test_pagedkv_put_get(benchmark, rig, size):
    benchmark.group = f"pagedkv store put+get, {size >> 10} KiB"
    rig.stage_store()
    rig.vllm_store()
    benchmark(lambda: (rig.pagedkv_put(), rig.pagedkv_get()))


# ---- the table ------------------------------------------------------------------------


def best(fn: Callable[[], None], stage: Callable[[], None] | None, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        if stage is not None:
            stage()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--redis", help="also a Redis tier at this URL (its data is overwritten)")
    args = ap.parse_args()
    os.environ.setdefault("PAGEDKV_TIER_SECRET", secrets.token_hex(32))
    stores = [(f"host {c}", o) for c, o in CODECS.items()]
    if args.redis:
        stores += [(f"redis {c}", {"redis_url": args.redis, **o}) for c, o in CODECS.items()]
    print("| store | block | vllm store | pagedkv put | vllm load | pagedkv get |")
    print("|---|---|---|---|---|---|")
    for name, opts in stores:
        for size in SIZES:
            r = Rig(size, dict(opts))
            try:
                ts = best(r.vllm_store, r.stage_store, args.repeat)
                tl = best(r.vllm_load, r.stage_load, args.repeat)
                tp = best(r.pagedkv_put, None, args.repeat)
                tg = best(r.pagedkv_get, None, args.repeat)
            finally:
                r.close()
            gb = [N * size / t / 1e9 for t in (ts, tp, tl, tg)]
            cells = " | ".join(f"{g:.2f} GB/s" for g in gb)
            print(f"| {name} | {size >> 10} KiB | {cells} |", flush=True)


if __name__ == "__main__":
    main()
