"""Router indexes side by side: pagedkv's (`pagedkv.router.RouterIndex`) and Dynamo's
(`dynamo._core.RadixTree`, from `ai-dynamo-runtime`), on the same event stream: the shared
Mooncake trace replayed as N engines' KV events (tests/support/router_stream.py), 1 M
memberships at 8 and 64 engines (10 M with `-m manual`).

Each index applies its own wire form of the same events: pagedkv a vLLM `KVEventBatch`
payload per request (msgpack, 16 token ids a block, decoded in Rust), Dynamo one serialized
event per store or removal (its `apply_event`). Figures (printed at the end of the session,
docs/router.md, benches/results/issue34-router.md):

- apply: block operations (blocks stored + removed) per second over the whole stream, from
  a fresh index (Dynamo's queue drained: a lookup after the last event);
- lookup: one request's hashes (a list of ints; for pagedkv also a uint64 array and its
  bytes) to each engine's matched blocks as a dict, timed one by one from Python (p50, p99);
- memory: resident memory the index adds, per membership, each measured alone in a process
  of its own (benches/router_memory.py);
- decode: pagedkv's payloads decoded in Python (msgspec, pagedkv.kv_events.wire) against
  decoded and applied in Rust;
- snapshot: 1 M blocks as pagedkv's publisher sends them: in the usual form (BlockStored
  batches of 256, encoded in Python) and compact (`HeldBlocks.parts()`, Rust), sent over
  loopback ZMQ and applied (staged, then committed).
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from mooncake_trace import trace_path
from pagedkv.router import RouterIndex
from router_stream import Stream, dynamo_stream, generate, mix64, read_trace, vllm_payload

ROOT = Path(__file__).resolve().parents[1]
IMPLS = ("pagedkv", "dynamo")
CI = 1_000_000
MANUAL = 10_000_000
# (engines, memberships): the CI-sized points, and the 10 M one by hand.
POINTS = [
    pytest.param((8, CI), id="8e-1M"),
    pytest.param((64, CI), id="64e-1M"),
    pytest.param((64, MANUAL), id="64e-10M", marks=[pytest.mark.slow, pytest.mark.manual]),
]

# Figures for the summary: point -> impl -> name -> value.
FIGURES: dict[str, dict[str, dict[str, float]]] = {}
_STREAMS: dict[tuple[int, int], Stream] = {}
_BUILT: dict[tuple[str, int, int], Any] = {}


def _trace(tmp: Path) -> Path:
    return trace_path(tmp)


def _stream(point: tuple[int, int], tmp: Path) -> Stream:
    if point not in _STREAMS:
        _STREAMS.clear()  # one point's stream in memory at a time
        _BUILT.clear()
        engines, members = point
        _STREAMS[point] = generate(
            read_trace(_trace(tmp)), engines=engines, memberships=members, lookups=5000
        )
    return _STREAMS[point]


def _label(point: tuple[int, int]) -> str:
    return f"{point[0]} engines, {point[1] / 1e6:g} M memberships"


def _fig(point: tuple[int, int], impl: str, name: str, value: float) -> None:
    FIGURES.setdefault(_label(point), {}).setdefault(impl, {})[name] = value


class _Impl:
    """One index kind: how to build it, feed it the stream, and look up."""

    def __init__(self, name: str, stream: Stream) -> None:
        self.name = name
        if name == "dynamo":
            self.dynamo = pytest.importorskip("dynamo._core", reason="ai-dynamo-runtime")
            self.events = list(dynamo_stream(stream))
        else:
            self.payloads = [(b.engine, vllm_payload(b)) for b in stream.batches]

    def fresh(self) -> Any:
        return self.dynamo.RadixTree() if self.name == "dynamo" else RouterIndex()

    def apply_all(self, ix: Any) -> None:
        if self.name == "dynamo":
            for e, ev in self.events:
                ix.apply_event(e, ev)
            ix.find_matches([1])  # answered after every event queued before it
        else:
            for e, pl in self.payloads:
                ix.apply(e, pl)

    def lookup(self, ix: Any) -> Callable[[list[int]], dict[Any, int]]:
        if self.name == "dynamo":
            return lambda q: ix.find_matches(q).scores
        return ix.scores  # type: ignore[no-any-return]


@pytest.fixture(params=IMPLS)
def impl(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def _built(name: str, point: tuple[int, int], tmp: Path) -> tuple[_Impl, Any]:
    key = (name, *point)
    if key not in _BUILT:
        im = _Impl(name, _stream(point, tmp))
        ix = im.fresh()
        im.apply_all(ix)
        _BUILT[key] = (im, ix)
    return _BUILT[key]  # type: ignore[no-any-return]


@pytest.mark.parametrize("point", POINTS)
def test_apply(benchmark: Any, impl: str, point: tuple[int, int], tmp_path: Path) -> None:
    stream = _stream(point, tmp_path)
    im = _Impl(impl, stream)
    benchmark.group = f"router apply: {_label(point)}, {stream.block_ops} block ops"
    holder: dict[str, Any] = {}

    def setup() -> tuple[tuple[Any], dict[str, Any]]:
        holder.pop("ix", None)
        gc.collect()
        holder["ix"] = im.fresh()
        return (holder["ix"],), {}

    benchmark.pedantic(im.apply_all, setup=setup, rounds=3, iterations=1)
    stats = getattr(getattr(benchmark, "stats", None), "stats", None)
    if stats is not None:
        _fig(point, impl, "ops/s", stream.block_ops / stats.median)
    if impl == "pagedkv":
        s = holder["ix"].stats()
        assert s.memberships == stream.memberships
        assert (s.orphans, s.unknown_removals, s.rejected_payloads) == (0, 0, 0)


@pytest.mark.parametrize("point", POINTS)
def test_lookup(benchmark: Any, impl: str, point: tuple[int, int], tmp_path: Path) -> None:
    im, ix = _built(impl, point, tmp_path)
    queries = _stream(point, tmp_path).lookups
    find = im.lookup(ix)
    benchmark.group = f"router lookup: {_label(point)}, {len(queries)} requests"

    def run() -> None:
        for q in queries:
            find(q)

    benchmark.pedantic(run, rounds=3, iterations=1)
    # Each lookup on its own (the timer's own cost, about 0.1 us, included).
    lat = []
    clock = time.perf_counter_ns
    for _ in range(3):
        for q in queries:
            t0 = clock()
            find(q)
            lat.append(clock() - t0)
    lat.sort()
    _fig(point, impl, "lookup p50 us", lat[len(lat) // 2] / 1000)
    _fig(point, impl, "lookup p99 us", lat[len(lat) * 99 // 100] / 1000)
    if impl == "pagedkv":  # the hashes as a uint64 array, and as its bytes: read in one copy
        import numpy as np

        arrays = [np.array(q, dtype=np.uint64) for q in queries]
        for form, qs in (("ndarray", arrays), ("bytes", [a.tobytes() for a in arrays])):
            lat = []
            for _ in range(3):
                for a in qs:
                    t0 = clock()
                    ix.scores(a)
                    lat.append(clock() - t0)
            lat.sort()
            _fig(point, impl, f"lookup p50 us ({form})", lat[len(lat) // 2] / 1000)
            _fig(point, impl, f"lookup p99 us ({form})", lat[len(lat) * 99 // 100] / 1000)
    if impl == "dynamo":  # the same answers, every lookup, in every form
        import numpy as np

        _, ours = _built("pagedkv", point, tmp_path)
        for q in queries:
            got = {w: n for (w, _r), n in find(q).items()}
            a = np.array(q, dtype=np.uint64)
            assert got == ours.scores(q) == ours.scores(a) == ours.scores(a.tobytes())


@pytest.mark.parametrize("beside", ["lookups", "busy"])
@pytest.mark.parametrize("point", POINTS[1:])
def test_lookup_threads(
    benchmark: Any, beside: str, point: tuple[int, int], tmp_path: Path
) -> None:
    """pagedkv's lookups (bytes) from a Python thread while another thread does the same
    (`lookups`) or runs Python code without pause (`busy`): what a call that hands the GIL
    over costs a router with other work (rust/python/src/router.rs, `DETACH_AT`)."""
    import threading

    import numpy as np

    _, ix = _built("pagedkv", point, tmp_path)
    qs = [np.array(q, dtype=np.uint64).tobytes() for q in _stream(point, tmp_path).lookups]
    benchmark.group = f"router lookup threads: {_label(point)}"
    clock = time.perf_counter_ns
    lat: list[int] = []

    def lookups(out: list[int]) -> None:
        for q in qs:
            t0 = clock()
            ix.scores(q)
            out.append(clock() - t0)

    def run() -> None:
        lat.clear()
        stop = threading.Event()
        other: list[int] = []

        def spin() -> None:
            x = 0
            while not stop.is_set():
                x += 1

        t = threading.Thread(
            target=lookups if beside == "lookups" else spin,
            args=(other,) if beside == "lookups" else (),
        )
        t.start()
        lookups(lat)
        stop.set()
        t.join()
        lat.extend(other)

    benchmark.pedantic(run, rounds=3, iterations=1)
    lat.sort()
    _fig(
        point,
        "pagedkv",
        f"lookup p99 us (bytes, beside {beside})",
        lat[len(lat) * 99 // 100] / 1000,
    )
    assert len(lat) >= len(qs)


@pytest.mark.parametrize("point", POINTS)
def test_memory(impl: str, point: tuple[int, int], tmp_path: Path) -> None:
    if impl == "dynamo":
        pytest.importorskip("dynamo._core", reason="ai-dynamo-runtime")
    engines, members = point
    cmd = [sys.executable, str(ROOT / "benches" / "router_memory.py"), "--impl", impl]
    cmd += ["--engines", str(engines), "--memberships", str(members)]
    cmd += ["--trace", str(_trace(tmp_path))]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=os.environ).stdout
    r = json.loads(out.strip().splitlines()[-1])
    _fig(point, impl, "RSS bytes/membership", r["rss"] / r["memberships"])
    if r["own"] is not None:
        _fig(point, impl, "own bytes/membership", r["own"] / r["memberships"])
        # The index's accounting is within a factor of the resident memory it added.
        assert 0.5 < r["own"] / r["rss"] < 2.0, r


@pytest.mark.parametrize("how", ["python msgspec decode", "rust decode+apply"])
def test_decode(benchmark: Any, how: str, tmp_path: Path) -> None:
    """Where a payload is best decoded: msgspec into Python structs (what decoding in Python
    would cost before any applying) against the whole apply in Rust."""
    from pagedkv.kv_events import wire

    stream = _stream((64, CI), tmp_path)
    payloads = [(b.engine, vllm_payload(b)) for b in stream.batches[:5000]]
    benchmark.group = f"router: decoding {len(payloads)} payloads"
    if how.startswith("python"):
        decode = wire.decoder().decode
        benchmark.pedantic(lambda: [decode(p) for _, p in payloads], rounds=3, iterations=1)
    else:

        def apply(ix: RouterIndex) -> None:
            for e, p in payloads:
                ix.apply(e, p)

        benchmark.pedantic(apply, setup=lambda: ((RouterIndex(),), {}), rounds=3, iterations=1)


def _snapshot_payloads(n: int, salt: int = 0) -> list[bytes]:
    """`n` cached blocks as pagedkv's publisher sends a snapshot in the usual form: one
    BlockStored per block (its parent, 16 token ids), 256 to a batch, through its encoder
    (integer hashes)."""
    from pagedkv.events import BlockStored
    from pagedkv.kv_events import WireEncoder

    enc = WireEncoder()
    out, batch = [], []
    parent = None
    for i in range(n):
        d = mix64(i + salt).to_bytes(8, "big")  # an 8-byte digest: its integer hash is itself
        batch.append(BlockStored([d], parent, [7] * 16, 16, None))
        parent = None if i % 64 == 63 else d  # chains of 64 blocks
        if len(batch) == 256:
            out.append(enc.batch(batch, ts=0.0))
            batch = []
    if batch:
        out.append(enc.batch(batch, ts=0.0))
    return out


def _held(n: int, salt: int = 0) -> Any:
    """A publisher's `HeldBlocks` of `n` blocks (as its stream would have stored them)."""
    from pagedkv import _core
    from pagedkv.events import BlockStored
    from pagedkv.kv_events import WireEncoder

    enc = WireEncoder()
    held = _core.HeldBlocks()
    for s in range(0, n, 4096):
        ds = [mix64(i + salt).to_bytes(8, "big") for i in range(s, min(n, s + 4096))]
        held.apply(enc.batch([BlockStored(ds, None, [], 16, None, "GPU", 0)], ts=0.0))
    assert len(held) == n
    return held


