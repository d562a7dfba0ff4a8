"""`Publisher`: a manager's (or a `TieredCache`'s) KV events on a ZMQ PUB socket, as vLLM sends
them, with vLLM's replay socket and pagedkv's epoch, heartbeats and snapshots (docs/events.md).

One thread owns both sockets (ZMQ sockets are not thread-safe). It drains the source's event
queue (the manager appends to it on the hot path; nothing else is done there), encodes each
drain as one batch with the next sequence number, applies it to its own `BlockSet`, sends it
as `[topic, seq (8 bytes, big-endian), payload]` and keeps it for replay. Since one thread
numbers, applies and sends, a snapshot taken between two batches is exactly the state before
the next sequence number.

The source's queue is bounded (`queue_events`): a manager call that finds it full drops it
and never waits. The thread then resynchronises: `AllBlocksCleared` and the source's own
snapshot of what its events describe (taken between two of its events), as ordinary
batches, so any router that applies vLLM's events in order ends with the right set. Every
publisher's first batches are such a resync, so it announces what was cached before it
started.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from typing import Any, Protocol

import zmq

from pagedkv import _core
from pagedkv.errors import InvalidArgumentError, KVEventsOverflowError
from pagedkv.events import (
    DEFAULT_EVENT_CAPACITY,
    AllBlocksCleared,
    BlockStored,
    KVEvent,
    KVEventQueueStats,
)
from pagedkv.kv_events import wire
from pagedkv.kv_events.blockset import BlockSet

END_SEQ = (-1).to_bytes(8, "big", signed=True)
# Requests on the replay socket besides vLLM's 8-byte start sequence number.
SNAPSHOT = b"pagedkv-snapshot"
# The same in compact parts (pagedkv-router's `compact.rs`: each holder's hashes packed),
# written from the publisher's `HeldBlocks` in Rust; a publisher of digest hashes answers it
# with the usual payloads (docs/events.md).
SNAPSHOT_COMPACT = b"pagedkv-snapshot-compact"
EPOCH = b"pagedkv-epoch"
SNAPSHOT_CHUNK = 256  # BlockStored events per snapshot batch
RESYNC_CHUNK = 4096  # events per batch of a resync
YIELD_EVERY = 64  # events the thread handles between GIL hand-offs


class EventSource(Protocol):
    def drain_events(self) -> list[KVEvent]: ...
    def kv_event_snapshot(self) -> list[BlockStored]: ...
    def set_kv_event_capacity(self, capacity: int | None) -> None: ...
    def kv_event_queue_stats(self) -> KVEventQueueStats: ...


def _sources(source: Any) -> list[EventSource]:
    """A TieredCache's events are its manager's (GPU) and its tiers' own."""
    if not hasattr(source, "drain_events"):
        raise TypeError(f"source must have drain_events(), got {type(source).__name__}")
    inner = getattr(source, "manager", None)
    if inner is not None and hasattr(inner, "drain_events"):
        return [inner, source]
    return [source]


def _seq(n: int) -> bytes:
    return n.to_bytes(8, "big", signed=True)


