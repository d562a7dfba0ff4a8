"""Benchmarks of the tier codecs and the host tiers on KV written by the CPU pool (the
small shape of benches/tier_codec.py: a random-weights decoder's decode loop, bf16).

`pytest benches/test_bench_tier_codec.py` times them; CI runs each once as a test
(`--benchmark-disable`). The full table with ratios, GB/s and the data's description:
`python benches/tier_codec.py --out benches/results/tier_codec-<machine>-<date>.md`.
"""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("torch")
pytest.importorskip("lz4")

import tier_codec  # benches/ is on sys.path: pytest puts the test file's folder there
from pagedkv.tiers import codec as C
from pagedkv.tiers.base import TierKey
from pagedkv.tiers.entry import Namespace
from pagedkv.tiers.host import CompressedHostTier, HostTier

NS = Namespace("bench", "small", "bfloat16", 16)


@pytest.fixture(scope="module")
def blocks() -> list[bytes]:
    """The full blocks of the small random-weights decoder's loop on a bf16 CPU pool."""
    return tier_codec.transformer_blocks("bfloat16", tier_codec.SMALL)


@pytest.mark.parametrize("name", list(tier_codec.CODECS))
def test_codec_encode(benchmark: Any, blocks: list[bytes], name: str) -> None:
    benchmark.group = "tier codec: encode the small bf16 blocks"
    codec = tier_codec.CODECS[name]()
    encs = benchmark(lambda: [codec.encode(b) for b in blocks])
    for e, b in zip(encs, blocks, strict=True):
        assert C.decode(e.codec_id, e.item_size, e.payload, len(b)) == b


@pytest.mark.parametrize("name", list(tier_codec.CODECS))
def test_codec_decode(benchmark: Any, blocks: list[bytes], name: str) -> None:
    benchmark.group = "tier codec: decode the small bf16 blocks"
    codec = tier_codec.CODECS[name]()
    encs = [(e.codec_id, e.item_size, memoryview(e.payload), len(b)) for e, b in
            zip((codec.encode(b) for b in blocks), blocks, strict=True)]  # fmt: skip
    out = benchmark(lambda: [C.decode(*e) for e in encs])
    assert out == blocks


def test_shuffle_pays_on_bf16_kv(blocks: list[bytes]) -> None:
    """The figure the compressed tier's default rests on: shuffled lz4 compresses this
    bf16 KV (about 1.16x on the small shape, 1.28x on the full one) where plain lz4
    barely does."""
    row = tier_codec.measure_codec("shuffle2+lz4", blocks, 1)
    plain = tier_codec.measure_codec("lz4", blocks, 1)
    assert row.ratio > 1.08 and row.ratio > plain.ratio + 0.05, (row, plain)
    assert 1.3 < tier_codec.entropy_ratio(blocks) < 1.7


@pytest.mark.parametrize("tier", ["HostTier", "CompressedHostTier"])
def test_tier_put_get(benchmark: Any, blocks: list[bytes], tier: str) -> None:
    """A put and a get of every block (framing, MAC and codec included)."""
    benchmark.group = "host tiers: put + get the small bf16 blocks"
    raw = sum(len(b) for b in blocks)
    keys = [TierKey(0, i.to_bytes(8, "little")) for i in range(len(blocks))]
    t = HostTier(4 * raw, NS) if tier == "HostTier" else CompressedHostTier(4 * raw, NS)

    def run() -> list[bytes | None]:
        for k, b in zip(keys, blocks, strict=True):
            t.put(k, b)
        return [t.get(k) for k in keys]

    assert benchmark(run) == blocks
    st = t.stats()
    assert st.corrupt == 0 and st.dropped_puts == 0
    if tier == "CompressedHostTier":
        assert st.compression_ratio > 1.05
