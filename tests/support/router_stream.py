"""A Mooncake trace replayed as N engines' KV events, for router indexes (tests/router and
benches/test_bench_router.py): the same stream as vLLM payloads (pagedkv.router) and as
Dynamo's serialized events (`dynamo._core.RadixTree.apply_event`).

Each request goes to an engine chosen at random (seeded). An engine holds at most
`capacity` blocks in LRU order and stores a request's blocks from its first one not held;
it touches a request's blocks child first, so that a parent is always more recent than its
children and LRU evicts leaves first (as vLLM's tail-first release does): a stored block's
parent is always held, and no event removes a block that is not held. Trace copies beyond
the first map each hash id to another block (a tenant of its own), so the stream reaches any
number of memberships. Block hashes are 64-bit (splitmix64 of copy and hash id), as vLLM's
integer hashes are.
"""

from __future__ import annotations

import json
import random
from collections import OrderedDict, deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

_MASK = (1 << 64) - 1
TOKENS_PER_BLOCK = 16  # the token ids a vLLM payload carries per block (block_size 16)


def mix64(x: int) -> int:
    z = (x + 0x9E3779B97F4A7C15) & _MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return z ^ (z >> 31)


def read_trace(path: Path) -> list[list[int]]:
    """Each request's hash ids."""
    with path.open() as f:
        return [json.loads(line)["hash_ids"] for line in f if line.strip()]


@dataclass
class Batch:
    """One engine's events for one request: blocks removed (evicted), then blocks stored
    (a chain under `parent`)."""

    engine: int
    removed: list[int]
    stored: list[int]
    parent: int | None


@dataclass
class Stream:
    batches: list[Batch]
    lookups: list[list[int]]
    engines: int
    held: list[set[int]] = field(default_factory=list)

    @property
    def memberships(self) -> int:
        return sum(len(h) for h in self.held)

    @property
    def block_ops(self) -> int:
        return sum(len(b.removed) + len(b.stored) for b in self.batches)


def generate(
    trace: list[list[int]],
    *,
    engines: int,
    memberships: int,
    churn: float = 0.2,
    lookups: int = 2000,
    seed: int = 0,
) -> Stream:
    """Requests (trace copies in turn) until the engines hold `memberships` blocks between
    them, then `churn` x that many more stored blocks (evictions under full caches)."""
    rng = random.Random(seed)
    capacity = max(1, memberships // engines)
    caches: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(engines)]
    batches: list[Batch] = []
    # The lookups: requests of the stream's end (half of them, the last `lookups`), whose
    # prefixes the engines still hold in part, as a router's next requests would.
    asked: deque[list[int]] = deque(maxlen=lookups)
    stored_total, target = 0, memberships * (1 + churn)
    copy = 0
    while stored_total < target:
        for ids in trace:
            chain = [mix64((copy << 40) | i) for i in ids[:capacity]]
            if not chain:
                continue
            e = rng.randrange(engines)
            cache = caches[e]
            k = 0
            while k < len(chain) and chain[k] in cache:
                k += 1
            new = chain[k:]
            # Recency: the request's blocks, child first, so parents are the more recent;
            # the held prefix first, so that making room never evicts it.
            for h in reversed(chain[:k]):
                cache.move_to_end(h)
            removed: list[int] = []
            while len(cache) + len(new) > capacity:
                h, _ = cache.popitem(last=False)
                removed.append(h)
            for h in reversed(new):
                cache[h] = None
            for h in reversed(chain[:k]):  # and above the new blocks, their children
                cache.move_to_end(h)
            batches.append(Batch(e, removed, new, chain[k - 1] if k else None))
            stored_total += len(new)
            if rng.random() < 0.5:
                asked.append(chain)
            if stored_total >= target:
                break
        copy += 1
    return Stream(batches, list(asked), engines, [set(c) for c in caches])


# ---- encodings ---------------------------------------------------------------------------

_ENC = msgspec.msgpack.Encoder()


def vllm_payload(b: Batch, ts: float = 0.0) -> bytes:
    """The batch as vLLM's `KVEventBatch` payload (map form, integer hashes)."""
    events: list[dict[str, object]] = []
    if b.removed:
        events.append({"type": "BlockRemoved", "block_hashes": b.removed, "medium": "GPU"})
    if b.stored:
        events.append(
            {
                "type": "BlockStored",
                "block_hashes": b.stored,
                "parent_block_hash": b.parent,
                "token_ids": [7] * (TOKENS_PER_BLOCK * len(b.stored)),
                "block_size": TOKENS_PER_BLOCK,
                "lora_id": None,
                "medium": "GPU",
                "lora_name": None,
            }
        )
    return _ENC.encode([ts, events, 0])


def cleared_payload(ts: float = 0.0) -> bytes:
    """vLLM's payload of one `AllBlocksCleared`."""
    return _ENC.encode([ts, [{"type": "AllBlocksCleared"}], 0])


def dynamo_events(b: Batch, first_id: int) -> list[bytes]:
    """The batch as Dynamo's serialized KV cache events (one per event). A block's
    `tokens_hash` (the key Dynamo's tree matches on) is its block hash: chained hashes name
    their prefix, so matching on them walks the same tree."""
    out = []
    if b.removed:
        out.append({"event_id": first_id, "data": {"removed": {"block_hashes": b.removed}}})
    if b.stored:
        blocks = [{"block_hash": h, "tokens_hash": h} for h in b.stored]
        out.append(
            {
                "event_id": first_id + len(out),
                "data": {"stored": {"parent_hash": b.parent, "blocks": blocks}},
            }
        )
    return [json.dumps(e, separators=(",", ":")).encode() for e in out]


def dynamo_stream(s: Stream) -> Iterator[tuple[int, bytes]]:
    n = 0
    for b in s.batches:
        for ev in dynamo_events(b, n):
            yield b.engine, ev
            n += 1
