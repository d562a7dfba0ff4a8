"""The threads behind `PagedKVTier` (docs/tiers.md, "Under stock vLLM"): they move chunks
between vLLM's CPU tier (a numpy view of its rows) and a pagedkv store, and ask a remote
store what it holds, so that no codec, MAC or network wait runs on vLLM's scheduler thread.

Two rules make the bytes right whatever order vLLM's calls come in:

- **A store copies its rows when it is submitted** (`store`, on the caller's thread: one
  gather, a memcpy). The worker encodes and stores that copy, so a later write to the
  primary rows (another request's chunk in a reused slot) cannot change what is stored
  under the key. vLLM pins the rows of a store until it finishes; the copy means
  correctness does not rest on that pin.
- **A load writes a row only from the worker, once the store returned the whole checked
  block** (the entry's MAC, key and length verified by the store), with one copy of exactly
  the row's size; the job is reported finished after every write is done. A key that
  misses, fails its check or has another length leaves its row untouched and is reported
  failed.

This module uses nothing of vLLM (its package, pagedkv.vllm, imports it).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from pagedkv.tiers.base import TierKey, TierStore

log = logging.getLogger(__name__)


@dataclass
class JobDone:
    """A finished store or load: which of its keys (by index) succeeded."""

    job_id: int
    is_load: bool
    n_keys: int
    ok: list[int]
    seconds: float
    nbytes: int


@dataclass
class _Job:
    job_id: int
    is_load: bool
    n_keys: int
    parts_left: int
    snapshot_bytes: int
    t0: float = field(default_factory=time.perf_counter)
    ok: list[int] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)


class TierWorkers:
    """A pool of threads doing one tier's stores, loads and presence checks.

    `rows` is the primary tier's memory as a 2-D ``uint8`` array, one row per chunk.
    `store`, `load` and `ask` return at once; `finished` and `answers` hand back what the
    threads did. `drain` waits until no store or load is running or queued; none is ever
    cut short. Thread-safe, though the tier calls it from one thread at a time.
    """

    def __init__(
        self,
        store: TierStore,
        rows: np.ndarray,
        *,
        workers: int = 2,
        max_pending_bytes: int = 1 << 30,
    ) -> None:
        if rows.ndim != 2 or rows.dtype != np.uint8:
            raise ValueError("rows must be a 2-D uint8 array, one row per chunk")
        if workers < 1:
            raise ValueError("workers must be at least 1")
        self.tier_store = store
        self.rows: np.ndarray | None = rows
        self.row_bytes = int(rows.shape[1])
        self.workers = workers
        self.max_pending_bytes = max_pending_bytes
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="pagedkv-vllm-tier")
        self._done: queue.SimpleQueue[JobDone] = queue.SimpleQueue()
        self._answers: queue.SimpleQueue[list[tuple[TierKey, bool]]] = queue.SimpleQueue()
        self._idle = threading.Condition()
        self._running = 0  # stores and loads submitted and not finished
        self._asks = 0  # presence batches submitted and not answered
        self._pending_bytes = 0  # snapshot bytes held by stores in flight
        self.errors = 0  # worker parts that raised (a bug or out of memory): their keys fail

    # ---- submitting (the scheduler's thread) ---------------------------------------

    def store(self, job_id: int, keys: Sequence[TierKey], chunk_ids: np.ndarray) -> bool:
        """Copy the rows `chunk_ids` now and store them under `keys` in the background;
        False (nothing copied or stored) when the copies in flight would pass
        `max_pending_bytes`, or the tier is closed."""
        rows = self.rows
        cids = self._chunk_ids(chunk_ids, len(keys))
        n = len(keys)
        need = n * self.row_bytes
        with self._idle:
            if rows is None or self._pending_bytes + need > self.max_pending_bytes:
                return False
            self._pending_bytes += need
            self._running += 1
        try:
            snap = rows[cids]  # the gather: a copy of every row, before this call returns
        except BaseException:
            with self._idle:
                self._pending_bytes -= need
                self._running -= 1
            raise
        job = _Job(job_id, False, n, 0, need)
        self._split(job, lambda lo, hi: self._store_part(job, keys, snap, lo, hi))
        return True

    def load(self, job_id: int, keys: Sequence[TierKey | None], chunk_ids: np.ndarray) -> None:
        """Read `keys` from the store and write each into its row of `chunk_ids` in the
        background (a None key fails)."""
        cids = self._chunk_ids(chunk_ids, len(keys))
        with self._idle:
            self._running += 1
        job = _Job(job_id, True, len(keys), 0, 0)
        self._split(job, lambda lo, hi: self._load_part(job, keys, cids, lo, hi))

    def ask(self, keys: Sequence[TierKey]) -> None:
        """Ask the store, in the background, how many of `keys` from the first it holds;
        the answer (`answers`) says present for those, absent for the rest."""
        with self._idle:
            self._asks += 1
        self._pool.submit(self._ask, list(keys))

    def _chunk_ids(self, chunk_ids: np.ndarray, n: int) -> np.ndarray:
        """`chunk_ids` as a private array of row indices, checked: one per key, in range."""
        cids = np.array(chunk_ids, dtype=np.intp).reshape(-1)
        n_rows = 0 if self.rows is None else len(self.rows)
        if len(cids) != n:
            raise ValueError(f"a job has {n} keys but {len(cids)} chunk ids")
        if n and (int(cids.min()) < 0 or int(cids.max()) >= n_rows):
            raise ValueError(f"chunk ids out of the primary tier's {n_rows} rows")
        return cids

    # ---- results (the scheduler's thread) ------------------------------------------

    def finished(self) -> list[JobDone]:
        """The stores and loads finished since the last call."""
        out = []
        while True:
            try:
                out.append(self._done.get_nowait())
            except queue.Empty:
                return out

    def answers(self) -> list[tuple[TierKey, bool]]:
        """The presence answers since the last call."""
        out: list[tuple[TierKey, bool]] = []
        while True:
            try:
                out += self._answers.get_nowait()
            except queue.Empty:
                return out

    def busy(self) -> bool:
        """Whether a store, load or presence check is running or queued."""
        with self._idle:
            return self._running > 0 or self._asks > 0

    def drain(self, warn_after: float = 5.0) -> None:
        """Wait until every store and load submitted has finished (reported by `finished`);
        none is aborted. Warns, and keeps waiting, after `warn_after` seconds."""
        t0 = time.monotonic()
        with self._idle:
            while self._running:
                if not self._idle.wait(warn_after) and self._running:
                    log.warning(
                        "pagedkv tier: %d jobs still running after %.0f s",
                        self._running,
                        time.monotonic() - t0,
                    )

    def close(self) -> None:
        """Finish what is running, stop the threads, and let go of the rows."""
        self.drain()
        self._pool.shutdown(wait=True)
        self.rows = None

    # ---- the threads ---------------------------------------------------------------

    def _split(self, job: _Job, part: Callable[[int, int], None]) -> None:
        n = job.n_keys
        parts = max(1, min(self.workers, n))
        step = -(-n // parts) if n else 1
        bounds = [(lo, min(n, lo + step)) for lo in range(0, max(n, 1), step)]
        job.parts_left = len(bounds)
        for lo, hi in bounds:
            self._pool.submit(self._run_part, job, part, lo, hi)

    def _run_part(self, job: _Job, part: Callable[[int, int], None], lo: int, hi: int) -> None:
        try:
            part(lo, hi)
        except Exception:  # a bug or no memory: this part's keys fail, the job still ends
            log.exception("pagedkv tier: a %s part failed", "load" if job.is_load else "store")
            with self._idle:
                self.errors += 1
        finally:
            with job.lock:
                job.parts_left -= 1
                last = job.parts_left == 0
            if last:
                self._finish(job)

    def _store_part(
        self, job: _Job, keys: Sequence[TierKey], snap: np.ndarray, lo: int, hi: int
    ) -> None:
        for i in range(lo, hi):
            if self.tier_store.put(keys[i], memoryview(snap[i])):
                with job.lock:
                    job.ok.append(i)

    def _load_part(
        self, job: _Job, keys: Sequence[TierKey | None], cids: np.ndarray, lo: int, hi: int
    ) -> None:
        rows = self.rows
        for i in range(lo, hi):
            key = keys[i]
            data = None if key is None or rows is None else self.tier_store.get(key)
            if data is None or len(data) != self.row_bytes:
                continue  # the row is left as it was; the key is reported failed
            assert rows is not None
            rows[cids[i]] = np.frombuffer(data, dtype=np.uint8)
            with job.lock:
                job.ok.append(i)

    def _finish(self, job: _Job) -> None:
        ok = sorted(job.ok)
        nbytes = len(ok) * self.row_bytes
        self._done.put(
            JobDone(job.job_id, job.is_load, job.n_keys, ok, time.perf_counter() - job.t0, nbytes)
        )
        with self._idle:
            self._running -= 1
            self._pending_bytes -= job.snapshot_bytes
            self._idle.notify_all()

    def _ask(self, keys: list[TierKey]) -> None:
        n = 0
        try:
            n = self.tier_store.count_present(keys)
        except Exception:  # stores do not raise; if one does, every key is absent
            log.exception("pagedkv tier: a presence check failed")
        finally:
            self._answers.put([(k, i < n) for i, k in enumerate(keys)])
            with self._idle:
                self._asks -= 1


__all__ = ["JobDone", "TierWorkers"]