class Publisher:
    """Publishes `source`'s KV events until `close()`.

    `endpoint`: the PUB socket (bound); `replay_endpoint`: the ROUTER socket for replays and
    snapshots (bound, or None); `topic`: default `kv@<pod>@<model>`; `buffer_steps`: batches
    kept for replay; `interval`: seconds between drains when idle; `heartbeat`: seconds of
    silence after which an empty batch goes out (its sequence number is the newest);
    `wire_options`: the payload's form; `queue_events`: the bound it sets on the source's
    event queues (None: unbounded); past it the source drops events and the publisher
    resynchronises (`resyncs`). A tier's `BlockStored` carries no token
    ids; the publisher fills them (and the parent) from the last `memo_blocks` GPU blocks it
    saw stored, so routers that rebuild keys from tokens can use it. `send_filter(seq) ->
    bool` is for tests: False drops that batch from the PUB socket (it stays in the replay
    buffer)."""

    def __init__(
        self,
        source: Any,
        *,
        endpoint: str = "tcp://*:5557",
        replay_endpoint: str | None = None,
        topic: str | None = None,
        pod: str = "pagedkv",
        model: str = "model",
        buffer_steps: int = 10_000,
        interval: float = 0.001,
        heartbeat: float = 1.0,
        wire_options: wire.WireOptions | None = None,
        queue_events: int | None = DEFAULT_EVENT_CAPACITY,
        memo_blocks: int = 1 << 16,
        send_filter: Callable[[int], bool] | None = None,
        context: zmq.Context[Any] | None = None,
    ) -> None:
        if buffer_steps < 1:
            raise ValueError(f"buffer_steps must be at least 1, got {buffer_steps}")
        if memo_blocks < 0:
            raise ValueError(f"memo_blocks must be >= 0, got {memo_blocks}")
        if interval <= 0 or heartbeat <= 0:
            raise ValueError("interval and heartbeat must be positive")
        self._sources = _sources(source)
        q: object = queue_events
        if q is not None and (isinstance(q, bool) or not isinstance(q, int) or q < 1):
            raise InvalidArgumentError(
                f"queue_events (the queue's capacity) must be an int >= 1 or None, got {q!r}"
            )
        for s in self._sources:  # raises, changing nothing, for a source without events
            s.kv_event_queue_stats()
        self.topic = (topic if topic is not None else f"kv@{pod}@{model}").encode()
        self.epoch = int.from_bytes(os.urandom(8), "big") >> 1  # fits a signed 64-bit int
        self.encoder = wire.WireEncoder(wire_options)
        # The block set follows the map form whatever the wire's form (it needs group_idx).
        self._mirror_encoder = (
            self.encoder
            if self.encoder.options.event_form == "map"
            else wire.WireEncoder(
                wire.WireOptions(hash_form=self.encoder.options.hash_form, event_form="map")
            )
        )
        self.state = BlockSet()
        # The same blocks in Rust, for compact snapshots (integer hashes only).
        self._held = _core.HeldBlocks() if self.encoder.options.hash_form == "int" else None
        # (group, digest) -> (parent digest, token ids, lora id) of recent GPU blocks.
        self._memo: OrderedDict[tuple[int, bytes], tuple[bytes | None, list[int], int | None]]
        self._memo = OrderedDict()
        self._memo_blocks = memo_blocks
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._interval = interval
        self._heartbeat = heartbeat
        self._send_filter = send_filter
        self.next_seq = 0
        self.batches = 0
        self.heartbeats = 0
        self.events = 0
        self.dropped = 0
        self.replays = 0
        self.snapshots = 0
        self.compact_snapshots = 0  # of `snapshots`, those sent in compact parts
        self.resyncs = 0
        self._resync_due = True  # the first round announces what the source holds already
        ctx = context or zmq.Context.instance()
        self._pub = ctx.socket(zmq.PUB)
        self._replay: zmq.Socket[Any] | None = None
        try:
            self._pub.setsockopt(zmq.LINGER, 0)
            self._pub.bind(endpoint)
            self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
            self.replay_endpoint: str | None = None
            if replay_endpoint is not None:
                self._replay = ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                # No limit: a ROUTER drops what passes its limit silently, and a snapshot
                # is as long as the cache is large (not bounded by buffer_steps).
                self._replay.setsockopt(zmq.SNDHWM, 0)
                self._replay.bind(replay_endpoint)
                self.replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
            # Last: a publisher that failed to start leaves its source's bound as it was.
            for s in self._sources:
                s.set_kv_event_capacity(queue_events)
        except Exception:
            self._close_sockets()
            raise
        self._cv = threading.Condition()
        self._rounds = 0
        self._stop = False
        self._last_send = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="pagedkv-kv-events", daemon=True)
        self._thread.start()

    # ---- the thread --------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while True:
                with self._cv:
                    stop = self._stop
                self._step()
                with self._cv:
                    self._rounds += 1
                    self._cv.notify_all()
                if stop:
                    return
                if self._replay is not None:
                    if self._replay.poll(int(self._interval * 1000) or 1):
                        self._serve()
                else:
                    time.sleep(self._interval)
        finally:
            self._close_sockets()

    def _step(self) -> None:
        events: list[KVEvent] = []
        if not self._resync_due:
            for s in self._sources:
                try:
                    events.extend(s.drain_events())
                except KVEventsOverflowError:
                    self._resync_due = True
                    break
        if self._resync_due:
            self._resync()
        elif events:
            self._publish(events)
        elif time.monotonic() - self._last_send >= self._heartbeat:
            self.heartbeats += 1
            self._publish([])

    def _resync(self) -> None:
        """Clear, then every source's snapshot: each is taken between two of its events and
        restarts its queue, so the batches drained after continue it (the events drained
        from a source earlier this round are in its snapshot)."""
        if self.next_seq > 0:
            self.resyncs += 1
        self._resync_due = False
        events: list[KVEvent] = [AllBlocksCleared()]
        for s in self._sources:
            events.extend(s.kv_event_snapshot())
        for i in range(0, len(events), RESYNC_CHUNK):
            self._publish(events[i : i + RESYNC_CHUNK])

    def _fill(self, events: list[KVEvent]) -> list[KVEvent]:
        """Remember GPU blocks' tokens; give them to tier BlockStored events without any."""
        memo, out = self._memo, []
        for e in events:
            if isinstance(e, BlockStored):
                if e.token_ids or e.medium == "GPU":
                    bs, parent = e.block_size, e.parent_block_hash
                    for i, d in enumerate(e.block_hashes):
                        memo[(e.group_idx, d)] = (
                            parent,
                            e.token_ids[i * bs : (i + 1) * bs],
                            e.lora_id,
                        )
                        memo.move_to_end((e.group_idx, d))
                        parent = d
                    while len(memo) > self._memo_blocks:
                        memo.popitem(last=False)
                elif len(e.block_hashes) == 1 and (e.group_idx, e.block_hashes[0]) in memo:
                    parent, toks, lora = memo[(e.group_idx, e.block_hashes[0])]
                    e = dataclasses.replace(
                        e, parent_block_hash=parent, token_ids=toks, lora_id=lora
                    )
            out.append(e)
        return out

    def _publish(self, events: list[KVEvent]) -> None:
        if self._memo_blocks:
            events = self._fill(events)
        structs: list[Any] = []
        for i in range(0, max(len(events), 1), YIELD_EVERY):
            part = events[i : i + YIELD_EVERY]
            made = self.encoder.structs(part)
            structs += made
            same = self._mirror_encoder is self.encoder
            self.state.apply(made if same else self._mirror_encoder.structs(part))
            # Let the manager's callers have the GIL: otherwise each waits for the switch
            # interval (5 ms) whenever this thread holds it through a long batch.
            time.sleep(0)
        payload = self.encoder.payload(structs)
        if self._held is not None:
            self._held.apply(payload)
        seq = self.next_seq
        self.next_seq += 1
        self.batches += 1
        self.events += len(events)
        self._buffer.append((seq, payload))
        if self._send_filter is None or self._send_filter(seq):
            self._pub.send_multipart((self.topic, _seq(seq), payload))
        else:
            self.dropped += 1
        self._last_send = time.monotonic()

    def _serve(self) -> None:
        """Answer one request on the replay socket."""
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) == 3:
            self._answer(frames[0], frames[2])

    def _answer(self, client: bytes, req: bytes) -> None:
        """Answer `client`'s request `req` (an epoch, a snapshot, a replay; else nothing)."""
        out = self._replay
        assert out is not None
        if req == EPOCH:
            out.send_multipart((client, b"", EPOCH, _seq(self.epoch), _seq(self.next_seq)))
            return
        if req in (SNAPSHOT, SNAPSHOT_COMPACT):
            self.snapshots += 1
            resume = self.next_seq
            out.send_multipart((client, b"", req, _seq(self.epoch), _seq(resume)))
            if req == SNAPSHOT_COMPACT and self._held is not None:
                self.compact_snapshots += 1
                payloads = self._held.parts()
            else:
                evs = self.state.snapshot_events(self.encoder)
                payloads = [
                    self.encoder.payload(evs[i : i + SNAPSHOT_CHUNK])
                    for i in range(0, len(evs), SNAPSHOT_CHUNK)
                ]
            for payload in payloads:
                out.send_multipart((client, b"", self.topic, _seq(resume), payload))
            out.send_multipart((client, b"", b"", END_SEQ, b""))
            return
        if len(req) != 8:
            return
        # vLLM's replay: every buffered batch from the start sequence number, then -1.
        self.replays += 1
        start = int.from_bytes(req, "big", signed=True)
        for seq, payload in self._buffer:
            if seq >= start:
                out.send_multipart((client, b"", self.topic, _seq(seq), payload))
        out.send_multipart((client, b"", b"", END_SEQ, b""))

    def _close_sockets(self) -> None:
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)

    # ---- callers -----------------------------------------------------------------------

    def flush(self, timeout: float = 10.0) -> None:
        """Return once every event drained before the call has been sent."""
        with self._cv:
            target = self._rounds + 2  # a round that began after this call has ended
            if not self._cv.wait_for(
                lambda: self._rounds >= target or not self._thread.is_alive(), timeout
            ):
                raise TimeoutError("the publisher thread did not finish a round in time")

    def close(self, timeout: float = 10.0) -> None:
        """Send what is left, stop the thread and close the sockets."""
        with self._cv:
            self._stop = True
        self._thread.join(timeout)

    def __enter__(self) -> Publisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["END_SEQ", "EPOCH", "SNAPSHOT", "SNAPSHOT_COMPACT", "EventSource", "Publisher"]
