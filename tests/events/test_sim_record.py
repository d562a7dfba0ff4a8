"""`simulate --record`: sizing a live engine from its KV events, followed on loopback from
pagedkv's own publisher (with its snapshot of the blocks cached before) and from vLLM
0.33's `ZmqEventPublisher`. The counts and the curve are worked out by hand below."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from vllm.distributed import kv_events as v

from pagedkv import BlockManager
from pagedkv.__main__ import main
from pagedkv.kv_events import Publisher
from pagedkv.sim.live import LiveCurve, LiveTrace, record
from pagedkv.sim.live_cli import live_doc
from sigint import sigint_default_in_children

B = 4
LOOP = "tcp://127.0.0.1:0"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _recording(endpoint: str, replay: str | None, topic: str, stored: int) -> Any:
    """Start `record` in a thread until `stored` blocks were stored; (trace, thread, out)."""
    trace = LiveTrace()
    out: dict[str, Any] = {}

    def run() -> None:
        out["result"] = record(
            endpoint,
            20,
            replay_endpoint=replay,
            topic=topic,
            until=lambda t: t.stored_blocks >= stored,
            trace=trace,
        )

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return trace, thread, out


def _wait(cond: Any, what: str) -> None:
    deadline = time.monotonic() + 20
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def test_pagedkvs_publisher_with_its_snapshot() -> None:
    m = BlockManager(64, B, enable_kv_events=True)
    p0 = np.arange(9, dtype=np.uint32)  # 2 full blocks a1 a2, cached before the recording
    m.allocate(0, p0)
    m.free(0)
    with Publisher(m, endpoint=LOOP, replay_endpoint=LOOP, heartbeat=0.1, topic="") as pub:
        trace, thread, out = _recording(pub.endpoint, pub.replay_endpoint, "", 5)
        _wait(lambda: trace.stream, "the snapshot")  # a1 a2 seeded, resident
        x = np.arange(100, 108, dtype=np.uint32)
        # seq 1 hits a1 a2 and stores x1 x2, then decodes into x3 (its own chain goes on)
        m.allocate(1, np.concatenate([p0[:8], x, [7]]))
        m.append(1, np.array([8, 9, 10], dtype=np.uint32))
        pub.flush()
        m.free(1)
        # seq 2 hits a1 a2 x1 x2 (x2 is no open end: x3 follows it) and stores y1 y2
        y = np.arange(200, 208, dtype=np.uint32)
        m.allocate(2, np.concatenate([p0[:8], x, y, [9]]))
        pub.flush()
        thread.join(30)
    trace, counts = out["result"]
    assert counts["snapshots"] == 1
    assert (trace.stored_blocks, trace.hit_blocks, trace.peak_resident) == (5, 6, 7)
    curve = LiveCurve.of(trace)
    # distances with the prefix rule: seq 1's hits (2, 2), seq 2's (5, 5, 5, 5)
    assert [curve.hit_rate(c) for c in (1, 2, 4, 5)] == [0, 2 / 11, 2 / 11, 6 / 11]
    assert curve.unbounded == 6 / 11
    doc = live_doc(trace, curve, counts)
    assert doc["engine_hit_rate"] == 6 / 11 and doc["blocks_for_target"] == 5


def _stored(hashes: list[int], parent: int | None) -> v.BlockStored:
    return v.BlockStored(
        block_hashes=hashes, parent_block_hash=parent, token_ids=[0] * (B * len(hashes)),
        block_size=B, lora_id=None, medium="GPU", lora_name=None, group_idx=0,
    )  # fmt: skip


def test_vllms_publisher_restores_after_eviction() -> None:
    pub_port, replay_port = _free_port(), _free_port()
    pub = v.ZmqEventPublisher(
        0, endpoint=f"tcp://*:{pub_port}", replay_endpoint=f"tcp://*:{replay_port}", topic="kv"
    )
    try:
        trace, thread, out = _recording(
            f"tcp://127.0.0.1:{pub_port}", f"tcp://127.0.0.1:{replay_port}", "kv", 8
        )
        time.sleep(0.5)  # the subscription reaches the PUB socket
        for events in (
            [_stored([1, 2, 3], None)],
            [_stored([4], 3)],  # the same sequence goes on
            [v.BlockRemoved([1, 2, 3, 4], "GPU", 0)],
            [_stored([1, 2], None)],  # stored again: a larger cache would have kept them
            [_stored([5], 2)],
            [_stored([6], 1)],  # 1 is no open end: a new request hit block 1
        ):
            pub.publish(v.KVEventBatch(ts=time.time(), events=events))
        thread.join(30)
    finally:
        pub.shutdown()
    trace, counts = out["result"]
    assert counts["snapshots"] == 0
    assert (trace.stored_blocks, trace.restored_blocks, trace.hit_blocks) == (8, 2, 1)
    assert (trace.removed_blocks, trace.peak_resident) == (4, 4)
    curve = LiveCurve.of(trace)
    # re-stored 1 and 2 at distances 4 and 3 (4 with the prefix rule); the hit on 1 at 3
    assert [curve.hit_rate(c) for c in (2, 3, 4, 100)] == [0, 1 / 9, 3 / 9, 3 / 9]


def test_the_command_sizes_a_live_engine(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    m = BlockManager(64, B, enable_kv_events=True)
    stop = threading.Event()

    def engine() -> None:  # one shared prefix, a new question every 50 ms
        i = 0
        while not stop.is_set():
            m.allocate(i, np.concatenate([np.arange(8), np.arange(1000 + 8 * i, 1008 + 8 * i)]))
            m.free(i)
            i += 1
            time.sleep(0.05)

    with Publisher(m, endpoint=LOOP, heartbeat=0.1, topic="") as pub:
        t = threading.Thread(target=engine, daemon=True)
        t.start()
        path = tmp_path / "live.json"
        try:
            argv = ["simulate", "--record", pub.endpoint, "--record-seconds", "1.5"]
            assert main([*argv, "--json", str(path)]) == 0
        finally:
            stop.set()
            t.join(5)
    text = capsys.readouterr().out
    assert "record      " in text and "answer      " in text
    doc = json.loads(path.read_text())
    assert doc["stored_blocks"] > 4 and doc["hit_blocks"] > 0
    assert doc["block_size"] == B and doc["blocks_for_target"] is not None
    assert 0 < doc["unbounded_hit_rate"] < 1


def test_bad_record_seconds_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "--record", "tcp://127.0.0.1:1", "--record-seconds", "0"]) == 2
    assert "--record-seconds must be > 0" in capsys.readouterr().err


def test_options_it_would_ignore_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "--record", "tcp://127.0.0.1:1", "--workload", "chat"]) == 2
    assert "--record sizes from a live engine's events" in capsys.readouterr().err


def test_ctrl_c_ends_the_recording_and_sizes_what_it_saw(tmp_path: Path) -> None:
    """A recording meant to last a minute, stopped with Ctrl-C: the command says so and
    answers (here: nothing was published, so nothing to size), with status 0."""
    endpoint = f"tcp://127.0.0.1:{_free_port()}"  # nobody publishes there
    path = tmp_path / "live.json"
    argv = ["simulate", "--record", endpoint, "--record-seconds", "60", "--json", str(path)]
    with sigint_default_in_children():  # CI may have started pytest ignoring SIGINT
        proc = subprocess.Popen(
            [sys.executable, "-m", "pagedkv", *argv],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=dict(os.environ),
        )
    try:
        time.sleep(3.0)  # imports done, following
        assert proc.poll() is None, "the recording ended before it could be interrupted"
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, out + err
    assert "(stopped by Ctrl-C)" in out and "nothing to size" in out
    doc = json.loads(path.read_text())
    assert doc["stream"]["interrupted"] == 1 and doc["stream"]["elapsed_ms"] < 30_000
