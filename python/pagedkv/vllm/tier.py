"""`PagedKVTier`: pagedkv's tier stores as a secondary tier of vLLM 0.33's CPU offloading
(docs/tiers.md, "Under stock vLLM"), loaded by configuration alone::

    --kv-transfer-config '{"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
      "kv_connector_extra_config": {"spec_name": "TieringOffloadingSpec",
        "cpu_bytes_to_use": 8589934592,
        "secondary_tiers": [{"type": "PagedKVTier", "module_path": "pagedkv.vllm",
                             "host_bytes": "32GiB", "codec": "shuffle+lz4"}]}}'

One tier keeps one store: host memory (``host_bytes``, raw or through ``codec``) or a
Redis-protocol server (``redis_url``, ``redis_cluster``); list two tiers for both.

Every method runs on vLLM's scheduler thread, under vLLM's manager lock, and returns
without waiting on a codec, a MAC or the network: those run on `TierWorkers`' threads.
What each answer means:

- ``lookup``: HIT when the store holds the key (a host store's index is asked in place; a
  Redis store's presence comes from a background EXISTS, reused for ``lookup_ttl_s``),
  MISS when it does not or a load of it failed in the last ``lookup_ttl_s``, RETRY while a
  store of that key is in flight here (answered HIT or MISS once it lands) or while a Redis
  presence check is in flight (sent at the step's end, all the step's keys in one pipelined
  round trip per request; past the first absent key of a request's keys, absent).
- ``submit_store``: copies the rows at once (a memcpy), then stores the copy in the
  background; keys present already, or with a store in flight, are skipped. Success means
  every stored key landed; a full, dead or slow store drops keys (success False).
- ``submit_load``: each key read, checked and written into its row in the background; the
  job finishes after the writes; keys that missed are reported by ``successful_keys``.
- ``drain_jobs``: waits for every store and load; none is aborted.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Collection, Iterable
from typing import TYPE_CHECKING, Any

import numpy as np
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
    OffloadingConnectorStats,
)
from vllm.v1.kv_offload.base import (
    Locality,
    LookupResult,
    Medium,
    OffloadingCounterMetadata,
    OffloadingEvent,
    OffloadingGaugeMetadata,
    OffloadingMetricMetadata,
    OffloadKey,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
)
from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager, TransferJob
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from pagedkv.tiers.base import TierKey, TierStats
from pagedkv.vllm.tier_jobs import JobDone, TierWorkers
from pagedkv.vllm.tier_options import TierOptions, namespace_of

if TYPE_CHECKING:
    from vllm.v1.kv_offload.base import OffloadingSpec
    from vllm.v1.kv_offload.tiering.backpressure import BackpressureDetector

#: Metric names (Prometheus), labelled by the store's name (host, host_compressed, remote).
_COUNTERS = {
    "puts": "pagedkv:tier_puts",
    "dropped_puts": "pagedkv:tier_dropped_puts",
    "hits": "pagedkv:tier_load_hits",
    "misses": "pagedkv:tier_load_misses",
    "corrupt": "pagedkv:tier_corrupt",
    "errors": "pagedkv:tier_errors",
    "evictions": "pagedkv:tier_evictions",
}
_GAUGES = {"entries": "pagedkv:tier_entries", "stored_bytes": "pagedkv:tier_stored_bytes"}
_LABEL = "pagedkv_store"


def tier_key(key: OffloadKey) -> TierKey | None:
    """The pagedkv key of a vLLM `OffloadKey` (the block hash, then the group index as 4
    big-endian bytes): the group and the hash (a hash over 32 bytes is its SHA-256); None
    for a group past 255, which pagedkv's entries cannot name (such a key always misses)."""
    raw = bytes(key)
    if len(raw) < 5:
        return None
    group = int.from_bytes(raw[-4:], "big")
    if group > 0xFF:
        return None
    digest = raw[:-4]
    if len(digest) > 32:
        digest = hashlib.sha256(digest).digest()
    return TierKey(group, digest)


def offload_key(key: TierKey) -> OffloadKey | None:
    """The `OffloadKey` back from a pagedkv key, when it can be (a hash of 32 bytes or
    fewer); None otherwise."""
    if len(key.digest) > 32:
        return None
    return OffloadKey(key.digest + key.group.to_bytes(4, "big"))


