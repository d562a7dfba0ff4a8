"""`RouterIndex.follow` on vLLM 0.33's own `ZmqEventPublisher` (CPU): random block events
(stored chains, removals, clears), batches lost on the way (replayed from vLLM's buffer), a
restarted router (vLLM serves no snapshots: it knows the blocks stored since, as the
reference subscriber does) and a restarted engine (told by its sequence numbers)."""

from __future__ import annotations

import random
import socket
import time
from collections.abc import Callable
from typing import Any

import zmq
from vllm.distributed import kv_events as v

from pagedkv.kv_events import Subscriber
from pagedkv.router import RouterIndex
from pagedkv.router.follow import Follower
from router_streams import index_keys


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class _Lossy:
    """vLLM's PUB socket, dropping the batches `drop(seq)` picks (a lossy network)."""

    def __init__(self, sock: Any, drop: Callable[[int], bool]) -> None:
        self._sock, self._drop, self.dropped = sock, drop, 0

    def send_multipart(self, frames: tuple[bytes, bytes, bytes]) -> Any:
        if self._drop(int.from_bytes(frames[1], "big")):
            self.dropped += 1
            return None
        return self._sock.send_multipart(frames)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sock, name)


class _Engine:
    """An engine's cached blocks and the random events that change them."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.held: dict[int, int | None] = {}  # block -> parent

    def events(self) -> list[Any]:
        rng, out = self.rng, []
        for _ in range(rng.randrange(1, 4)):
            op = rng.random()
            if op < 0.6 or not self.held:
                parent = rng.choice([None, *self.held]) if self.held else None
                chain = [rng.getrandbits(64) for _ in range(rng.randrange(1, 4))]
                out.append(v.BlockStored(chain, parent, [1] * 4 * len(chain), 4, None, "GPU", None))
                for h in chain:
                    self.held[h] = parent
                    parent = h
            elif op < 0.98:
                gone = rng.sample(sorted(self.held), min(len(self.held), rng.randrange(1, 3)))
                out.append(v.BlockRemoved(gone, "GPU"))
                for h in gone:
                    del self.held[h]
            else:
                out.append(v.AllBlocksCleared())
                self.held.clear()
        return out

    def keys(self) -> set[tuple[str, int, int]]:
        return {("GPU", 0, h) for h in self.held}


class _Stream:
    """A vLLM publisher on fixed ports, restartable."""

    def __init__(self, drop: Callable[[int], bool] = lambda seq: False) -> None:
        self.ports = (_free_port(), _free_port())
        self.drop = drop
        self.start()

    def start(self) -> None:
        deadline = time.monotonic() + 10
        while True:  # the ports are free once ZMQ's I/O thread has let go of them
            try:
                self.pub = v.ZmqEventPublisher(
                    0, endpoint=f"tcp://*:{self.ports[0]}",
                    replay_endpoint=f"tcp://*:{self.ports[1]}", topic="kv",
                )  # fmt: skip
                break
            except zmq.ZMQError:
                assert time.monotonic() < deadline
                time.sleep(0.05)
        self.lossy = _Lossy(self.pub._pub, self.drop)
        self.pub._pub = self.lossy
        self.sent = 0

    def publish(self, events: list[Any]) -> None:
        self.pub.publish(v.KVEventBatch(ts=time.time(), events=events))
        self.sent += 1

    @property
    def endpoints(self) -> tuple[str, str]:
        return (f"tcp://127.0.0.1:{self.ports[0]}", f"tcp://127.0.0.1:{self.ports[1]}")


def _run(stream: _Stream, engine: _Engine, batches: int, poll: Callable[[], None]) -> None:
    for _ in range(batches):
        stream.publish(engine.events())
        poll()
        time.sleep(0.001)
    for _ in range(3):  # a few that are not dropped: every gap shows
        stream.publish([])


def _until(ready: Callable[[], bool], poll: Callable[[], None] = lambda: None) -> None:
    deadline = time.monotonic() + 20
    while not ready():
        assert time.monotonic() < deadline
        poll()
        time.sleep(0.02)


def test_follows_vllms_publisher_through_losses_and_an_engine_restart() -> None:
    lossy = random.Random(3)
    stream = _Stream(drop=lambda seq: lossy.random() < 0.15)
    engine = _Engine(1)
    ix = RouterIndex()
    f: Follower = ix.follow("w0", *stream.endpoints, epoch_check=0.2)
    ref = Subscriber(*stream.endpoints, topic="kv")
    time.sleep(0.3)
    _run(stream, engine, 300, lambda: ref.poll(0))
    _until(lambda: f.next_seq == stream.sent and ref.next_seq == stream.sent, lambda: ref.poll(0))
    assert stream.lossy.dropped > 0 and f.replays > 0 and f.lost == 0
    assert index_keys(ix, "w0") == engine.keys() == ref.blocks.key_set()
    ix.check_invariants()
    # The engine restarts: a new publisher on its ports, numbering from 0, cache empty.
    stream.pub.shutdown()
    time.sleep(0.5)  # rebound at once, in one process, the old port confuses ZMQ
    stream.start()
    engine = _Engine(2)
    time.sleep(0.3)
    _run(stream, engine, 100, lambda: ref.poll(0))
    _until(lambda: f.next_seq == stream.sent and ref.next_seq == stream.sent, lambda: ref.poll(0))
    assert index_keys(ix, "w0") == engine.keys() == ref.blocks.key_set()
    assert ix.stats().memberships == len(engine.held)
    assert f.restarts == 1 and ref.restarts == 1
    ix.check_invariants()
    ix.close()
    ref.close()
    stream.pub.shutdown()


def test_a_restarted_router_knows_what_was_stored_since() -> None:
    stream = _Stream()
    engine = _Engine(5)
    first = RouterIndex()
    first.follow("w0", *stream.endpoints)
    time.sleep(0.3)
    _run(stream, engine, 100, lambda: None)
    first.close()  # the router goes; the engine runs on
    ix = RouterIndex()
    f = ix.follow("w0", *stream.endpoints)
    ref = Subscriber(*stream.endpoints, topic="kv")  # the reference, restarted alike
    time.sleep(0.3)
    _run(stream, engine, 100, lambda: ref.poll(0))
    _until(lambda: f.next_seq == stream.sent and ref.next_seq == stream.sent, lambda: ref.poll(0))
    got = index_keys(ix, "w0")
    assert got == ref.blocks.key_set() and got <= engine.keys()
    # vLLM serves no snapshot: what was stored before the restart and never touched again is
    # unknown, and removals of such blocks are counted, not applied.
    assert ix.stats().unknown_removals > 0
    ix.close()
    ref.close()
    stream.pub.shutdown()
