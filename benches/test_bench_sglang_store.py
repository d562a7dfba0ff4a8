"""Store and load throughput of pagedkv's host tier through SGLang's interface
(`PagedKVStore.batch_set_v1` / `batch_get_v1` out of and into SGLang's own MHA host pool,
bf16, page_first layout) next to the tier's own calls (`HostTier.put` / `get` of the same
pages' bytes), per page size. The difference is what the SGLang path adds: copying each page
out of and into the host pool, and deriving the keys.

`pytest benches/test_bench_sglang_store.py` times them (pytest-benchmark, one group per page
size); CI runs each once as a test (`--benchmark-disable`). The table in GB/s:
`PYTHONPATH=python python benches/test_bench_sglang_store.py [--repeat 5]`.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

if importlib.util.find_spec("sglang") is None:  # an installed but broken SGLang fails
    pytest.importorskip("sglang", reason="SGLang 0.5.23 is not installed")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "support"))
import sglang_objects as so
from pagedkv.tiers.base import TierKey
from pagedkv.tiers.entry import Namespace
from pagedkv.tiers.host import HostTier

PAGES = 32
#: Tokens per page -> page bytes, with 8 layers x 4 KV heads x 64 dims in bf16, K and V.
PAGE_TOKENS = {"64KiB": 4, "256KiB": 16, "1MiB": 64}
PATHS = ("sglang set_v1", "sglang get_v1", "tier put", "tier get")


class Setup:
    """One page size: an SGLang pool of random KV, a PagedKVStore over a raw host tier made
    by SGLang's factory, a bare HostTier, and the same pages' bytes."""

    def __init__(self, tokens: int) -> None:
        self.pool = so.host_pool(layers=8, heads=4, head_dim=64, page_size=tokens, pages=PAGES)
        so.fill_pages(self.pool, seed=tokens)
        self.page_bytes = len(so.page_of(self.pool, 0))
        budget = 2 * PAGES * (self.page_bytes + 4096)
        self.store = so.make_store(self.pool, so.dynamic_extra(host_bytes=budget))
        self.keys = so.keys(PAGES, f"bench{tokens}-")
        self.src = so.indices(list(range(PAGES)), tokens)
        self.dst = so.indices(list(range(PAGES)), tokens)
        self.blocks = [so.page_of(self.pool, p) for p in range(PAGES)]
        ns = Namespace("bench", "sglang-pages", "bfloat16", tokens)
        self.tier = HostTier(budget, ns)
        self.tier_keys = [TierKey(0, bytes.fromhex(k)) for k in self.keys]

    def run(self, path: str) -> Callable[[], Any]:
        if path == "sglang set_v1":
            return lambda: self.store.batch_set_v1(self.keys, self.src)
        if path == "sglang get_v1":
            self.store.batch_set_v1(self.keys, self.src)
            return lambda: self.store.batch_get_v1(self.keys, self.dst)
        if path == "tier put":
            return lambda: [
                self.tier.put(k, b) for k, b in zip(self.tier_keys, self.blocks, strict=True)
            ]
        if path == "tier get":
            for k, b in zip(self.tier_keys, self.blocks, strict=True):
                self.tier.put(k, b)
            return lambda: [self.tier.get(k) for k in self.tier_keys]
        raise ValueError(path)

    def check(self, path: str, result: list[Any]) -> None:
        if path.startswith("sglang"):
            assert result == [True] * PAGES
            if path == "sglang get_v1":
                assert [so.page_of(self.pool, p) for p in range(PAGES)] == self.blocks
        elif path == "tier put":
            assert result == [True] * PAGES
        else:
            assert result == self.blocks


_SETUPS: dict[str, Setup] = {}


def setup_for(size: str) -> Setup:
    if size not in _SETUPS:
        _SETUPS[size] = Setup(PAGE_TOKENS[size])
    return _SETUPS[size]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("size", list(PAGE_TOKENS))
def test_sglang_store_throughput(benchmark: Any, size: str, path: str) -> None:
    s = setup_for(size)
    benchmark.group = f"sglang store: {PAGES} pages of {size}"
    fn = s.run(path)
    result = benchmark(fn)
    s.check(path, result)
    benchmark.extra_info["bytes"] = PAGES * s.page_bytes


def table(repeat: int) -> str:
    """Best-of-`repeat` GB/s (10^9 bytes) of each path per page size, as Markdown."""
    rows = ["| page | " + " | ".join(PATHS) + " |", "|---|" + "---:|" * len(PATHS)]
    for size in PAGE_TOKENS:
        s = setup_for(size)
        cells = []
        for path in PATHS:
            fn = s.run(path)
            best = min(_timed(fn) for _ in range(repeat))
            s.check(path, fn())
            cells.append(f"{PAGES * s.page_bytes / best / 1e9:.2f}")
        rows.append(f"| {size} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def _timed(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=5)
    print(table(ap.parse_args().repeat))
