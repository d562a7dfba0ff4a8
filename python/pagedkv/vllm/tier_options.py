"""The options of `PagedKVTier` (docs/tiers.md, "Under stock vLLM"): which pagedkv store a
vLLM secondary tier keeps its chunks in, and the namespace those chunks live in.

vLLM passes every key of a ``secondary_tiers`` entry but ``type``, ``module_path`` and
``backpressure`` to the tier's constructor; `TierOptions.parse` checks them here, so that a
misspelt or mistyped option is an error naming it when the engine starts, never a tier that
silently does something else. This module uses nothing of vLLM: the spec's configuration is read
through its attributes.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pagedkv.sim.units import parse_bytes
from pagedkv.tiers import codec as C
from pagedkv.tiers.base import TierStore
from pagedkv.tiers.entry import Namespace
from pagedkv.tiers.factory import StoreSpec, build_stores

#: Where the shared secret of a Redis tier is read from by default (hex, 32 bytes or more
#: recommended): never in the JSON of the engine's command line.
DEFAULT_SECRET_ENV = "PAGEDKV_TIER_SECRET"

_KNOWN = {
    "host_bytes": "bytes of a host-memory store (int, or a string such as '64GiB')",
    "codec": "'raw' (default), 'lz4' or 'shuffle+lz4'",
    "redis_url": "redis://host:port/db, rediss://..., unix:///path (a Redis-protocol store)",
    "redis_cluster": "true when redis_url names one node of a Redis Cluster",
    "redis_timeout_s": "bound on each socket wait (default 0.5)",
    "redis_ttl_s": "seconds each entry lives on the server (default: until evicted)",
    "secret_env": f"environment variable holding the hex MAC secret (default {DEFAULT_SECRET_ENV})",
    "secret_file": "file holding the MAC secret (raw bytes)",
    "model": "the namespace's model name (default: vLLM's model name)",
    "tenant": "the namespace's tenant: tiers with different tenants never share a block",
    "workers": "threads that copy, encode and move blocks (default 2)",
    "max_pending_bytes": "snapshot bytes of stores in flight before a store is dropped",
    "lookup_ttl_s": "seconds a Redis presence answer is reused (default 2.0)",
    "kv_events": "emit BlockStored/BlockRemoved for this tier (default true; needs vLLM's)",
    "locality": "'LOCAL' or 'REMOTE' (vLLM's tier filter; default by store)",
}


def _opt_bool(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"PagedKVTier option {name!r} must be true or false, got {value!r}")
    return value


def _opt_pos(name: str, value: object, *, integer: bool = False) -> float:
    ok = isinstance(value, int) if integer else isinstance(value, int | float)
    if isinstance(value, bool) or not ok or not value > 0:  # type: ignore[operator]
        kind = "a positive int" if integer else "a positive number"
        raise ValueError(f"PagedKVTier option {name!r} must be {kind}, got {value!r}")
    return float(value)  # type: ignore[arg-type]


def _opt_str(name: str, value: object) -> str:
    if not isinstance(value, str):
        raise TypeError(f"PagedKVTier option {name!r} must be a string, got {value!r}")
    return value


def _bytes_option(name: str, value: object) -> int:
    if isinstance(value, str):
        return parse_bytes(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(
            f"PagedKVTier option {name!r} must be a positive byte count, got {value!r}"
        )
    return value


@dataclass(frozen=True)
class TierOptions:
    """The checked options of one `PagedKVTier`."""

    host_bytes: int | None = None
    codec: str = "raw"
    redis_url: str | None = None
    redis_cluster: bool = False
    redis_timeout_s: float = 0.5
    redis_ttl_s: float | None = None
    secret_env: str = DEFAULT_SECRET_ENV
    secret_file: str | None = None
    model: str | None = None
    tenant: str = ""
    workers: int = 2
    max_pending_bytes: int = 1 << 30
    lookup_ttl_s: float = 2.0
    kv_events: bool = True
    locality: str | None = None

    @classmethod
    def parse(cls, options: dict[str, Any]) -> TierOptions:
        """The options of a ``secondary_tiers`` entry; an unknown key, a wrong type or
        a bad combination raises, naming it."""
        unknown = sorted(set(options) - set(_KNOWN))
        if unknown:
            known = "; ".join(f"{k}: {v}" for k, v in _KNOWN.items())
            raise ValueError(f"unknown PagedKVTier option(s) {unknown}; the options are {known}")
        o = dict(options)
        kw: dict[str, Any] = {}
        if o.get("host_bytes") is not None:
            kw["host_bytes"] = _bytes_option("host_bytes", o["host_bytes"])
        if "codec" in o:
            name = _opt_str("codec", o["codec"])
            C.codec_by_name(name)  # raises for an unknown name
            kw["codec"] = name
        if o.get("redis_url") is not None:
            kw["redis_url"] = _opt_str("redis_url", o["redis_url"])
        if "redis_cluster" in o:
            kw["redis_cluster"] = _opt_bool("redis_cluster", o["redis_cluster"])
        if "redis_timeout_s" in o:
            kw["redis_timeout_s"] = _opt_pos("redis_timeout_s", o["redis_timeout_s"])
        if o.get("redis_ttl_s") is not None:
            kw["redis_ttl_s"] = _opt_pos("redis_ttl_s", o["redis_ttl_s"])
        for name in ("secret_env", "secret_file", "model", "tenant"):
            if o.get(name) is not None:
                kw[name] = _opt_str(name, o[name])
        if "workers" in o:
            kw["workers"] = int(_opt_pos("workers", o["workers"], integer=True))
        if "max_pending_bytes" in o:
            kw["max_pending_bytes"] = _bytes_option("max_pending_bytes", o["max_pending_bytes"])
        if "lookup_ttl_s" in o:
            kw["lookup_ttl_s"] = _opt_pos("lookup_ttl_s", o["lookup_ttl_s"])
        if "kv_events" in o:
            kw["kv_events"] = _opt_bool("kv_events", o["kv_events"])
        if o.get("locality") is not None:
            loc = _opt_str("locality", o["locality"]).upper()
            if loc not in ("LOCAL", "REMOTE"):
                raise ValueError(
                    f"PagedKVTier option 'locality' must be LOCAL or REMOTE, got {loc!r}"
                )
            kw["locality"] = loc
        opts = cls(**kw)
        if (opts.host_bytes is None) == (opts.redis_url is None):
            raise ValueError(
                "a PagedKVTier keeps one store: give exactly one of 'host_bytes' (host memory) "
                "and 'redis_url' (a Redis-protocol server); list two tiers for both"
            )
        if opts.redis_cluster and opts.redis_url is None:
            raise ValueError("PagedKVTier option 'redis_cluster' needs 'redis_url'")
        return opts

    @property
    def remote(self) -> bool:
        return self.redis_url is not None

    def secret(self) -> bytes | None:
        """The MAC secret: a host store's is the process's own (None); a Redis store's is
        read from `secret_file`, or else from the hex in `secret_env`, and must be there."""
        if not self.remote:
            return None
        if self.secret_file is not None:
            return Path(self.secret_file).read_bytes()
        text = os.environ.get(self.secret_env)
        if text is None:
            raise ValueError(
                f"a PagedKVTier on Redis needs the shared MAC secret: set {self.secret_env} to "
                "its hex (python -c 'import secrets; print(secrets.token_hex(32))'), the same "
                "on every node, or give 'secret_file'"
            )
        try:
            return bytes.fromhex(text.strip())
        except ValueError:
            raise ValueError(f"{self.secret_env} must hold the secret as hex") from None

    def build_store(self, namespace: Namespace) -> TierStore:
        """The pagedkv store these options name, in `namespace` (`tiers.factory`)."""
        spec = StoreSpec(
            host_bytes=self.host_bytes,
            codec=self.codec,
            redis_url=self.redis_url,
            redis_cluster=self.redis_cluster,
            secret=self.secret(),
            timeout=self.redis_timeout_s,
            ttl=self.redis_ttl_s,
        )
        (store,) = build_stores(spec, namespace)
        return store


def namespace_of(spec: Any, row_bytes: int, opts: TierOptions) -> Namespace:
    """The namespace of a vLLM engine's offloaded chunks: its model and dtype, the chunk's
    token span, and as layout everything that shapes a chunk's bytes in vLLM's CPU tier
    (the row size, each worker's bytes per block, the parallel layout, the KV-cache groups
    and their layers). Two engines share blocks only when all of it matches; the data
    parallel rank is left out, so DP replicas of one model share."""
    cfg = spec.config
    par = cfg.parallel
    groups = [
        {"tokens_per_block": g.tokens_per_block, "layers": list(g.layer_names)} for g in cfg.groups
    ]
    layout = {
        "engine": "vllm-offload",
        "row_bytes": row_bytes,
        "worker_kv_bytes_per_block": cfg.worker_kv_bytes_per_block,
        "blocks_per_chunk": cfg.cache.blocks_per_chunk,
        "tokens_per_hash": cfg.cache.tokens_per_hash,
        "parallel": [par.world_size, par.tp_size, par.pp_size, par.pcp_size, par.dcp_size],
        "replicated_layout": bool(cfg.replicated_layout),
        "canonical_layout": bool(cfg.canonical_layout),
        "kv_cache_layout": cfg.kv_cache_layout,
        "groups": groups,
    }
    tokens = cfg.groups[0].tokens_per_block * cfg.cache.blocks_per_chunk if cfg.groups else 1
    return Namespace(
        model=opts.model if opts.model is not None else str(cfg.model.name),
        layout=json.dumps(layout, sort_keys=True, separators=(",", ":")),
        dtype=str(cfg.model.dtype),
        block_size=max(1, int(tokens)),
        tenant=opts.tenant,
    )


__all__ = ["DEFAULT_SECRET_ENV", "TierOptions", "namespace_of"]
