"""`Subscriber`: a reference router-side indexer for a `Publisher` (or a vLLM publisher).

It follows the PUB stream, checks each sequence number, and on a gap asks the replay socket
for the missing batches; when those are gone from the buffer (or it starts, or the publisher's
epoch changed) it takes a snapshot and resumes from the snapshot's sequence number. Its
`BlockSet` then equals the publisher's after the same sequence number.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import zmq

from pagedkv.kv_events import wire
from pagedkv.kv_events.blockset import BlockSet
from pagedkv.kv_events.publisher import END_SEQ, EPOCH, SNAPSHOT


class RecoveryError(RuntimeError):
    """The replay socket did not answer in time."""


class NoSnapshots(RecoveryError):
    """The publisher answers replays but not snapshots (vLLM's own)."""


def _int(b: bytes) -> int:
    return int.from_bytes(b, "big", signed=True)


class Subscriber:
    """Connects to `endpoint` (PUB) and `replay_endpoint` (ROUTER); call `poll()` in a loop.

    `on_batch(seq, events)` sees every batch applied (the command line prints with it).
    Every `epoch_check` seconds `poll` asks the publisher's epoch: a restarted publisher
    whose numbers happen to continue ours is otherwise indistinguishable from the old one."""

    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None,
        *,
        topic: str = "",
        event_form: wire.EventForm = "map",
        timeout: float = 5.0,
        epoch_check: float = 1.0,
        on_batch: Callable[[int, list[Any]], None] | None = None,
        context: zmq.Context[Any] | None = None,
    ) -> None:
        ctx = context or zmq.Context.instance()
        self.blocks = BlockSet()
        self._fresh = self.blocks
        self.next_seq: int | None = None  # None: not in step with the stream yet
        self.epoch: int | None = None
        self.gaps = 0
        self.lost = 0  # gaps that neither a replay nor a snapshot could fill
        self.restarts = 0  # new publishers told apart by their sequence numbers alone (vLLM's)
        self._last_seq: int | None = None  # of the last message on the PUB socket
        self.replays = 0
        self.snapshots = 0
        self._decode = wire.decoder(event_form).decode
        self._timeout_ms = int(timeout * 1000)
        self._on_batch = on_batch
        self._epoch_check = epoch_check
        self._checked = time.monotonic()
        self._sub = ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self._sub.connect(endpoint)
        self._ctx, self._replay_endpoint = ctx, replay_endpoint
        self.failures = 0
        self.snapshots_supported = True  # until the publisher shows otherwise
        self._req: zmq.Socket[Any] | None = None
        self._open_req()

    def _open_req(self) -> None:
        """A fresh DEALER socket: late answers to an abandoned request go with the old one."""
        if self._req is not None:
            self._req.close(linger=0)
        if self._replay_endpoint is not None:
            self._req = self._ctx.socket(zmq.DEALER)
            self._req.setsockopt(zmq.LINGER, 0)
            self._req.connect(self._replay_endpoint)

    def close(self) -> None:
        self._sub.close(linger=0)
        if self._req is not None:
            self._req.close(linger=0)

    # ---- the replay socket -------------------------------------------------------------

    def _ask(self, request: bytes) -> None:
        assert self._req is not None
        self._req.send_multipart((b"", request))

    def _recv(self) -> list[bytes]:
        assert self._req is not None
        if not self._req.poll(self._timeout_ms):
            raise RecoveryError("no answer from the replay socket")
        return self._req.recv_multipart()[1:]

    # The request a snapshot is asked with (a subclass that applies compact parts asks for them).
    snapshot_request = SNAPSHOT

    def snapshot(self) -> None:
        """Replace the block set with the publisher's and resume from its sequence number."""
        if self._req is None:
            raise RecoveryError("no replay endpoint: cannot take a snapshot")
        request = self.snapshot_request
        self._ask(request)
        head = self._recv()
        if head[:2] == [b"", END_SEQ]:  # vLLM's replay: an unknown request, nothing to send
            self.snapshots_supported = False
            raise NoSnapshots("the publisher does not serve snapshots")
        if len(head) != 3 or head[0] != request:
            raise RecoveryError(f"bad snapshot header: {head!r}")
        self._snapshot_begin()
        try:
            while True:
                _, seq, payload = self._recv()
                if _int(seq) == -1:
                    break
                self._snapshot_part(payload)
        except BaseException:
            self._snapshot_abort()
            raise
        self._snapshot_commit()
        self.epoch, self.next_seq = _int(head[1]), _int(head[2])
        self.snapshots += 1

    # Where batches go: the block set here; a subclass may keep them elsewhere (the router
    # index of pagedkv.router.follow keeps them in Rust, undecoded in Python).

    def _snapshot_begin(self) -> None:
        self._fresh = BlockSet()

    def _snapshot_part(self, payload: bytes) -> None:
        self._fresh.apply(self._decode(payload).events)

    def _snapshot_commit(self) -> None:
        self.blocks = self._fresh

    def _snapshot_abort(self) -> None:
        self._fresh = BlockSet()

    def _clear(self) -> None:
        """The publisher's engine restarted with an empty cache."""
        self.blocks = BlockSet()

    def _replay(self, start: int) -> bool:
        """Apply the buffered batches from `start`; False if the buffer no longer has it."""
        self.replays += 1
        self._ask(start.to_bytes(8, "big", signed=True))
        ok = True
        while True:
            _, seq_b, payload = self._recv()
            seq = _int(seq_b)
            if seq == -1:
                return ok and self.next_seq is not None and self.next_seq > start
            if not ok or self.next_seq is None or seq < self.next_seq:
                continue
            if seq > self.next_seq:
                ok = False  # the buffer begins after what we need
                continue
            self._apply(seq, payload)

    def _epoch_changed(self) -> bool:
        if self._req is None:
            return False
        self._checked = time.monotonic()
        if not self.snapshots_supported:
            return False  # vLLM's publisher: no epochs either
        self._ask(EPOCH)
        head = self._recv()
        return _int(head[1]) != self.epoch

    # ---- the stream --------------------------------------------------------------------

    def _apply(self, seq: int, payload: bytes) -> None:
        events = self._decode(payload).events
        self.blocks.apply(events)
        self.next_seq = seq + 1
        if self._on_batch is not None:
            self._on_batch(seq, events)

    def handle(self, seq: int, payload: bytes) -> None:
        """One message from the PUB socket."""
        last, self._last_seq = self._last_seq, seq
        if self.next_seq is None:
            if self._req is None or not self.snapshots_supported:
                self._apply(seq, payload)  # no snapshot to start from: follow from here
                return
            try:
                self.snapshot()
            except NoSnapshots:
                self._apply(seq, payload)
                return
        assert self.next_seq is not None
        if seq == self.next_seq:
            self._apply(seq, payload)
        elif seq > self.next_seq:
            self.gaps += 1
            if self._req is None:
                self.lost += 1
                self._apply(seq, payload)
            elif self._epoch_changed() or not self._replay(self.next_seq):
                # A new publisher, or the batches are gone from its buffer.
                if self.snapshots_supported:
                    self.snapshot()
                else:
                    self.lost += 1  # vLLM's publisher: nothing more to ask; go on
                    self.next_seq = seq
            if seq == self.next_seq:
                self._apply(seq, payload)
        elif self._epoch_changed():  # behind us: a new publisher, or one already applied
            self.snapshot()
        elif (self._req is None or not self.snapshots_supported) and (
            last is not None and seq <= last
        ):
            # No epoch to ask (vLLM's publisher, or no replay socket). A PUB socket never
            # repeats nor reorders what it sends (a number behind ours is otherwise a batch
            # a replay already applied), so a number at or below the last one received is a
            # new publisher: a restarted engine, whose cache starts empty. Follow it from
            # its first batch (replayed from its buffer when this is not that batch).
            self.restarts += 1
            self._clear()
            self.next_seq, self._last_seq = 0, None
            self.handle(seq, payload)

    def poll(self, timeout: float = 0.1) -> int:
        """Handle the messages that arrive within `timeout` seconds; returns how many."""
        n = 0
        wait = int(timeout * 1000)
        try:
            while self._sub.poll(wait):
                _, seq, payload = self._sub.recv_multipart()
                self.handle(_int(seq), payload)
                n += 1
                wait = 0
            due = time.monotonic() - self._checked >= self._epoch_check
            if due and self.next_seq is not None and self._epoch_changed():
                self.snapshot()
        except RecoveryError:
            # The publisher is away (restarting?): start over with the next message.
            self.failures += 1
            self.next_seq = None
            self._checked = time.monotonic()
            self._open_req()
        return n


__all__ = ["NoSnapshots", "RecoveryError", "Subscriber"]