class PagedKVTier(SecondaryTierManager):
    """A vLLM secondary tier on a pagedkv store (module docstring)."""

    medium = Medium.CPU  # a Redis tier sets STORAGE on itself

    def __init__(
        self,
        offloading_spec: OffloadingSpec,
        primary_kv_view: memoryview,
        tier_type: str,
        backpressure_detector: BackpressureDetector | None = None,
        **options: Any,
    ) -> None:
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        self.options = TierOptions.parse(options)
        rows = np.asarray(primary_kv_view)
        rows = rows.reshape(rows.shape[0], -1).view(np.uint8)
        if rows.shape[1] != self.block_size_bytes or not rows.flags.c_contiguous:
            raise ValueError("the primary KV view must be contiguous rows of one chunk each")
        self.namespace = namespace_of(offloading_spec, self.block_size_bytes, self.options)
        store = self.options.build_store(self.namespace)
        self.tier_store = store
        self._remote = self.options.remote
        if self._remote:
            # Instance attributes: vLLM reads them per tier (filters, events, hit metrics).
            self.medium = Medium.STORAGE
            self.cache_hit_source = CacheHitSource.EXTERNAL_UNSPECIFIED
        default_locality = "REMOTE" if self._remote else "LOCAL"
        self.locality = Locality(self.options.locality or default_locality)
        self._workers = TierWorkers(
            store,
            rows,
            workers=self.options.workers,
            max_pending_bytes=self.options.max_pending_bytes,
        )
        self._ttl = self.options.lookup_ttl_s
        self._events: list[OffloadingEvent] | None = None
        if self.options.kv_events and offloading_spec.kv_events_config.enable_kv_cache_events:
            self._events = []
        # Scheduler-thread state (vLLM's lock serialises every call).
        self._storing: dict[OffloadKey, int] = {}  # key -> the store job carrying it
        # store job -> (its keys handed to the workers, whether those were all its keys)
        self._store_keys: dict[int, tuple[list[OffloadKey], bool]] = {}
        self._load_keys: dict[int, list[OffloadKey]] = {}
        self._done_now: list[JobResult] = []  # jobs finished on submission
        self._failed: dict[OffloadKey, float] = {}  # key -> until when it is a MISS
        self._verdicts: dict[TierKey, tuple[bool, float]] = {}  # Redis presence, until when
        self._asked: set[TierKey] = set()
        self._ask_batch: dict[str, list[TierKey]] = {}
        self._prune_at = 4096
        self._reported = TierStats(store.stats().name)
        self._closed = False

    # ---- lookups ---------------------------------------------------------------------

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        if key in self._storing:
            return LookupResult.RETRY
        tk = tier_key(key)
        if tk is None or self._closed:
            return LookupResult.MISS
        now = time.monotonic()
        until = self._failed.get(key)
        if until is not None:
            if until > now:
                return LookupResult.MISS
            del self._failed[key]
        if not self._remote:
            # An in-memory index under a short lock: no wait worth a thread hop.
            return LookupResult.HIT if self.tier_store.count_present([tk]) else LookupResult.MISS
        self._take_answers()
        verdict = self._verdicts.get(tk)
        if verdict is not None and verdict[1] > now:
            return LookupResult.HIT if verdict[0] else LookupResult.MISS
        if tk not in self._asked:
            self._asked.add(tk)
            self._ask_batch.setdefault(req_context.req_id, []).append(tk)
        return LookupResult.RETRY

    def _take_answers(self) -> None:
        answers = self._workers.answers()
        if not answers:
            return
        until = time.monotonic() + self._ttl
        for tk, present in answers:
            self._asked.discard(tk)
            self._verdicts[tk] = (present, until)

    def _send_asks(self) -> None:
        for keys in self._ask_batch.values():
            self._workers.ask(keys)
        self._ask_batch = {}

    def _prune(self) -> None:
        """Forget expired answers once they pass twice what was left last time (amortised:
        the maps stay within twice the keys asked in the last `lookup_ttl_s`)."""
        if len(self._verdicts) + len(self._failed) <= self._prune_at:
            return
        now = time.monotonic()
        self._verdicts = {k: v for k, v in self._verdicts.items() if v[1] > now}
        self._failed = {k: t for k, t in self._failed.items() if t > now}
        self._prune_at = max(4096, 2 * (len(self._verdicts) + len(self._failed)))

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        return  # the store's own LRU counts reads; a look-up is not a use

    # ---- jobs ------------------------------------------------------------------------

    def submit_store(self, job_metadata: TransferJob) -> None:
        job_id = job_metadata.job_id
        keys = list(job_metadata.keys)
        cids = np.asarray(job_metadata.chunk_ids)
        if len(keys) != len(cids):
            raise ValueError(f"store job {job_id}: {len(keys)} keys, {len(cids)} chunk ids")
        picked: list[int] = []
        tkeys: list[TierKey] = []
        unstorable = False
        now = time.monotonic()
        for i, key in enumerate(keys):
            tk = tier_key(key)
            if tk is None:
                unstorable = True
                continue
            if key in self._storing or self._held(tk, now):
                continue  # the same key is the same prefix's KV: stored once is enough
            picked.append(i)
            tkeys.append(tk)
        if not picked or self._closed:
            ok = not unstorable and not self._closed
            self._done_now.append(JobResult(job_id, ok, transfer_time=0.0, transfer_bytes=0))
            return
        if not self._workers.store(job_id, tkeys, cids[picked]):
            self._done_now.append(JobResult(job_id, False))  # over max_pending_bytes: dropped
            return
        stored = [keys[i] for i in picked]
        for key in stored:
            self._storing[key] = job_id
        self._store_keys[job_id] = (stored, not unstorable)

    def _held(self, tk: TierKey, now: float) -> bool:
        if not self._remote:
            return self.tier_store.count_present([tk]) == 1
        verdict = self._verdicts.get(tk)
        return verdict is not None and verdict[0] and verdict[1] > now

    def submit_load(self, job_metadata: TransferJob) -> None:
        job_id = job_metadata.job_id
        keys = list(job_metadata.keys)
        cids = np.asarray(job_metadata.chunk_ids)
        if len(keys) != len(cids):
            raise ValueError(f"load job {job_id}: {len(keys)} keys, {len(cids)} chunk ids")
        if self._closed:
            self._done_now.append(JobResult(job_id, False))
            return
        self._workers.load(job_id, [tier_key(k) for k in keys], cids)
        self._load_keys[job_id] = keys

    def get_finished_jobs(self) -> Iterable[JobResult]:
        out, self._done_now = self._done_now, []
        now = time.monotonic()
        for done in self._workers.finished():
            out.append(self._load_done(done, now) if done.is_load else self._store_done(done, now))
        removed = self.tier_store.drain_removed()  # drained always: the list grows until drained
        if self._events is not None and removed:
            gone = [k for k in map(offload_key, removed) if k is not None]
            if gone:
                self._events.append(self._event(gone, removed=True))
        return out

    def _store_done(self, done: JobDone, now: float) -> JobResult:
        keys, whole = self._store_keys.pop(done.job_id)
        ok = [keys[i] for i in done.ok]
        for key in keys:
            if self._storing.get(key) == done.job_id:
                del self._storing[key]
        if self._remote:
            for key in ok:
                tk = tier_key(key)
                if tk is not None:
                    self._verdicts[tk] = (True, now + self._ttl)
        if self._events is not None and ok:
            self._events.append(self._event(ok, removed=False))
        return JobResult(
            done.job_id,
            whole and len(ok) == len(keys),
            transfer_time=done.seconds,
            transfer_bytes=done.nbytes,
        )

    def _load_done(self, done: JobDone, now: float) -> JobResult:
        keys = self._load_keys.pop(done.job_id)
        ok = [keys[i] for i in done.ok]
        success = len(ok) == len(keys)
        if not success:
            good = set(done.ok)
            for i, key in enumerate(keys):
                if i not in good:
                    self._failed[key] = now + self._ttl  # no promotion loop on a dead key
                    tk = tier_key(key)
                    if tk is not None:
                        self._verdicts.pop(tk, None)
        return JobResult(
            done.job_id,
            success,
            successful_keys=None if success or not ok else ok,
            transfer_time=done.seconds,
            transfer_bytes=done.nbytes,
        )

    def has_pending_work(self) -> bool:
        return bool(self._done_now or self._ask_batch) or self._workers.busy()

    def drain_jobs(self) -> None:
        self._workers.drain()

    # ---- requests, steps, events -----------------------------------------------------

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def on_request_finished(self, req_context: ReqContext) -> None:
        # Its questions not sent yet are dropped, and forgotten, so that another request
        # asking for those keys sends them; those sent stay in _asked until answered.
        for tk in self._ask_batch.pop(req_context.req_id, ()):
            self._asked.discard(tk)

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        if self._ask_batch:
            self._send_asks()
        self._prune()

    def take_events(self) -> Iterable[OffloadingEvent]:
        if not self._events:
            return ()
        out, self._events = self._events, []
        return out

    def _event(self, keys: list[OffloadKey], *, removed: bool) -> OffloadingEvent:
        return OffloadingEvent(
            keys=keys, medium=self.medium, removed=removed, locality=self.locality
        )

    # ---- statistics ------------------------------------------------------------------

    @classmethod
    def build_metric_definitions(
        cls, extra_config: dict[str, Any]
    ) -> dict[str, OffloadingMetricMetadata]:
        defs: dict[str, OffloadingMetricMetadata] = {
            name: OffloadingCounterMetadata(
                documentation=f"pagedkv tier store: {field.replace('_', ' ')}",
                labelnames=(_LABEL,),
            )
            for field, name in _COUNTERS.items()
        }
        for field, name in _GAUGES.items():
            defs[name] = OffloadingGaugeMetadata(
                documentation=f"pagedkv tier store: {field.replace('_', ' ')} now",
                labelnames=(_LABEL,),
            )
        return defs

    def tier_stats(self) -> TierStats:
        """The store's own statistics (pagedkv's `TierStats`), whole."""
        return self.tier_store.stats()

    def get_stats(self) -> OffloadingConnectorStats | None:
        """The store's counters since the last call and its size now."""
        now = self.tier_store.stats()
        out = OffloadingConnectorStats()
        label = (now.name,)
        for field, name in _COUNTERS.items():
            delta = getattr(now, field) - getattr(self._reported, field)
            if delta:
                out.increase_counter(name, delta, label)
        if not self._remote:
            for field, name in _GAUGES.items():
                out.set_gauge(name, getattr(now, field), label)
        self._reported = now
        return None if out.is_empty() else out

    def shutdown(self) -> None:
        """Finish every job, stop the threads, close a Redis store's connections."""
        if self._closed:
            return
        self._closed = True
        self._workers.close()
        close = getattr(self.tier_store, "close", None)
        if close is not None:
            close()


__all__ = ["PagedKVTier", "offload_key", "tier_key"]