class _Loopback:
    """A DEALER to ROUTER pair on loopback TCP, as a snapshot travels (publisher's ROUTER to
    the follower's DEALER)."""

    def __init__(self) -> None:
        import zmq

        ctx = zmq.Context.instance()
        self.router, self.dealer = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
        for sock in (self.router, self.dealer):
            sock.setsockopt(zmq.LINGER, 0)
        self.router.setsockopt(zmq.SNDHWM, 0)
        self.router.bind("tcp://127.0.0.1:0")
        self.dealer.connect(self.router.getsockopt_string(zmq.LAST_ENDPOINT))
        self.dealer.send_multipart((b"", b"hello"))
        self.client = self.router.recv_multipart()[0]

    def send_all(self, parts: list[bytes]) -> list[bytes]:
        """Send every part (as the publisher frames them), receive them all on the other side."""
        seq = (0).to_bytes(8, "big")
        for p in parts:
            self.router.send_multipart((self.client, b"", b"topic", seq, p), copy=False)
        return [bytes(self.dealer.recv_multipart(copy=False)[3].buffer) for _ in parts]

    def close(self) -> None:
        self.router.close()
        self.dealer.close()


SNAP = 1_000_000


def test_snapshot_usual_form_encode(benchmark: Any) -> None:
    """The usual form's encoding (Python, msgspec, one event a block), once: the before."""
    t0 = time.perf_counter()
    payloads = _snapshot_payloads(SNAP)
    label = f"snapshot of {SNAP / 1e6:g} M blocks"
    FIGURES.setdefault(label, {}).setdefault("pagedkv", {})["usual form encode s"] = (
        time.perf_counter() - t0
    )
    ix = RouterIndex()
    benchmark.group = f"router snapshot: {SNAP} blocks, usual form"

    def apply(ix: RouterIndex) -> None:
        ix.begin_snapshot("e")
        for p in payloads:
            ix.apply_staged("e", p)
        ix.commit_snapshot("e")

    benchmark.pedantic(apply, setup=lambda: ((RouterIndex(),), {}), rounds=3, iterations=1)
    stats = getattr(getattr(benchmark, "stats", None), "stats", None)
    if stats is not None:
        FIGURES[label]["pagedkv"]["usual form apply s"] = stats.median
    apply(ix)
    assert ix.stats().memberships == SNAP


