"""Following engines' live KV event streams into a `RouterIndex`, one thread per engine.

The recovery is the reference subscriber's (`pagedkv.kv_events.Subscriber`: sequence gaps
replayed, epochs checked, snapshots taken at start and when replay cannot fill a gap);
only where the batches go differs: the payloads are handed to the Rust index undecoded, and
a snapshot is staged beside the engine's blocks and swapped in when complete, so lookups
never see a half-received snapshot.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

from pagedkv.errors import KVEventPayloadError
from pagedkv.kv_events.publisher import SNAPSHOT, SNAPSHOT_COMPACT
from pagedkv.kv_events.subscriber import RecoveryError, Subscriber

if TYPE_CHECKING:
    from pagedkv.router.index import EngineId, RouterIndex


class _IndexSubscriber(Subscriber):
    """The reference subscriber, applying to one engine of a router index."""

    # Compact parts: the index applies them in bulk, and the publisher writes them in Rust.
    snapshot_request = SNAPSHOT_COMPACT

    def __init__(self, index: RouterIndex, engine_id: EngineId, **kwargs: Any) -> None:
        self._index, self._engine = index, engine_id
        self.batches = 0
        self.bad_payloads = 0  # payloads the index refused (counted in its stats too)
        super().__init__(**kwargs)

    def snapshot(self) -> None:
        try:
            super().snapshot()
        except RecoveryError as e:
            # A pagedkv publisher older than compact snapshots leaves the request unanswered:
            # ask in the usual form from now on (the caller resynchronises at the next
            # message, as after any unanswered request).
            if self.snapshot_request == SNAPSHOT_COMPACT and "no answer" in str(e):
                self.snapshot_request = SNAPSHOT
            raise

    def _apply(self, seq: int, payload: bytes) -> None:
        try:
            self._index.apply(self._engine, payload)
            self.batches += 1
        except KVEventPayloadError:
            self.bad_payloads += 1
        self.next_seq = seq + 1

    def _snapshot_begin(self) -> None:
        self._index.begin_snapshot(self._engine)

    def _snapshot_part(self, payload: bytes) -> None:
        try:
            self._index.apply_staged(self._engine, payload)
        except KVEventPayloadError:
            self.bad_payloads += 1

    def _snapshot_commit(self) -> None:
        self._index.commit_snapshot(self._engine)

    def _snapshot_abort(self) -> None:
        self._index.abort_snapshot(self._engine)

    def _clear(self) -> None:
        # A restarted engine without epochs (vLLM's): an empty snapshot, swapped in at once.
        self._index.begin_snapshot(self._engine)
        self._index.commit_snapshot(self._engine)


class Follower:
    """One engine's stream, applied on a thread of its own until `close()`.

    Counters (read from any thread; each is one int): `batches` applied, `gaps` seen,
    `replays` and `snapshots` taken, `lost` (gaps neither could fill: vLLM's publisher, which
    serves no snapshots), `failures` (the replay socket did not answer in time; the follower
    resynchronises at the next message), `restarts` (publishers without epochs seen to
    restart), `bad_payloads` (refused by the index)."""

    def __init__(
        self,
        index: RouterIndex,
        engine_id: EngineId,
        endpoint: str,
        replay_endpoint: str | None,
        *,
        topic: str = "",
        timeout: float = 5.0,
        epoch_check: float = 1.0,
        poll: float = 0.05,
    ) -> None:
        self.engine_id = engine_id
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._sub: _IndexSubscriber | None = None
        self._poll = poll
        kwargs = {
            "endpoint": endpoint,
            "replay_endpoint": replay_endpoint,
            "topic": topic,
            "timeout": timeout,
            "epoch_check": epoch_check,
        }
        # The sockets are made, used and closed on the thread (ZMQ sockets are not
        # thread-safe); a bad endpoint is raised here.
        self._thread = threading.Thread(
            target=self._run,
            args=(index, kwargs),
            name=f"pagedkv-router-{engine_id}",
            daemon=True,
        )
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            raise self._error

    def _run(self, index: RouterIndex, kwargs: dict[str, Any]) -> None:
        try:
            sub = _IndexSubscriber(index, self.engine_id, **kwargs)
        except BaseException as e:
            self._error = e
            self._ready.set()
            return
        self._sub = sub
        self._ready.set()
        try:
            while not self._stop.is_set():
                sub.poll(self._poll)
        finally:
            sub.close()

    def _count(self, name: str) -> int:
        return int(getattr(self._sub, name, 0))

    @property
    def synced(self) -> bool:
        """Whether the follower is in step with the stream (it has applied a batch or a
        snapshot and knows the next sequence number)."""
        return self._sub is not None and self._sub.next_seq is not None

    @property
    def next_seq(self) -> int | None:
        return None if self._sub is None else self._sub.next_seq

    @property
    def epoch(self) -> int | None:
        """The publisher's epoch the follower last took a snapshot in (None before one, and
        for publishers without epochs): a restarted publisher numbers from 0 again, so the
        sequence number alone cannot say the follower caught up with it."""
        return None if self._sub is None else self._sub.epoch

    batches = property(lambda self: self._count("batches"))
    gaps = property(lambda self: self._count("gaps"))
    replays = property(lambda self: self._count("replays"))
    snapshots = property(lambda self: self._count("snapshots"))
    lost = property(lambda self: self._count("lost"))
    failures = property(lambda self: self._count("failures"))
    restarts = property(lambda self: self._count("restarts"))
    bad_payloads = property(lambda self: self._count("bad_payloads"))

    def close(self, timeout: float = 10.0) -> None:
        """Stop the thread and close its sockets (the engine's blocks stay in the index)."""
        self._stop.set()
        self._thread.join(timeout)


__all__ = ["Follower"]
