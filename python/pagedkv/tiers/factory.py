"""Tier stores built from one spec (docs/tiers.md, "Building the stores"): the one place that
turns "a host tier of N bytes through codec C, and a Redis tier at URL" into `HostTier`,
`CompressedHostTier` and `RemoteTier` objects. The simulator, `pagedkv.vllm.PagedKVTier` and
`pagedkv.sglang.PagedKVStore` read their own options and build their stores here.

`build_stores(spec, namespace)` returns them top down: the host tier (raw for codec "raw",
else compressed), then the remote tier; redis-py is imported only when a URL is given.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedkv.tiers import codec as C
from pagedkv.tiers.base import TierStore
from pagedkv.tiers.entry import Namespace
from pagedkv.tiers.host import CompressedHostTier, HostTier, item_size_of


@dataclass(frozen=True)
class StoreSpec:
    """Which stores to build.

    `host_bytes`: a host tier of that budget (None: none); `codec`: its codec by name
    (`codec.codec_by_name`: "raw", "lz4", "shuffle+lz4"); `host_secret`: its MAC secret (None:
    the process's random one). `redis_url`, `redis_cluster`: a remote tier (None: none);
    `remote_codec`: its codec (None: the host tier's `codec`; "raw" stores raw); `secret`: its
    MAC secret, required with a URL; `timeout`, `connect_timeout`, `retry_after`, `ttl`: as
    `RemoteTier`'s. `item_size`: the byte shuffle's element size (None: the namespace
    dtype's)."""

    host_bytes: int | None = None
    codec: str = "raw"
    host_secret: bytes | None = None
    redis_url: str | None = None
    redis_cluster: bool = False
    remote_codec: str | None = None
    secret: bytes | None = None
    timeout: float = 0.5
    connect_timeout: float = 1.0
    retry_after: float = 1.0
    ttl: float | None = None
    item_size: int | None = None

    def __repr__(self) -> str:  # the secrets never appear
        return (
            f"StoreSpec(host_bytes={self.host_bytes}, codec={self.codec!r}, "
            f"redis_url={self.redis_url!r}, redis_cluster={self.redis_cluster}, "
            f"remote_codec={self.remote_codec!r}, timeout={self.timeout}, ttl={self.ttl})"
        )


def build_stores(spec: StoreSpec, namespace: Namespace) -> list[TierStore]:
    """The stores `spec` names, top down (module docstring); ValueError when it names none,
    or a remote tier without its secret."""
    item = item_size_of(namespace.dtype) if spec.item_size is None else spec.item_size
    stores: list[TierStore] = []
    if spec.host_bytes is not None:
        codec = C.codec_by_name(spec.codec, item)
        if codec.codec_id == C.RAW:
            stores.append(HostTier(spec.host_bytes, namespace, secret=spec.host_secret))
        else:
            stores.append(
                CompressedHostTier(spec.host_bytes, namespace, codec, secret=spec.host_secret)
            )
    if spec.redis_url is not None:
        if spec.secret is None:
            raise ValueError("a remote tier needs the MAC secret its nodes share (secret=)")
        from pagedkv.tiers.remote import RemoteTier  # redis-py only when a server is named

        name = spec.codec if spec.remote_codec is None else spec.remote_codec
        remote = C.codec_by_name(name, item)
        stores.append(
            RemoteTier(
                spec.redis_url,
                namespace,
                secret=spec.secret,
                timeout=spec.timeout,
                connect_timeout=spec.connect_timeout,
                retry_after=spec.retry_after,
                ttl=spec.ttl,
                cluster=spec.redis_cluster,
                codec=None if remote.codec_id == C.RAW else remote,
            )
        )
    if not stores:
        raise ValueError("a tier spec needs host_bytes or redis_url (or both)")
    return stores


__all__ = ["StoreSpec", "build_stores"]
