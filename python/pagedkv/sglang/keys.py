"""From SGLang's page keys to pagedkv's `TierKey`s (docs/tiers.md, "Under SGLang").

SGLang names a page by a string, its page hash (a chained SHA-256 of the page's tokens,
hex). The same string names the page's data in every host pool of a hybrid model (KV,
Mamba state, sliding window...), on every rank, and for every model, so the key alone
cannot keep those apart. Each stored page is therefore keyed by

    digest = SHA-256(b"pagedkv-sglang-1" | identity | pool format | page key)

with each part length-prefixed: `identity` is the shard the bytes belong to (the rank's
place in tensor, pipeline, context and decode-context parallelism, from
`HiCacheStorageConfig`), `pool format` what the bytes are (the pool's name, layout, dtype,
page size, layer range, bytes per token and page). The model's name and the operator's
`namespace` are the entries' `Namespace`, which every entry's MAC covers. Two models, two
ranks holding different shards, two pools or two page formats never share a digest; ranks
holding the same bytes (MLA's replicated KV) do, as SGLang's own file backend has them.
"""

from __future__ import annotations

import hashlib
import struct
from typing import Any

from pagedkv.tiers.base import TierKey

_TAG = b"pagedkv-sglang-1"
_U32 = struct.Struct("<I")
#: SGLang's name of the KV pool (hicache_storage.PoolName.KV).
KV_POOL = "kv"
#: SGLang's name of the Mamba state pool, sharded by tensor-parallel rank even in MLA models.
MAMBA_POOL = "mamba"


def _framed(*parts: str) -> bytes:
    out = [_TAG]
    for part in parts:
        raw = part.encode()
        out += (_U32.pack(len(raw)), raw)
    return b"".join(out)


def shard_identity(config: Any, pool_name: str) -> str:
    """Which shard of the model's state a rank's pool holds (from HiCacheStorageConfig).
    KV of an MLA model is replicated over tensor-parallel ranks (one shard for all of them,
    written by one rank); everything else is per tensor-parallel rank."""
    parts = []
    if not (config.is_mla_model and pool_name != MAMBA_POOL):
        parts.append(f"tp{config.tp_rank}/{config.tp_size}")
    if config.pp_size > 1:
        parts.append(f"pp{config.pp_rank}/{config.pp_size}")
    if config.attn_cp_size > 1:
        parts.append(f"cp{config.attn_cp_rank}/{config.attn_cp_size}")
    dcp_size = getattr(config, "dcp_size", 1)
    if dcp_size > 1:
        parts.append(
            f"dcp{config.dcp_rank}/{dcp_size}/tp{config.tp_size}/page{config.logical_page_size}"
        )
    return ",".join(parts) or "whole"


def pool_format(pool: Any, pool_name: str, page_bytes: int) -> str:
    """What the bytes of one page of `pool` are: two pools that agree here store a page in
    the same bytes. (The pool's class is left out on purpose: the same bytes read through
    a subclass are the same page.)"""
    fields = (
        f"pool={pool_name}",
        f"layout={getattr(pool, 'layout', '')}",
        f"dtype={getattr(pool, 'dtype', '')}",
        f"page_size={getattr(pool, 'page_size', '')}",
        f"layers={getattr(pool, 'start_layer', '')}-{getattr(pool, 'end_layer', '')}",
        f"bytes_per_token={getattr(pool, 'size_per_token', '')}",
        f"format={getattr(pool, 'storage_format_tag', None)}",
        f"page_bytes={page_bytes}",
    )
    return ";".join(fields)


class PageKeys:
    """Turns one pool's page keys into `TierKey`s."""

    __slots__ = ("_prefix", "format", "group", "identity")

    def __init__(self, identity: str, fmt: str, group: int) -> None:
        self.identity = identity
        self.format = fmt
        self.group = group  # 0 for the KV pool, 1 for any other (the digest separates pools)
        self._prefix = hashlib.sha256(_framed(identity, fmt))

    @classmethod
    def of(cls, config: Any, pool: Any, pool_name: str, page_bytes: int) -> PageKeys:
        return cls(
            shard_identity(config, pool_name),
            pool_format(pool, pool_name, page_bytes),
            0 if pool_name == KV_POOL else 1,
        )

    def key(self, page_key: str) -> TierKey:
        if not isinstance(page_key, str):
            raise TypeError(f"SGLang page keys are strings, got {page_key!r}")
        h = self._prefix.copy()
        h.update(_framed(page_key))
        return TierKey(self.group, h.digest())

    def keys(self, page_keys: list[str]) -> list[TierKey]:
        return [self.key(k) for k in page_keys]


__all__ = ["KV_POOL", "MAMBA_POOL", "PageKeys", "pool_format", "shard_identity"]
