"""The remote tier: blocks in a Redis-protocol server shared by serving nodes (docs/tiers.md,
"Remote tier").

One block is one string value, an entry of `tiers/entry.py`, under the key
``pagedkv:{keyed namespace id hex}:{group}:{digest hex}``, whose namespace id is a MAC of
the namespace under the tier's secret (`entry.key_ident`): the EXISTS of a presence check
then counts only entries made with that secret, as the MAC check of a get accepts only
those. A put is a single SET (atomic: a reader
sees the whole entry or none), a get a single GET whose value is checked against the key
asked for and its MAC under the tier's secret (which the server never sees), and
`count_present` one pipelined round trip of EXISTS per server. Every failure (refused,
reset, timed out, MOVED, CLUSTERDOWN, a damaged, forged or foreign value) is a miss or a
dropped put, counted in the stats; nothing raises to the caller and every socket wait is
bounded by `timeout` (`connect_timeout` to connect). After a transport failure a server is
left alone for `retry_after` seconds (its keys miss at once), then one caller probes it and
the tier recovers by itself when it answers again.

Works with Redis and Valkey (one server, ``redis://``, ``rediss://`` or ``unix://`` URLs)
and with a Redis Cluster (``cluster=True``; the URL names one seed node). In a cluster each
node has its own breaker, so a dead node's keys miss while the other nodes' keys still hit.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any, cast

import redis
import redis.connection
from redis.backoff import NoBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.connection import ConnectionPool, parse_url
from redis.exceptions import (
    AskError,
    BusyLoadingError,
    ClusterDownError,
    ReadOnlyError,
    ResponseError,
    TryAgainError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry

from pagedkv.tiers import codec as C
from pagedkv.tiers.base import TierKey, TierStats
from pagedkv.tiers.entry import (
    Entry,
    EntryError,
    Namespace,
    check_secret,
    decode_entry,
    encode_entry,
    key_ident,
)

# redis-py leaves these unannotated.
_parse_url = cast(Callable[[str], dict[str, Any]], parse_url)
_ClusterNode = cast(Callable[[str, int], ClusterNode], ClusterNode)

# Transport failures: the server is down, stalled, restarting or not serving its slots.
# These open the server's breaker for `retry_after` seconds.
_TRANSPORT = (RedisConnectionError, RedisTimeoutError, BusyLoadingError, ClusterDownError)
# The cluster's layout changed (a slot moved, a failover made our node a replica): refresh
# the slot map, no breaker.
_TOPOLOGY = (AskError, TryAgainError, ReadOnlyError)


def _python_packer() -> dict[str, Any]:
    """Have redis-py pack commands in Python, which hands a large value to the socket as
    it is. With hiredis installed it would use `hiredis.pack_command`, which copies every
    argument: SET of 1 MiB values ran 3x slower that way here. Replies are still parsed by
    hiredis when it is installed (4-6x faster GET of 1 MiB)."""
    serializer = getattr(redis.connection, "PythonRespSerializer", None)
    encoder = getattr(redis.connection, "Encoder", None)
    if serializer is None or encoder is None:  # another redis-py: its own default
        return {}
    return {"command_packer": serializer(6000, encoder("utf-8", "strict", False).encode)}


class _Node:
    """One server: its client and its breaker."""

    __slots__ = ("client", "down_until", "failed", "name")

    def __init__(self, name: str, client: redis.Redis) -> None:
        self.name = name
        self.client = client
        self.down_until = 0.0  # monotonic time before which the node is not tried
        self.failed = False  # the last call failed: the next admitted call is a probe


class RemoteTier:
    """A `TierStore` on a Redis-protocol server (medium ``"REMOTE"``).

    `url`: ``redis://host:port/db`` (or ``rediss://``, ``unix:///path.sock``); with
    ``cluster=True`` the address of one cluster node, the others are discovered.
    `namespace`: what must match for an entry to be served (entry.py).
    `secret`: the key of the entries' MAC (bytes, 16 or more), required: every node that
    shares the namespace on the server must be given the same secret (from the operator's
    secret store), and it is never sent to the server. An entry made without it is a miss
    (docs/tiers.md, "Who must be trusted").
    `timeout`: the bound on each socket wait for a reply; `connect_timeout`: on connecting.
    `retry_after`: seconds a failed server is left alone (its keys miss at once).
    `ttl`: seconds each stored entry lives (None: until the server evicts it; give the server
    a ``maxmemory`` and ``maxmemory-policy allkeys-lru``).
    `pipeline_batch`: EXISTS commands per pipelined round trip in `count_present`.
    `codec`: a `pagedkv.tiers.codec.Codec` that `put` encodes with (None: raw). `get` reads
    an entry of any codec known to `pagedkv.tiers.codec.decode`, whatever `codec` is.

    Statistics: `puts` counts calls, `dropped_puts` those not stored; `entries` and
    `stored_bytes` are not known for a shared server and stay 0. `drain_removed` reports
    the keys this tier discarded; what the server evicts or expires is not seen.
    """

    medium = "REMOTE"

    def __init__(
        self,
        url: str,
        namespace: Namespace,
        *,
        secret: bytes,
        timeout: float = 0.5,
        connect_timeout: float = 1.0,
        retry_after: float = 1.0,
        ttl: float | None = None,
        cluster: bool = False,
        pipeline_batch: int = 1024,
        codec: C.Codec | None = None,
        name: str = "remote",
    ) -> None:
        self._secret = check_secret(secret)  # never an attribute of the API, never in repr
        if timeout <= 0 or connect_timeout <= 0:
            raise ValueError("timeouts must be positive (an unbounded wait could hang)")
        if retry_after < 0:
            raise ValueError("retry_after must be >= 0")
        if ttl is not None and ttl <= 0:
            raise ValueError("ttl must be positive or None")
        if pipeline_batch < 1:
            raise ValueError("pipeline_batch must be >= 1")
        self.namespace = namespace
        self._ns_id = namespace.ident()
        # Keys name the namespace by a MAC of it under the secret (`entry.key_ident`): a
        # node given another secret looks up other keys, so EXISTS never counts its entries
        # as present here (a get would reject them), nor can it overwrite ours.
        self._prefix = f"pagedkv:{key_ident(namespace, self._secret).hex()}:"
        self._retry_after = retry_after
        self._ttl_ms = None if ttl is None else max(1, round(ttl * 1000))
        self._batch = pipeline_batch
        if codec is not None and not isinstance(codec, C.Codec):
            raise TypeError("codec must be a pagedkv.tiers.codec.Codec")
        self.codec = codec
        self._lock = threading.Lock()  # stats, breakers, the node table, removed keys
        self._stats = TierStats(name)
        self._removed: list[TierKey] = []
        # Every socket wait is bounded; no retries inside redis-py (a retry would double the
        # bound): a failure is a miss here and the breaker decides when to try again.
        self._timeouts: dict[str, Any] = {
            "socket_timeout": timeout,
            "socket_connect_timeout": connect_timeout,
        }
        self._conn_kwargs: dict[str, Any] = {
            **self._timeouts,
            "health_check_interval": 0,
            "retry": Retry(NoBackoff(), 0),
            **_python_packer(),
        }
        self._cluster_mode = cluster
        self._single: _Node | None = None
        self._cluster: RedisCluster | None = None
        self._nodes: dict[str, _Node] = {}
        if cluster:
            opts = _parse_url(url)
            if "path" in opts:
                raise ValueError("a cluster is reached over TCP, not a unix socket")
            host = str(opts.pop("host", "localhost"))
            port = int(opts.pop("port", 6379))
            opts.pop("db", None)
            self._cluster_opts = opts
            self._seeds: list[tuple[str, int]] = [(host, port)]
            self._refresh_lock = threading.Lock()
            self._next_refresh = 0.0
            self._refresh_lock.acquire()
            self._refresh_locked()  # the first read in the constructor: bounded, never raises
        else:
            pool = ConnectionPool.from_url(url, **self._conn_kwargs)
            self._single = _Node("server", redis.Redis(connection_pool=pool))

    # --- keys -------------------------------------------------------------------------

    def key_name(self, key: TierKey) -> str:
        """The server-side key of `key` (no hash tag: a cluster spreads blocks by slot)."""
        return f"{self._prefix}{key.group}:{key.digest.hex()}"

    # --- the store --------------------------------------------------------------------

    def put(self, key: TierKey, data: bytes | memoryview) -> bool:
        """Store `data` under `key`, through the tier's codec if it has one: one SET of the
        whole entry; False when it was dropped (unreachable, refused, or the codec failed)."""
        t0 = time.perf_counter()
        try:
            enc = C.Encoded(C.RAW, 1, data) if self.codec is None else self.codec.encode(data)
            codec_id, item_size, payload = enc
            entry = encode_entry(
                self._ns_id,
                key.group,
                key.digest,
                codec_id,
                item_size,
                len(data),
                memoryview(payload),
                secret=self._secret,
            )
        except Exception:  # the codec or the framing failed: dropped, nothing stored
            return self._dropped(t0)
        fallback = (
            self.codec is not None
            and self.codec.codec_id != C.RAW
            and codec_id == C.RAW
            and len(data) > 0
        )
        return self._store(key, entry, len(data), t0, fallback)

    def put_entry(self, key: TierKey, entry: Entry) -> bool:
        """Store a block the caller already holds encoded (an `Entry` of any codec, such as
        `get_entry` returns): framed here for `key` with this tier's namespace and secret,
        the payload as it is, in one SET; False (and nothing stored) when it was dropped."""
        t0 = time.perf_counter()
        try:
            blob = encode_entry(
                self._ns_id,
                key.group,
                key.digest,
                entry.codec,
                entry.item_size,
                entry.raw_len,
                entry.payload,
                secret=self._secret,
            )
        except Exception:  # the codec or the framing failed: dropped, nothing stored
            return self._dropped(t0)
        return self._store(key, blob, entry.raw_len, t0, False)

    def _dropped(self, t0: float) -> bool:
        with self._lock:
            self._stats.puts += 1
            self._stats.dropped_puts += 1
            self._stats.errors += 1
            self._stats.seconds_put += time.perf_counter() - t0
        return False

    def _store(self, key: TierKey, entry: bytes, raw_len: int, t0: float, fallback: bool) -> bool:
        name = self.key_name(key)
        node = self._route(name)
        ok = False
        if node is not None and self._admit(node):
            try:
                if self._ttl_ms is None:
                    node.client.set(name, entry)
                else:
                    node.client.set(name, entry, px=self._ttl_ms)
            except Exception as exc:
                self._failed(node, exc)
            else:
                self._succeeded(node)
                ok = True
        with self._lock:
            st = self._stats
            st.puts += 1
            if ok:
                st.raw_bytes_in += raw_len
                st.extra["stored_bytes_in"] = st.extra.get("stored_bytes_in", 0.0) + len(entry)
                if fallback:
                    st.extra["raw_fallbacks"] = st.extra.get("raw_fallbacks", 0.0) + 1
            else:
                st.dropped_puts += 1
            st.seconds_put += time.perf_counter() - t0
        return ok

    def get_entry(self, key: TierKey) -> Entry | None:
        """The checked entry stored under `key` (any codec), or None: absent, unreachable,
        or not exactly that block of this namespace, whole (counted as corrupt)."""
        name = self.key_name(key)
        node = self._route(name)
        if node is None or not self._admit(node):
            return None
        try:
            blob = node.client.get(name)
        except Exception as exc:
            self._failed(node, exc)
            return None
        self._succeeded(node)
        if blob is None:
            return None
        try:
            return decode_entry(
                cast(bytes, blob), self._ns_id, key.group, key.digest, secret=self._secret
            )
        except EntryError:
            with self._lock:
                self._stats.corrupt += 1
            return None

    def get(self, key: TierKey) -> bytes | None:
        t0 = time.perf_counter()
        entry = self.get_entry(key)
        data = None if entry is None else self._raw(entry)
        with self._lock:
            st = self._stats
            st.gets += 1
            if data is None:
                st.misses += 1
            else:
                st.hits += 1
                st.raw_bytes_out += len(data)
            st.seconds_get += time.perf_counter() - t0
        return data

    def count_present(self, keys: Sequence[TierKey]) -> int:
        """How many of `keys`, from the first, the server holds: EXISTS of each, pipelined,
        `pipeline_batch` keys per round trip (one pipeline per cluster node involved), stopping
        at the first absent key. Presence is not validity: `get` still checks the entry."""
        total = 0
        for start in range(0, len(keys), self._batch):
            chunk = keys[start : start + self._batch]
            n = self._present_prefix([self.key_name(k) for k in chunk])
            total += n
            if n < len(chunk):
                break
        with self._lock:
            self._stats.extra["lookups"] = self._stats.extra.get("lookups", 0.0) + 1
            self._stats.extra["lookup_hits"] = self._stats.extra.get("lookup_hits", 0.0) + total
        return total

    def present_each(self, keys: Sequence[TierKey]) -> list[bool]:
        """Whether the server holds each key: EXISTS of each, pipelined as in
        `count_present` but without stopping at an absent key (a window group's blocks need
        not be a leading run). A key on a resting or failed node reads as absent."""
        out = [False] * len(keys)
        for start in range(0, len(keys), self._batch):
            chunk = keys[start : start + self._batch]
            for i, held in enumerate(self._exists_each([self.key_name(k) for k in chunk])):
                out[start + i] = held
        with self._lock:
            self._stats.extra["lookups"] = self._stats.extra.get("lookups", 0.0) + 1
            self._stats.extra["lookup_hits"] = self._stats.extra.get("lookup_hits", 0.0) + sum(out)
        return out

    @property
    def key_prefix(self) -> str:
        """What every key of this tier's namespace (under its secret) starts with."""
        return self._prefix

    def clear(self, batch: int = 1000) -> int:
        """Delete every entry of this tier's namespace from the server (every node of a
        cluster): SCAN for the keys of `key_prefix`, UNLINK them in pipelined batches.
        Returns the number deleted. A failure raises (redis-py's exception): unlike a put or
        a get, a cleanup the caller asked for must not fail silently."""
        with self._lock:
            nodes = list(self._all_nodes())
        deleted = 0
        for node in nodes:
            names = node.client.scan_iter(match=f"{self._prefix}*", count=batch)
            pending: list[Any] = []
            for name in names:
                pending.append(name)
                if len(pending) >= batch:
                    deleted += self._unlink(node, pending)
                    pending = []
            if pending:
                deleted += self._unlink(node, pending)
        return deleted

    @staticmethod
    def _unlink(node: _Node, names: list[Any]) -> int:
        pipe = node.client.pipeline(transaction=False)  # one key per command: any slot
        for name in names:
            pipe.unlink(name)
        return sum(int(n) for n in pipe.execute())

    def discard(self, key: TierKey) -> None:
        name = self.key_name(key)
        node = self._route(name)
        if node is None or not self._admit(node):
            return
        try:
            n = node.client.delete(name)
        except Exception as exc:
            self._failed(node, exc)
            return
        self._succeeded(node)
        if n:
            with self._lock:
                self._removed.append(key)

    def drain_removed(self) -> list[TierKey]:
        with self._lock:
            out, self._removed = self._removed, []
        return out

    def stats(self) -> TierStats:
        with self._lock:
            st = replace(self._stats, extra=dict(self._stats.extra))
            st.extra["servers_down"] = float(
                sum(1 for n in self._all_nodes() if n.down_until > time.monotonic())
            )
        return st

    def close(self) -> None:
        """Close the connections (later calls reconnect)."""
        with self._lock:
            nodes = list(self._all_nodes())
        for node in nodes:
            with contextlib.suppress(Exception):  # closing is best effort
                node.client.connection_pool.disconnect()
        if self._cluster is not None:
            with contextlib.suppress(Exception):
                self._cluster.close()

    def __enter__(self) -> RemoteTier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- internals --------------------------------------------------------------------

    def _raw(self, entry: Entry) -> bytes | None:
        if entry.codec == 0:
            if entry.raw_len != len(entry.payload):
                with self._lock:
                    self._stats.corrupt += 1
                return None
            return bytes(entry.payload)
        try:
            return C.decode(entry.codec, entry.item_size, entry.payload, entry.raw_len)
        except Exception:  # EntryError: unknown codec, library missing, damaged payload
            with self._lock:
                self._stats.corrupt += 1
            return None

    def _present_prefix(self, names: list[str]) -> int:
        """The number of `names`, from the first, that exist (one pipeline per node)."""
        limit = len(names)
        if limit == 0:
            return 0
        # Group the keys by node, in order; a key whose node is unknown or resting ends the
        # prefix there, and no later key matters.
        groups: dict[str, tuple[_Node, list[int]]] = {}
        for i, name in enumerate(names):
            node = self._route(name)
            if node is None:
                limit = i
                break
            group = groups.get(node.name)
            if group is None:
                if not self._admit(node):
                    limit = i
                    break
                group = groups[node.name] = (node, [])
            group[1].append(i)
        for node, idx in groups.values():  # ordered by each node's first key
            idx = [i for i in idx if i < limit]
            if not idx:
                continue
            try:
                pipe = node.client.pipeline(transaction=False)
                for i in idx:
                    pipe.exists(names[i])
                replies = pipe.execute(raise_on_error=False)
            except Exception as exc:
                self._failed(node, exc)
                limit = min(limit, idx[0])
                continue
            self._succeeded(node)
            for i, reply in zip(idx, replies, strict=True):
                if isinstance(reply, Exception):
                    self._failed(node, reply)
                    limit = min(limit, i)
                    break
                if reply != 1:
                    limit = min(limit, i)
                    break
        return limit

    def _exists_each(self, names: list[str]) -> list[bool]:
        """Whether each of `names` exists (one pipeline per node; a node that is unknown,
        resting or failing answers absent for its keys)."""
        out = [False] * len(names)
        groups: dict[str, tuple[_Node, list[int]] | None] = {}
        for i, name in enumerate(names):
            node = self._route(name)
            if node is None:
                continue
            if node.name not in groups:
                groups[node.name] = (node, []) if self._admit(node) else None
            group = groups[node.name]
            if group is not None:
                group[1].append(i)
        for group in groups.values():
            if group is None:
                continue
            node, idx = group
            try:
                pipe = node.client.pipeline(transaction=False)
                for i in idx:
                    pipe.exists(names[i])
                replies = pipe.execute(raise_on_error=False)
            except Exception as exc:
                self._failed(node, exc)
                continue
            self._succeeded(node)
            for i, reply in zip(idx, replies, strict=True):
                if isinstance(reply, Exception):
                    self._failed(node, reply)
                    break
                out[i] = reply == 1
        return out

    def _all_nodes(self) -> list[_Node]:
        return [self._single] if self._single is not None else list(self._nodes.values())

    def _route(self, name: str) -> _Node | None:
        """The node that serves key `name` (None: no topology known yet)."""
        if self._single is not None:
            return self._single
        rc = self._cluster
        if rc is None:  # no seed has answered yet
            self._want_refresh()
            return None
        try:
            cnode = cast(Any, rc).get_node_from_key(name)
            host, port = str(cnode.host), int(cnode.port)
        except Exception:
            self._want_refresh()
            return None
        addr = f"{host}:{port}"
        with self._lock:
            node = self._nodes.get(addr)
            if node is None:
                # The tier's own client for the node (the cluster object only reads the
                # slot map); its breaker lives as long as the address.
                opts = {**self._cluster_opts, **self._conn_kwargs}
                pool = ConnectionPool(host=host, port=port, **opts)
                node = self._nodes[addr] = _Node(addr, redis.Redis(connection_pool=pool))
        return node

    def _admit(self, node: _Node) -> bool:
        """Whether to call `node` now; a resting node is tried again by one probing caller
        once `retry_after` has passed, the others keep missing until it answers."""
        now = time.monotonic()
        with self._lock:
            if now < node.down_until:
                self._stats.extra["skipped"] = self._stats.extra.get("skipped", 0.0) + 1
                return False
            if node.failed:
                node.down_until = now + self._retry_after
            return True

    def _succeeded(self, node: _Node) -> None:
        if node.failed:
            with self._lock:
                node.failed = False
                node.down_until = 0.0

    def _failed(self, node: _Node, exc: BaseException) -> None:
        """Count a failed call and decide what follows: a rest for the node (transport),
        a refresh of the slot map (cluster layout), or nothing more (a reply error)."""
        wrong_type = isinstance(exc, ResponseError) and str(exc).startswith("WRONGTYPE")
        transport = isinstance(exc, _TRANSPORT) or not isinstance(exc, ResponseError)
        with self._lock:
            if wrong_type:
                self._stats.corrupt += 1  # not a string: not one of our entries
            else:
                self._stats.errors += 1
            if transport:
                node.failed = True
                node.down_until = time.monotonic() + self._retry_after
                self._stats.extra["server_failures"] = (
                    self._stats.extra.get("server_failures", 0.0) + 1
                )
        if transport:
            # Drop the idle connections too: after a restart they are all dead.
            with contextlib.suppress(Exception):
                node.client.connection_pool.disconnect(inuse_connections=False)
        if self._cluster_mode and (transport or isinstance(exc, _TOPOLOGY)):
            self._want_refresh()

    def _want_refresh(self) -> None:
        """Have the cluster's slot map read again, in a background thread, unless a read
        ran in the last `retry_after` seconds or one is running: no caller waits for it."""
        if time.monotonic() < self._next_refresh or not self._refresh_lock.acquire(blocking=False):
            return
        try:
            threading.Thread(
                target=self._refresh_locked, name="pagedkv-remote-slots", daemon=True
            ).start()
        except Exception:
            self._refresh_lock.release()

    def _refresh_locked(self) -> None:
        """Read the cluster's slot map from the first seed that answers (every node seen so
        far is a seed: the one in the URL may be the dead one); each seed tried costs at
        most one connect and one reply timeout. Runs holding `_refresh_lock`, releases it."""
        try:
            now = time.monotonic()
            if now < self._next_refresh:
                return
            self._next_refresh = now + self._retry_after
            seeds = list(dict.fromkeys(self._seeds))
            try:
                rc = RedisCluster(
                    startup_nodes=[_ClusterNode(h, p) for h, p in seeds],
                    require_full_coverage=False,
                    retry=Retry(NoBackoff(), 0),
                    **{**self._cluster_opts, **self._timeouts},
                )
            except Exception:
                with self._lock:
                    self._stats.errors += 1
                return
            known = [(n.host, n.port) for n in cast(Any, rc).get_nodes()]
            self._seeds = list(dict.fromkeys([*seeds[:1], *known, *seeds[1:]]))
            old, self._cluster = self._cluster, rc
            if old is not None:
                with contextlib.suppress(Exception):
                    old.close()
            with self._lock:
                self._stats.extra["topology_refreshes"] = (
                    self._stats.extra.get("topology_refreshes", 0.0) + 1
                )
        finally:
            self._refresh_lock.release()


__all__ = ["RemoteTier"]