def test_snapshot_compact_send(benchmark: Any) -> None:
    """Sent: the publisher's `HeldBlocks` written as compact parts (Rust) and carried over
    loopback TCP by ZMQ, from the request to the last part received."""
    held = _held(SNAP)
    link = _Loopback()
    benchmark.group = f"router snapshot: {SNAP} blocks, compact"
    got = benchmark.pedantic(lambda: link.send_all(held.parts()), rounds=5, iterations=1)
    link.close()
    stats = getattr(getattr(benchmark, "stats", None), "stats", None)
    label = f"snapshot of {SNAP / 1e6:g} M blocks"
    if stats is not None:
        FIGURES.setdefault(label, {}).setdefault("pagedkv", {})["compact send ms"] = (
            stats.median * 1000
        )
    ix = RouterIndex()
    ix.begin_snapshot("e")
    for p in got:
        ix.apply_staged("e", p)
    ix.commit_snapshot("e")
    assert ix.stats().memberships == SNAP and sum(map(len, got)) > 8 * SNAP


class _Preloaded:
    """Fresh indexes holding `old` (an engine's blocks, committed as a snapshot), one a
    round: the last round's index is dropped first, once its replaced blocks are, so that
    no round runs beside the last one's drop."""

    def __init__(self, old: list[bytes]) -> None:
        self.old = old
        self.last: RouterIndex | None = None

    def index(self) -> RouterIndex:
        if self.last is not None:
            self.last.drop_replaced()
        ix = self.last = RouterIndex()
        if self.old:
            _apply_snapshot(ix, self.old)
            ix.drop_replaced()
        return ix


