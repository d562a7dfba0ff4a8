"""`tiers.factory`: the one place tier stores are built from a spec (the simulator,
`pagedkv.vllm.PagedKVTier` and `pagedkv.sglang.PagedKVStore` build theirs here)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from pagedkv.tiers import Namespace, TierKey
from pagedkv.tiers.codec import LZ4, SHUFFLE_LZ4
from pagedkv.tiers.factory import StoreSpec, build_stores
from pagedkv.tiers.host import CompressedHostTier, HostTier

NS = Namespace("factory", "1x1x4", "float32", 4)
SECRET = b"factory-test-secret-0123456789ab"


def test_host_stores() -> None:
    (raw,) = build_stores(StoreSpec(host_bytes=1 << 20), NS)
    assert type(raw) is HostTier and raw.budget_bytes == 1 << 20
    (packed,) = build_stores(StoreSpec(host_bytes=4096, codec="shuffle+lz4"), NS)
    assert isinstance(packed, CompressedHostTier) and packed.codec.codec_id == SHUFFLE_LZ4
    assert packed.codec.item_size == 4, "the namespace's dtype (float32) by default"
    (two,) = build_stores(StoreSpec(host_bytes=4096, codec="shuffle+lz4", item_size=2), NS)
    assert isinstance(two, CompressedHostTier) and two.codec.item_size == 2
    (lz4,) = build_stores(StoreSpec(host_bytes=4096, codec="lz4"), NS)
    assert isinstance(lz4, CompressedHostTier) and lz4.codec.codec_id == LZ4
    host = build_stores(StoreSpec(host_bytes=4096, host_secret=SECRET), NS)[0]
    assert host.put(TierKey(0, b"d"), b"kv") and host.get(TierKey(0, b"d")) == b"kv"


def test_bad_specs_raise() -> None:
    with pytest.raises(ValueError, match="host_bytes or redis_url"):
        build_stores(StoreSpec(), NS)
    with pytest.raises(ValueError, match="secret"):
        build_stores(StoreSpec(redis_url="redis://127.0.0.1:1/0"), NS)
    with pytest.raises(ValueError, match="unknown codec"):
        build_stores(StoreSpec(host_bytes=4096, codec="zip"), NS)
    spec = StoreSpec(redis_url="redis://x", secret=SECRET, host_secret=SECRET)
    assert SECRET.hex() not in repr(spec) and str(SECRET) not in repr(spec)


@pytest.fixture
def redis_url(tmp_path: Path) -> Iterator[str]:
    from redis_fixtures import running_server, server_binary

    with running_server(server_binary("redis"), tmp_path / "server") as s:
        yield s.url


def test_host_then_remote(redis_url: str) -> None:
    from pagedkv.tiers.remote import RemoteTier

    spec = StoreSpec(
        host_bytes=4096, codec="lz4", redis_url=redis_url, secret=SECRET, timeout=0.3, ttl=60.0
    )
    host, remote = build_stores(spec, NS)
    assert isinstance(host, CompressedHostTier) and isinstance(remote, RemoteTier)
    assert remote.codec is not None and remote.codec.codec_id == LZ4, "remote_codec: codec's"
    (plain,) = build_stores(StoreSpec(redis_url=redis_url, secret=SECRET, codec="lz4",
                                      remote_codec="raw"), NS)  # fmt: skip
    assert isinstance(plain, RemoteTier) and plain.codec is None
    assert remote.put(TierKey(0, b"d"), b"kv" * 100) and plain.get(TierKey(0, b"d")) == b"kv" * 100
    for store in (remote, plain):
        store.close()
