"""The reference subscriber follows a manager under a threaded workload and ends with the
manager's cached set: from the start, after its own restart mid-run, after lost messages
(replayed, or past the replay buffer: a snapshot), and across a publisher restart."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable

import pytest
import zmq

from pagedkv import BlockManager, hash_blocks
from pagedkv.kv_events import Publisher, Subscriber, hash_int

B = 4
LOOP = "tcp://127.0.0.1:0"
PREFIXES = [list(range(1000 * p, 1000 * p + 6 * B)) for p in range(6)]


def _worker(m: BlockManager, tid: int, rounds: int, seen: list[list[int]]) -> None:
    """Random prompts over shared prefixes: hits, appends, swaps, evictions, frees."""
    rng = random.Random(tid)
    live: dict[int, list[int]] = {}
    for r in range(rounds):
        sid = tid * 1_000_000 + r
        prompt = rng.choice(PREFIXES)[: rng.randrange(B, 6 * B)] + [
            rng.randrange(10**6) for _ in range(rng.randrange(0, 3 * B))
        ]
        if m.allocate(sid, prompt) is not None:
            live[sid] = prompt
        for s in list(live):
            op = rng.random()
            if op < 0.3:
                extra = [rng.randrange(10**6) for _ in range(rng.randrange(1, B + 1))]
                if m.append(s, extra) is not None:
                    live[s] = live[s] + extra
            elif op < 0.35 and m.swap_out(s) is not None:
                if m.swap_in(s) is None:
                    seen.append(live.pop(s))
                    m.free(s)
            elif op < 0.38:
                table = m.block_table(s)
                if table:
                    m.evict_blocks(table[:1])
            elif op < 0.6:
                seen.append(live.pop(s))
                m.free(s)
        if tid == 0 and r % 97 == 96:
            m.reset_prefix_cache()
        time.sleep(0.001)  # steps apart, so the publisher sends many batches
    for s, toks in live.items():
        seen.append(toks)
        m.free(s)


def run_workload(m: BlockManager, threads: int = 3, rounds: int = 150) -> list[list[int]]:
    seen: list[list[int]] = []
    ts = [threading.Thread(target=_worker, args=(m, t, rounds, seen)) for t in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return seen


def _follow(sub: Subscriber, pub: Publisher, timeout: float = 20.0) -> None:
    pub.flush()
    deadline = time.monotonic() + timeout
    while sub.next_seq != pub.next_seq or sub.epoch != pub.epoch:
        assert time.monotonic() < deadline, (sub.next_seq, pub.next_seq)
        sub.poll(0.05)


def audit(sub: Subscriber, pub: Publisher, m: BlockManager, prompts: list[list[int]]) -> None:
    """The subscriber's set is the publisher's and matches the idle manager's cache."""
    assert sub.blocks.blocks == pub.state.blocks
    keys = sub.blocks.key_set()
    assert {k[0] for k in keys} <= {"GPU"}  # every sequence was freed: no CPU copies left
    assert len(keys) == m.num_cached_blocks > 0
    known = {hash_int(d) for p in prompts for d in hash_blocks(p, B)}
    hashes = {h for _, _, h in keys}
    assert hashes <= known
    for p in prompts[:50]:  # a cache hit's blocks are in the set
        hit = m.lookup(p)
        assert {hash_int(d) for d in hash_blocks(p, B)[: hit // B]} <= hashes


class Loop:
    """A subscriber polled on its own thread until stopped."""

    def __init__(self, sub: Subscriber) -> None:
        self.sub, self.stop = sub, threading.Event()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)  # a failed test ends
        self.thread.start()

    def _run(self) -> None:
        try:
            while not self.stop.is_set():
                self.sub.poll(0.02)
        except BaseException as e:
            self.error = e

    def join(self) -> Subscriber:
        self.stop.set()
        self.thread.join()
        if self.error is not None:
            raise self.error
        return self.sub


def _setup(
    buffer_steps: int = 10_000, send_filter: Callable[[int], bool] | None = None
) -> tuple[BlockManager, Publisher]:
    m = BlockManager(96, B, num_cpu_blocks=32, enable_kv_events=True)
    pub = Publisher(
        m, endpoint=LOOP, replay_endpoint=LOOP, buffer_steps=buffer_steps, interval=0.0005,
        heartbeat=0.2, send_filter=send_filter,
    )  # fmt: skip
    return m, pub


def _rebind(m: BlockManager, endpoints: tuple[str, str | None]) -> Publisher:
    """A new publisher on the old one's ports (free once ZMQ's I/O thread has let go); it
    starts from the manager's own snapshot."""
    deadline = time.monotonic() + 10
    while True:
        try:
            return Publisher(m, endpoint=endpoints[0], replay_endpoint=endpoints[1], heartbeat=0.2)
        except zmq.ZMQError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def _subscriber(pub: Publisher) -> Subscriber:
    assert pub.replay_endpoint is not None
    sub = Subscriber(pub.endpoint, pub.replay_endpoint, topic="kv@pagedkv@model", epoch_check=0.2)
    time.sleep(0.2)
    return sub


def test_follows_a_threaded_workload() -> None:
    m, pub = _setup()
    loop = Loop(_subscriber(pub))
    prompts = run_workload(m)
    sub = loop.join()
    _follow(sub, pub)
    audit(sub, pub, m, prompts)
    assert sub.snapshots == 1 and pub.batches > 10
    sub.close()
    pub.close()


def test_subscriber_restarted_mid_run() -> None:
    m, pub = _setup()
    first = Loop(_subscriber(pub))
    prompts = run_workload(m, rounds=60)
    first.join().close()  # killed: its state is gone
    prompts += run_workload(m, rounds=60)
    sub = _subscriber(pub)
    prompts += run_workload(m, rounds=60)
    _follow(sub, pub)
    audit(sub, pub, m, prompts)
    assert sub.snapshots == 1
    sub.close()
    pub.close()


@pytest.mark.parametrize("buffer_steps", [10_000, 2])
def test_lost_messages_replayed_or_snapshotted(buffer_steps: int) -> None:
    lossy = random.Random(7)
    m, pub = _setup(buffer_steps, send_filter=lambda seq: lossy.random() > 0.2)
    loop = Loop(_subscriber(pub))
    prompts = run_workload(m)
    sub = loop.join()
    _follow(sub, pub)
    audit(sub, pub, m, prompts)
    assert pub.dropped > 0 and sub.gaps > 0 and sub.replays > 0
    if buffer_steps == 2:
        assert sub.snapshots > 1  # some gaps were past the buffer
    else:
        assert sub.snapshots == 1  # the first sync only: replay covered every gap


def test_publisher_restart_new_epoch_starts_from_the_managers_snapshot() -> None:
    m, pub = _setup()
    loop = Loop(_subscriber(pub))
    prompts = run_workload(m, rounds=60)
    pub.close()
    old_epoch, endpoints = pub.epoch, (pub.endpoint, pub.replay_endpoint)
    prompts += run_workload(m, rounds=30)  # changes while no publisher runs
    pub = _rebind(m, endpoints)
    assert pub.epoch != old_epoch
    prompts += run_workload(m, rounds=60)
    sub = loop.join()
    _follow(sub, pub)
    audit(sub, pub, m, prompts)
    assert sub.epoch == pub.epoch and sub.snapshots >= 2
    sub.close()
    pub.close()


def test_command_line_prints_the_stream(capsys: pytest.CaptureFixture[str]) -> None:
    from pagedkv.__main__ import main

    m, pub = _setup()
    assert pub.replay_endpoint is not None
    m.allocate(1, list(range(2 * B)))
    pub.flush()

    def later() -> None:
        time.sleep(0.5)
        m.allocate(2, list(range(2 * B)) + list(range(50, 50 + B)))
        m.free(1)

    t = threading.Thread(target=later)
    t.start()
    args = ["events", "--connect", pub.endpoint, "--replay", pub.replay_endpoint, "--count", "2"]
    assert main([*args, "--duration", "20"]) == 0
    t.join()
    pub.close()
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("snapshot: 2 blocks, resuming at "), out  # heartbeats may precede
    stored = hash_int(hash_blocks(list(range(2 * B)) + list(range(50, 50 + B)), B)[2])
    assert any(
        "BlockStored GPU group=0 parent=" in line and f"{stored:#018x}" in line for line in out
    )