@pytest.mark.parametrize("over", ["fresh", "replacing"])
def test_snapshot_compact_apply(benchmark: Any, over: str) -> None:
    """Applied: the parts staged beside the engine's blocks and committed; into a fresh
    index, or replacing 1 M other blocks the engine held. The commit returns once lookups
    count the new blocks and ignore the old, which its own thread then drops: timed apart
    (`drop_replaced` waits for it), and waited for before the next round, so that no round
    runs beside the last one's drop."""
    parts = _held(SNAP).parts()
    old = _held(SNAP, salt=1 << 40).parts() if over == "replacing" else []
    benchmark.group = f"router snapshot: {SNAP} blocks, compact"
    load = _Preloaded(old).index

    benchmark.pedantic(_apply_snapshot, setup=lambda: ((load(), parts), {}), rounds=5, iterations=1)
    stats = getattr(getattr(benchmark, "stats", None), "stats", None)
    label = f"snapshot of {SNAP / 1e6:g} M blocks"
    figs = FIGURES.setdefault(label, {}).setdefault("pagedkv", {})
    if stats is not None:
        figs[f"compact apply ms ({over})"] = stats.median * 1000
    drops = []
    for _ in range(3):
        ix = load()
        _apply_snapshot(ix, parts)
        t0 = time.perf_counter()
        ix.drop_replaced()
        drops.append((time.perf_counter() - t0) * 1000)
        assert ix.stats().memberships == SNAP
        ix.check_invariants()
    if over == "replacing":
        figs["replaced dropped, ms after commit"] = sorted(drops)[1]


