"""The options of `PagedKVStore`, read from SGLang's ``--hicache-storage-backend-extra-config``
(docs/tiers.md, "Under SGLang"). Every option is checked here, before any store is built:
a wrong type, a bad value or an unknown name raises `ValueError` naming it (a misspelt
option silently ignored would leave a tier off).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pagedkv.sim.units import parse_bytes
from pagedkv.tiers.entry import check_secret

#: Keys SGLang itself reads from the extra config and leaves there: not ours to refuse.
SGLANG_KEYS = frozenset({"backend_name", "module_path", "class_name", "interface_v1"})
#: The environment variable that holds the remote tier's secret (hex) by default.
DEFAULT_SECRET_ENV = "PAGEDKV_TIER_SECRET"

_CODECS = ("raw", "lz4", "shuffle+lz4")


@dataclass(frozen=True)
class StoreOptions:
    """What the extra config asked for, checked."""

    host_bytes: int = 0  # 0: no host tier
    codec: str = "raw"  # the host tier's codec (raw: HostTier, else CompressedHostTier)
    remote_codec: str = "raw"
    item_size: int = 2  # the byte shuffle's element size (2: fp16/bf16 KV)
    redis_url: str | None = None
    redis_cluster: bool = False
    secret: bytes | None = None  # required with redis_url; never printed
    namespace: str = ""  # the tenant field of every entry's namespace
    timeout: float = 0.5
    connect_timeout: float = 1.0
    retry_after: float = 1.0
    ttl: float | None = None

    def __repr__(self) -> str:  # the secret never appears
        return (
            f"StoreOptions(host_bytes={self.host_bytes}, codec={self.codec!r}, "
            f"remote_codec={self.remote_codec!r}, redis_url={self.redis_url!r}, "
            f"redis_cluster={self.redis_cluster}, namespace={self.namespace!r})"
        )


def _number(name: str, value: object, *, positive: bool) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"extra config {name!r} must be a number, got {value!r}")
    if (positive and value <= 0) or value < 0:
        raise ValueError(f"extra config {name!r} must be {'> 0' if positive else '>= 0'}")
    return float(value)


def _codec(name: str, value: object) -> str:
    key = str(value).lower().replace("-", "+").replace("_", "+")
    if not isinstance(value, str) or key not in _CODECS:
        raise ValueError(f"extra config {name!r} must be one of {_CODECS}, got {value!r}")
    return key


def _host_bytes(value: object) -> int:
    if isinstance(value, str):
        return parse_bytes(value, minimum=0)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"extra config 'host_bytes' must be bytes >= 0 or '8GiB', got {value!r}")
    return value


def _secret(cfg: dict[str, Any]) -> bytes | None:
    """The remote tier's secret: hex in the file `secret_file`, else in the environment
    variable `secret_env` (default PAGEDKV_TIER_SECRET); None when neither holds one."""
    path = cfg.get("secret_file")
    if path is not None:
        if not isinstance(path, str):
            raise ValueError("extra config 'secret_file' must be a path")
        text = Path(path).read_text().strip()
        source = f"secret_file {path}"
    else:
        env = cfg.get("secret_env", DEFAULT_SECRET_ENV)
        if not isinstance(env, str):
            raise ValueError("extra config 'secret_env' must be a variable name")
        if env not in os.environ:
            return None
        text = os.environ[env].strip()
        source = f"environment variable {env}"
    try:
        raw = bytes.fromhex(text)
    except ValueError:
        raise ValueError(f"the tier secret in {source} must be hex") from None
    return check_secret(raw)


def parse_options(extra_config: dict[str, Any] | None) -> StoreOptions:
    """`StoreOptions` from SGLang's extra config; ValueError names a bad or unknown option."""
    cfg = dict(extra_config or {})
    known = {f for f in StoreOptions.__dataclass_fields__ if f != "secret"}
    known |= {"secret_file", "secret_env"}
    unknown = sorted(set(cfg) - known - SGLANG_KEYS)
    if unknown:
        raise ValueError(
            f"unknown PagedKVStore option(s) {unknown}; known: {sorted(known)} "
            "(docs/tiers.md, 'Under SGLang')"
        )
    url = cfg.get("redis_url")
    if url is not None and (not isinstance(url, str) or not url):
        raise ValueError(f"extra config 'redis_url' must be a URL string, got {url!r}")
    cluster = cfg.get("redis_cluster", False)
    if not isinstance(cluster, bool):
        raise ValueError("extra config 'redis_cluster' must be true or false")
    item = cfg.get("item_size", 2)
    if isinstance(item, bool) or item not in (1, 2, 4, 8):
        raise ValueError(f"extra config 'item_size' must be 1, 2, 4 or 8, got {item!r}")
    ns = cfg.get("namespace", "")
    if not isinstance(ns, str):
        raise ValueError("extra config 'namespace' must be a string")
    codec = _codec("codec", cfg.get("codec", "raw"))
    ttl = cfg.get("ttl")
    opts = StoreOptions(
        host_bytes=_host_bytes(cfg.get("host_bytes", 0)),
        codec=codec,
        remote_codec=_codec("remote_codec", cfg.get("remote_codec", codec)),
        item_size=item,
        redis_url=url,
        redis_cluster=cluster,
        secret=_secret(cfg) if url is not None else None,
        namespace=ns,
        timeout=_number("timeout", cfg.get("timeout", 0.5), positive=True),
        connect_timeout=_number("connect_timeout", cfg.get("connect_timeout", 1.0), positive=True),
        retry_after=_number("retry_after", cfg.get("retry_after", 1.0), positive=False),
        ttl=None if ttl is None else _number("ttl", ttl, positive=True),
    )
    if opts.host_bytes == 0 and opts.redis_url is None:
        raise ValueError(
            "PagedKVStore needs a tier: give 'host_bytes' (a host tier) and/or 'redis_url'"
        )
    if opts.redis_url is not None and opts.secret is None:
        raise ValueError(
            "'redis_url' needs the tier secret (hex, 16 bytes or more, the same on every node): "
            f"set {cfg.get('secret_env', DEFAULT_SECRET_ENV)} or give 'secret_file'"
        )
    return opts


__all__ = ["DEFAULT_SECRET_ENV", "SGLANG_KEYS", "StoreOptions", "parse_options"]
