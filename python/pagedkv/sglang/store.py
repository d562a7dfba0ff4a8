"""`PagedKVStore`: pagedkv's tiers as an SGLang HiCache storage backend (docs/tiers.md,
"Under SGLang"). SGLang 0.5.23 loads it by configuration alone:

    --hicache-storage-backend dynamic --hicache-storage-backend-extra-config
    '{"backend_name": "pagedkv", "module_path": "pagedkv.sglang",
      "class_name": "PagedKVStore", "interface_v1": 1, "host_bytes": "8GiB", ...}'

and calls it from its own storage threads (prefetch, backup), where blocking is allowed:
every call here is bounded by the stores' timeouts. What a call promises:

- a set has copied the page's bytes out of SGLang's host pool when it returns, and returns
  True only if some store kept them;
- a get writes into the host pool and reports success only once the bytes are in place;
  a page that is absent, damaged, of another model, rank or format, or behind a dead or
  full server is a miss (False / None), never a wrong page;
- `batch_exists` counts the leading keys present (a hint: a get still checks the entry);
- a call this backend does not serve raises (SGLang's threads log an exception; a silent
  None would kill its prefetch thread).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
    PoolHitPolicy,
    PoolTransfer,
    PoolTransferResult,
)

from pagedkv.sglang import pages
from pagedkv.sglang.chain import TierChain
from pagedkv.sglang.keys import KV_POOL, PageKeys
from pagedkv.sglang.options import StoreOptions, parse_options
from pagedkv.tiers.base import TierKey, TierStats, TierStore
from pagedkv.tiers.entry import Namespace
from pagedkv.tiers.factory import StoreSpec, build_stores

logger = logging.getLogger(__name__)


class _Pool:
    """A registered host pool: the pool, its page size in tokens and bytes, and its keys."""

    __slots__ = ("keys", "nbytes", "page_size", "pool")

    def __init__(self, config: HiCacheStorageConfig, pool: Any, name: str) -> None:
        self.pool = pool
        self.page_size = int(getattr(pool, "page_size", 1) or 1)
        self.nbytes = pages.page_nbytes(pool)
        self.keys = PageKeys.of(config, pool, name, self.nbytes)


def _build_stores(opts: StoreOptions, ns: Namespace) -> list[TierStore]:
    spec = StoreSpec(
        host_bytes=opts.host_bytes or None,
        codec=opts.codec,
        item_size=opts.item_size,
        redis_url=opts.redis_url,
        redis_cluster=opts.redis_cluster,
        remote_codec=opts.remote_codec,
        secret=opts.secret,
        timeout=opts.timeout,
        connect_timeout=opts.connect_timeout,
        retry_after=opts.retry_after,
        ttl=opts.ttl,
    )
    return build_stores(spec, ns)


class PagedKVStore(HiCacheStorage):
    """pagedkv's host, compressed-host and Redis/Valkey tiers behind SGLang's
    `HiCacheStorage` (module docstring). Built by SGLang's `StorageBackendFactory` as
    ``PagedKVStore(storage_config, kwargs)``; the options are the extra config's."""

    def __init__(
        self, storage_config: HiCacheStorageConfig, kwargs: dict[str, Any] | None = None
    ) -> None:
        if not isinstance(storage_config, HiCacheStorageConfig):
            raise TypeError(
                f"storage_config must be SGLang's HiCacheStorageConfig, got {storage_config!r}"
            )
        if storage_config.should_split_heads:
            raise ValueError(
                "PagedKVStore does not split pages by head (tp_lcm_size): pages are stored "
                "per rank, whole"
            )
        if not storage_config.model_name:
            raise ValueError(
                "PagedKVStore needs the model's name (HiCacheStorageConfig.model_name): it "
                "keeps the pages of different models apart"
            )
        self.options = parse_options(storage_config.extra_config)
        self.storage_config = storage_config
        self.namespace = Namespace(
            model=storage_config.model_name,
            layout="sglang-hicache",
            dtype="page-bytes",
            block_size=1,
            tenant=self.options.namespace,
        )
        self._chain = TierChain(_build_stores(self.options, self.namespace))
        self._kv: _Pool | None = None  # register_mem_pool_host's: the v1 and tensor calls
        self._v2: dict[str, _Pool] = {}  # register_mem_host_pool_v2's, by name: the v2 calls
        self._lock = threading.Lock()  # the tables of registered pools
        self.mem_pool_host: Any = None
        self.registered_pools: dict[str, Any] = {}

    def __repr__(self) -> str:
        return f"PagedKVStore(model={self.namespace.model!r}, options={self.options!r})"

    # ---- host pools -----------------------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """The KV host pool (SGLang calls this right after building the backend). A
        `HostPoolGroup` stands for its anchor pool, as in SGLang's hybrid controller."""
        if not hasattr(mem_pool_host, "get_data_page") and hasattr(mem_pool_host, "anchor_entry"):
            mem_pool_host = mem_pool_host.anchor_entry.host_pool
        entry = _Pool(self.storage_config, mem_pool_host, KV_POOL)
        with self._lock:
            self.mem_pool_host = mem_pool_host
            self._kv = entry

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        """A host pool of a hybrid model, by SGLang's pool name (`PoolName`): the pool the v2
        calls' transfers of that name index. Pages of one name and one byte format share
        entries whichever call stored them."""
        name = str(host_pool_name)
        entry = _Pool(self.storage_config, host_pool, name)
        with self._lock:
            self.registered_pools[name] = host_pool
            self._v2[name] = entry

    def _pool(self) -> _Pool:
        """The KV pool of the v1 and tensor calls."""
        with self._lock:
            entry = self._kv
        if entry is None:
            raise RuntimeError(
                "no host pool registered with PagedKVStore (register_mem_pool_host first)"
            )
        return entry

    def _pool_v2(self, name: Any) -> _Pool:
        """The pool of the v2 transfers named `name` (the KV pool by default for KV)."""
        key = str(name)
        with self._lock:
            entry = self._v2.get(key)
            if entry is None and key == KV_POOL:
                entry = self._kv
        if entry is None:
            raise RuntimeError(
                f"no host pool {key!r} registered with PagedKVStore "
                "(register_mem_host_pool_v2 first)"
            )
        return entry

    # ---- presence -------------------------------------------------------------------------

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def batch_exists(
        self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> int:
        """How many of `keys`, from the first, some tier holds (KV pool)."""
        return self._chain.count_present(self._pool().keys.keys(_str_keys(keys)))

    def batch_exists_v2(
        self,
        keys: list[str],
        pool_transfers: list[PoolTransfer] | None = None,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> PoolTransferResult:
        """The usable prefix over the KV pool and each transfer's pool, by its hit policy:
        ALL_PAGES needs the pool's page of every KV page of the prefix, TRAILING_PAGES only of
        the last ``len(transfer.keys)`` (at least 1); other policies raise."""
        keys = _str_keys(keys)
        kv_pages = self.batch_exists(keys)
        hits: dict[str, int] = {KV_POOL: kv_pages} if kv_pages else {}
        restorable = set(range(1, kv_pages + 1))
        for transfer in pool_transfers or []:
            if not restorable:
                break
            name = str(transfer.name)
            tier_keys = self._pool_v2(name).keys.keys(keys[:kv_pages])
            policy = PoolHitPolicy(transfer.hit_policy)
            if policy == PoolHitPolicy.ALL_PAGES:
                run = self._chain.count_present(tier_keys)
                ok = set(range(1, run + 1))
            elif policy == PoolHitPolicy.TRAILING_PAGES:
                window = max(1, len(transfer.keys or ()))
                have = self._chain.present(tier_keys)
                ok = {n for n in range(1, kv_pages + 1) if all(have[max(0, n - window) : n])}
            else:
                raise ValueError(f"PagedKVStore does not serve hit policy {policy.value!r}")
            if ok:
                hits[name] = max(ok)
            restorable &= ok
        ordered = sorted(restorable)
        return PoolTransferResult(ordered[-1] if ordered else 0, hits, ordered)

    # ---- zero-copy page transfers (interface_v1, v2) ---------------------------------------

    def batch_get_v1(
        self,
        keys: list[str],
        host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        """Load each key's page into the KV host pool at its page of `host_indices`; stops at
        the first miss (SGLang uses the leading run; later pages report False)."""
        return self._load(self._pool(), _str_keys(keys), host_indices)

    def batch_set_v1(
        self,
        keys: list[str],
        host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        """Store each page of the KV host pool named by `host_indices` under its key."""
        return self._store(self._pool(), _str_keys(keys), host_indices)

    def batch_get_v2(
        self,
        transfers: list[PoolTransfer],
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> dict[str, list[bool]]:
        return {
            str(t.name): self._load(self._pool_v2(t.name), _str_keys(t.keys or []), t.host_indices)
            for t in transfers
        }

    def batch_set_v2(
        self,
        transfers: list[PoolTransfer],
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> dict[str, list[bool]]:
        return {
            str(t.name): self._store(self._pool_v2(t.name), _str_keys(t.keys or []), t.host_indices)
            for t in transfers
        }

    def _load(self, pool: _Pool, keys: list[str], host_indices: Any) -> list[bool]:
        if host_indices is None:
            raise ValueError("a page transfer needs host_indices")
        starts = pages.page_starts(host_indices, len(keys), pool.page_size)
        out = [False] * len(keys)
        for i, tk in enumerate(pool.keys.keys(keys)):
            data = self._fetch(pool, tk)
            if data is None:
                break
            pages.write_page(pool.pool, starts[i], data)
            out[i] = True
        return out

    def _store(self, pool: _Pool, keys: list[str], host_indices: Any) -> list[bool]:
        if host_indices is None:
            raise ValueError("a page transfer needs host_indices")
        starts = pages.page_starts(host_indices, len(keys), pool.page_size)
        return [
            self._chain.put(tk, pages.read_page(pool.pool, start))
            for tk, start in zip(pool.keys.keys(keys), starts, strict=True)
        ]

    def _fetch(self, pool: _Pool, key: TierKey) -> bytes | None:
        data = self._chain.get(key)
        if data is not None and len(data) != pool.nbytes:
            # Same key, other size: cannot happen with pool_format in the digest; a miss.
            logger.warning("PagedKVStore: a page of %d bytes, expected %d", len(data), pool.nbytes)
            return None
        return data

    # ---- tensor calls (SGLang's generic path, without interface_v1) -------------------------

    def get(
        self,
        key: str,
        target_location: Any | None = None,
        target_sizes: Any | None = None,
    ) -> torch.Tensor | None:
        """The KV page stored under `key`, copied into `target_location` (a CPU tensor of
        one page's bytes, as SGLang's `get_dummy_flat_data_page` makes) or a new page; None
        on a miss."""
        pool = self._pool()
        data = self._fetch(pool, pool.keys.key(_str_key(key)))
        if data is None:
            return None
        out = (
            target_location if target_location is not None else pool.pool.get_dummy_flat_data_page()
        )
        if not isinstance(out, torch.Tensor) or out.device.type != "cpu" or not out.is_contiguous():
            raise ValueError("target_location must be a contiguous CPU tensor")
        dst = out.view(-1).view(torch.uint8).numpy()
        if dst.size != len(data):
            raise ValueError(f"target_location holds {dst.size} bytes, a page is {len(data)}")
        dst[:] = memoryview(data)
        return out

    def batch_get(
        self,
        keys: list[str],
        target_locations: Any | None = None,
        target_sizes: Any | None = None,
    ) -> list[torch.Tensor | None]:
        keys = _str_keys(keys)
        targets = list(target_locations) if target_locations is not None else [None] * len(keys)
        if len(targets) != len(keys):
            raise ValueError(f"{len(keys)} keys but {len(targets)} target locations")
        return [self.get(k, t) for k, t in zip(keys, targets, strict=True)]

    def set(
        self,
        key: str,
        value: Any | None = None,
        target_location: Any | None = None,
        target_sizes: Any | None = None,
    ) -> bool:
        """Store `value` (one KV page as a tensor, as SGLang's `get_data_page` gives it)."""
        pool = self._pool()
        if not isinstance(value, torch.Tensor):
            raise ValueError(f"PagedKVStore.set needs the page as a tensor, got {type(value)}")
        data = pages.tensor_bytes(value)
        if data.nbytes != pool.nbytes:
            raise ValueError(f"a KV page is {pool.nbytes} bytes, got {data.nbytes}")
        return self._chain.put(pool.keys.key(_str_key(key)), data)

    def batch_set(
        self,
        keys: list[str],
        values: Any | None = None,
        target_locations: Any | None = None,
        target_sizes: Any | None = None,
    ) -> bool:
        keys = _str_keys(keys)
        vals = list(values) if values is not None else []
        if len(vals) != len(keys):
            raise ValueError(f"{len(keys)} keys but {len(vals)} values")
        results = [self.set(k, v) for k, v in zip(keys, vals, strict=True)]
        return all(results)

    # ---- the rest ------------------------------------------------------------------------------

    def clear(self) -> None:
        """Forget this node's host-tier pages. A remote server's pages are shared by every
        node of the namespace and are left alone (expire them with `ttl` or the server's
        eviction)."""
        for store in self._chain.stores:
            clear = getattr(store, "clear", None)
            if clear is not None and store.medium != "REMOTE":
                clear()

    def get_stats(self) -> dict[str, TierStats]:
        """Each store's `TierStats`, by its name."""
        return {st.name: st for st in self._chain.stats()}

    def close(self) -> None:
        """Close the remote tier's connections (SGLang calls this on a failed attach)."""
        for store in self._chain.stores:
            close = getattr(store, "close", None)
            if close is not None:
                close()


def _str_key(key: object) -> str:
    if not isinstance(key, str):
        raise TypeError(f"SGLang page keys are strings, got {key!r}")
    return key


def _str_keys(keys: Sequence[object]) -> list[str]:
    return [_str_key(k) for k in keys]


__all__ = ["PagedKVStore"]