@pytest.mark.parametrize("over", ["fresh", "replacing", "resync"])
def test_snapshot_compact_through(benchmark: Any, over: str) -> None:
    """Sent and applied as a follower takes a snapshot: the publisher's thread writes its
    `HeldBlocks` as compact parts and sends them, while the follower's thread applies each
    part as it arrives (`Subscriber.snapshot`: receive, `apply_staged`), then commits. Timed
    from the request to the commit's return. Into a fresh index; replacing 1 M other blocks
    the engine held; or resync: the engine held the same 1 M blocks but 1% (a lost message's
    worth of change), the usual reason a follower asks for a snapshot mid-stream."""
    import threading

    held = _held(SNAP)
    if over == "replacing":
        old = _held(SNAP, salt=1 << 40).parts()
    elif over == "resync":
        old = _held(SNAP - SNAP // 100).parts() + _held(SNAP // 100, salt=1 << 41).parts()
    else:
        old = []
    link = _Loopback()
    benchmark.group = f"router snapshot: {SNAP} blocks, compact"
    load = _Preloaded(old).index

    def publish() -> None:
        seq = (0).to_bytes(8, "big")
        parts = held.parts()
        for p in parts:
            link.router.send_multipart((link.client, b"", b"topic", seq, p), copy=False)
        link.router.send_multipart((link.client, b"", b"", seq, b""))

    def through(ix: RouterIndex) -> None:
        t = threading.Thread(target=publish)
        t.start()
        ix.begin_snapshot("e")
        while True:
            _, topic, _, payload = link.dealer.recv_multipart()  # copied, as the follower's
            if not topic:
                break
            ix.apply_staged("e", payload)
        ix.commit_snapshot("e")
        t.join()

    benchmark.pedantic(through, setup=lambda: ((load(),), {}), rounds=5, iterations=1)
    stats = getattr(getattr(benchmark, "stats", None), "stats", None)
    label = f"snapshot of {SNAP / 1e6:g} M blocks"
    if stats is not None:
        FIGURES.setdefault(label, {}).setdefault("pagedkv", {})[
            f"compact sent and applied ms ({over})"
        ] = stats.median * 1000
    ix = load()
    through(ix)
    ix.drop_replaced()
    assert ix.stats().memberships == SNAP
    ix.check_invariants()
    link.close()


def _apply_snapshot(ix: RouterIndex, parts: list[bytes]) -> None:
    ix.begin_snapshot("e")
    for p in parts:
        ix.apply_staged("e", p)
    ix.commit_snapshot("e")


def summary() -> list[str]:
    """The figures as lines (printed by benches/conftest.py at the end of the session)."""
    lines = []
    for label, by_impl in FIGURES.items():
        lines.append(label)
        names = sorted({n for f in by_impl.values() for n in f})
        for name in names:
            cells = []
            for impl in IMPLS:
                v = by_impl.get(impl, {}).get(name)
                if v is not None:
                    cells.append(f"{impl} {v:,.3g}" if v < 1000 else f"{impl} {v:,.0f}")
            ratio = ""
            p, d = (by_impl.get(i, {}).get(name) for i in IMPLS)
            if p and d:
                better = p / d if name == "ops/s" else d / p  # ops/s: higher is better
                ratio = f"  (pagedkv {better:.2f}x {'better' if better >= 1 else 'worse'})"
            lines.append(f"  {name:<22} " + "   ".join(cells) + ratio)
    return lines
