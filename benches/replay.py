"""Issue 13's replay: 2,000 shared-prefix requests through a block manager, timed per operation.

The workload (seeded, `generate`): each prompt is one of 24 system prompts of 500-1,100 tokens
(Zipf popularity), then with probability 0.55 one of 300 shared documents of 300-1,700 tokens
(Zipf), then 32-1,170 tokens of its own; 16-534 generated tokens. With the default seed, 2,000
requests give 3.92 M prompt and 0.54 M generated tokens. Token ids are random below 128,000.

The driver (`replay`) is a small continuous-batching loop, the same for every manager: admit
waiting requests in order (at most 256 running) while the pool's available blocks cover the
new request's blocks at its end (prompt and output) plus the growth every running sequence
still needs (so a decode step never runs out and nothing is preempted), then one
`append_batch` of one generated token to every running sequence (or, with `--impl
rust+running`, one `RunningBatch.step`), then `free` each finished one. The pool is 70% of the
peak demand: the most blocks held by running sequences in a dry run on a pool that never fills
(`size_pool`), so cached blocks are evicted all the time. Rust `pagedkv.BlockManager` and
`pagedkv_reference.ReferenceBlockManager` take the same calls and give the same hits.

Only time inside manager calls is counted (`time.perf_counter_ns` around each call, less the
timer's own cost): allocate per prompt token (also over the mostly-miss and the mostly-hit
requests), decode per sequence per step, free per block, and their total. Total hit
tokens and a fingerprint of the per-request hits let a later build show "same hits to the token".
`hashing_floor` times SHA-256 on the same prompts, so allocate can be read above hashing.

Run: `python benches/replay.py` (the full replay, Rust), `python benches/replay.py --impl
rust,reference --requests 300` (both on the same reduced replay), `--json FILE` for the figures.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

import pagedkv

# The reference model is test support, not part of the wheel: take it from the checkout.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "testing"))
from pagedkv_reference import ReferenceBlockManager

BLOCK_SIZE = 16
POOL_FRACTION = 0.7
MAX_RUNNING = 256
VOCAB = 128_000
SEED = 13

U32 = npt.NDArray[np.uint32]
I64 = npt.NDArray[np.int64]


@dataclass(frozen=True)
class Workload:
    """Prompts (uint32 arrays) and generated tokens (one array, cut by `out_off`/`out_len`)."""

    prompts: list[U32]
    out_tokens: U32
    out_off: I64
    out_len: I64

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def generated_tokens(self) -> int:
        return int(self.out_len.sum())


def _zipf(rng: np.random.Generator, n: int, k: int, s: float) -> I64:
    w = 1.0 / np.arange(1, k + 1) ** s
    return rng.choice(k, size=n, p=w / w.sum())


def generate(num_requests: int = 2000, seed: int = SEED) -> Workload:
    """The seeded shared-prefix workload (see the module docstring)."""
    rng = np.random.default_rng(seed)

    def pieces(k: int, lo: int, hi: int) -> list[U32]:
        return [rng.integers(0, VOCAB, rng.integers(lo, hi), dtype=np.uint32) for _ in range(k)]

    systems, docs = pieces(24, 500, 1100), pieces(300, 300, 1700)
    sys_pick, doc_pick = _zipf(rng, num_requests, 24, 1.1), _zipf(rng, num_requests, 300, 0.9)
    has_doc = rng.random(num_requests) < 0.55
    prompts = []
    for i in range(num_requests):
        parts = [systems[sys_pick[i]]]
        if has_doc[i]:
            parts.append(docs[doc_pick[i]])
        parts.append(rng.integers(0, VOCAB, rng.integers(32, 1170), dtype=np.uint32))
        prompts.append(np.concatenate(parts))
    out_len = rng.integers(16, 535, num_requests).astype(np.int64)
    out_off = np.concatenate([[0], np.cumsum(out_len)[:-1]]).astype(np.int64)
    out_tokens = rng.integers(0, VOCAB, int(out_len.sum()), dtype=np.uint32)
    return Workload(prompts, out_tokens, out_off, out_len)


@functools.cache
def _timer_cost_ns() -> int:
    """The least time one `perf_counter_ns` pair reports around nothing."""
    clock = time.perf_counter_ns
    best = 1 << 62
    for _ in range(20_000):
        t = clock()
        best = min(best, clock() - t)
    return best


@dataclass
class ReplayResult:
    """What one replay measured; times in ns inside manager calls, timer cost removed."""

    impl: str
    num_blocks: int
    requests: int
    steps: int
    prompt_tokens: int
    generated_tokens: int
    hit_tokens: int
    hits_fingerprint: str
    evictions: int
    allocate_ns: int
    decode_ns: int
    seq_steps: int
    free_ns: int
    blocks_freed: int
    query_ns: int
    wall_s: float
    timer_ns: int
    alloc_ns_each: list[int]
    hits_each: list[int]

    @property
    def manager_ns(self) -> int:
        return self.allocate_ns + self.decode_ns + self.free_ns + self.query_ns

    def split_hits(self, prompt_lens: list[int]) -> dict[str, float]:
        """Allocate ns per prompt token over the mostly-miss requests (hits under 20% of the
        prompt) and the mostly-hit ones (over 80%), with how many requests each holds."""
        hits = np.asarray(self.hits_each, dtype=np.float64)
        lens = np.asarray(prompt_lens, dtype=np.float64)
        ns = np.asarray(self.alloc_ns_each, dtype=np.float64)
        out: dict[str, float] = {}
        for name, sel in (("miss", hits < 0.2 * lens), ("hit", hits > 0.8 * lens)):
            out[f"allocate_ns_per_token_mostly_{name}"] = (
                float(ns[sel].sum() / lens[sel].sum()) if sel.any() else float("nan")
            )
            out[f"requests_mostly_{name}"] = int(sel.sum())
        return out


def _cdiv(a: Any, b: int) -> Any:
    return -(-a // b)


def replay(
    m: Any,
    w: Workload,
    *,
    impl: str = "?",
    max_running: int = MAX_RUNNING,
    running_batch: bool = False,
) -> ReplayResult:
    """Drive `m` through the workload (module docstring); returns the timed figures.

    `running_batch`: decode through a `RunningBatch` (admitted sequences are added to it, each
    step is its `step`, finished ones are removed before their `free`) instead of
    `append_batch`; adding counts as decode time, removing as free time."""
    clock, tc = time.perf_counter_ns, _timer_cost_ns()
    bs, n = int(m.block_size), len(w.prompts)
    plen = np.array([len(p) for p in w.prompts], dtype=np.int64)
    final_blocks = _cdiv(plen + w.out_len, bs)
    pos = np.zeros(n, dtype=np.int64)
    running = np.zeros(0, dtype=np.int64)
    alloc_each, hits_each = [0] * n, [0] * n
    decode_ns = seq_steps = free_ns = blocks_freed = query_ns = steps = 0
    batch = m.running_batch() if running_batch else None
    nxt, wall = 0, time.perf_counter()
    while nxt < n or running.size:
        while nxt < n and running.size < max_running:
            r = running
            reserve = int((final_blocks[r] - _cdiv(plen[r] + pos[r], bs)).sum())
            t = clock()
            avail = m.num_available_blocks
            query_ns += clock() - t - tc
            if avail < reserve + int(final_blocks[nxt]):  # its prompt and its growth
                break
            t = clock()
            hit = m.allocate(nxt, w.prompts[nxt])
            alloc_each[nxt] = clock() - t - tc
            if hit is None:
                raise RuntimeError(f"allocate {nxt} did not fit with {avail} blocks available")
            hits_each[nxt] = hit
            if batch is not None:
                t = clock()
                batch.add([nxt])
                decode_ns += clock() - t - tc
            running = np.append(running, nxt)
            nxt += 1
        if not running.size:
            raise RuntimeError(f"request {nxt} can never be admitted")
        toks = w.out_tokens[w.out_off[running] + pos[running]]
        t = clock()
        out = m.append_batch(running, toks) if batch is None else batch.step(toks)
        decode_ns += clock() - t - tc
        if out is None:
            raise RuntimeError("append_batch ran out of blocks despite the growth reserve")
        seq_steps += running.size
        steps += 1
        pos[running] += 1
        done = pos[running] == w.out_len[running]
        if batch is not None and done.any():
            t = clock()
            batch.remove(running[done])
            free_ns += clock() - t - tc
        for s in running[done].tolist():
            t = clock()
            m.free(s)
            free_ns += clock() - t - tc
            blocks_freed += int(final_blocks[s])
        running = running[~done]
    wall_s = time.perf_counter() - wall
    m.check_invariants()
    return ReplayResult(
        impl=impl,
        num_blocks=int(m.num_blocks),
        requests=n,
        steps=steps,
        prompt_tokens=int(plen.sum()),
        generated_tokens=w.generated_tokens,
        hit_tokens=sum(hits_each),
        hits_fingerprint=hashlib.sha256(np.asarray(hits_each, np.int64).tobytes()).hexdigest()[:16],
        evictions=int(m.stats().evictions),
        allocate_ns=sum(alloc_each),
        decode_ns=decode_ns,
        seq_steps=seq_steps,
        free_ns=free_ns,
        blocks_freed=blocks_freed,
        query_ns=query_ns,
        wall_s=wall_s,
        timer_ns=tc,
        alloc_ns_each=alloc_each,
        hits_each=hits_each,
    )


def size_pool(
    w: Workload, *, max_running: int = MAX_RUNNING, fraction: float = POOL_FRACTION
) -> int:
    """`fraction` of the most blocks running sequences hold at once on a pool that never fills
    (a dry run through the Rust manager; every manager would hold the same blocks)."""
    plen = np.array([len(p) for p in w.prompts], dtype=np.int64)
    m = pagedkv.BlockManager(int(_cdiv(plen + w.out_len, BLOCK_SIZE).sum()) + 1, BLOCK_SIZE)
    peak = 0
    real_append = m.append_batch

    def append_batch(ids: I64, toks: U32) -> Any:
        nonlocal peak
        peak = max(peak, m.num_blocks - m.num_available_blocks)
        out = real_append(ids, toks)
        peak = max(peak, m.num_blocks - m.num_available_blocks)
        return out

    replay(_Spy(m, append_batch), w, max_running=max_running)
    return int(peak * fraction)


class _Spy:
    """A manager whose `append_batch` is replaced (the Rust class cannot be patched)."""

    def __init__(self, m: Any, append_batch: Callable[..., Any]) -> None:
        self._m, self.append_batch = m, append_batch

    def __getattr__(self, name: str) -> Any:
        return getattr(self._m, name)


def make(impl: str, num_blocks: int) -> Any:
    """A fresh manager of `impl` ("rust" or "reference"): block size 16, SHA-256."""
    if impl == "rust":
        return pagedkv.BlockManager(num_blocks, BLOCK_SIZE, hash_algo="sha256")
    if impl == "reference":
        return ReferenceBlockManager(num_blocks, BLOCK_SIZE, hash_algo="sha256")
    raise ValueError(impl)


def hashing_floor(w: Workload) -> dict[str, float]:
    """SHA-256 cost per prompt token on the workload's prompts, three ways:

    - `core_hash_blocks`: `pagedkv.hash_blocks` per prompt, best of 3 passes (the core's chain
      hash, plus the binding's conversion and one bytes object per block);
    - `hashlib_chain`: hashlib, one call per block over its documented message (docs/hashing.md;
      Python's per-call cost included, an upper bound);
    - `sha256_2x64B`: hashlib's SHA-256 rate on a long buffer (best of 3) at 128 bytes a block:
      a block's 105-byte message pads to two SHA-256 compressions, the bare floor;
    - `sha256_1x64B`: the same rate at 64 bytes a block (the token bytes alone, one
      compression): the floor of an encoding that fitted one compression.
    """
    clock = time.perf_counter_ns
    tokens = w.prompt_tokens
    core = 1 << 62
    for _ in range(3):  # best of 3 passes: the machine is shared, noise only adds time
        t = clock()
        for p in w.prompts:
            pagedkv.hash_blocks(p, BLOCK_SIZE)
        core = min(core, clock() - t)
    sub = w.prompts[: max(1, len(w.prompts) // 10)]  # a tenth: the Python loop is slow
    msgs = []
    for p in sub:
        full = p[: len(p) // BLOCK_SIZE * BLOCK_SIZE].reshape(-1, BLOCK_SIZE)
        msgs.append([b.astype("<u4").tobytes() for b in full])
    head, tail = b"PKV1", b"\x10\x00\x00\x00"
    root = hashlib.sha256(b"PKV1root" + bytes(8)).digest()
    t = clock()
    for blocks in msgs:
        parent = root
        for body in blocks:
            parent = hashlib.sha256(head + parent + tail + body + b"\x00").digest()
    chain = clock() - t
    buf = b"\x5a" * (8 << 20)  # touched already: no page faults in the timed call
    ns_per_byte = float("inf")
    for _ in range(3):
        t = clock()
        hashlib.sha256(buf).digest()
        ns_per_byte = min(ns_per_byte, (clock() - t) / len(buf))
    return {
        "core_hash_blocks": core / tokens,
        "hashlib_chain": chain / sum(len(p) for p in sub),
        "sha256_2x64B": ns_per_byte * 128 / BLOCK_SIZE,
        "sha256_1x64B": ns_per_byte * 64 / BLOCK_SIZE,
    }


def summary(r: ReplayResult, w: Workload, floor: dict[str, float] | None = None) -> dict[str, Any]:
    """The per-operation figures of one replay (ns per unit), for printing or JSON."""
    out: dict[str, Any] = {
        "impl": r.impl,
        "requests": r.requests,
        "num_blocks": r.num_blocks,
        "steps": r.steps,
        "prompt_tokens": r.prompt_tokens,
        "generated_tokens": r.generated_tokens,
        "hit_tokens": r.hit_tokens,
        "hit_rate": r.hit_tokens / r.prompt_tokens,
        "hits_fingerprint": r.hits_fingerprint,
        "evictions": r.evictions,
        "allocate_ns_per_token": r.allocate_ns / r.prompt_tokens,
        **r.split_hits([len(p) for p in w.prompts]),
        "decode_ns_per_seq_step": r.decode_ns / r.seq_steps,
        "decode_mean_batch": r.seq_steps / r.steps,
        "free_ns_per_block": r.free_ns / r.blocks_freed,
        "free_ns_per_request": r.free_ns / r.requests,
        "allocate_s": r.allocate_ns / 1e9,
        "decode_s": r.decode_ns / 1e9,
        "free_s": r.free_ns / 1e9,
        "query_s": r.query_ns / 1e9,
        "manager_s": r.manager_ns / 1e9,
        "wall_s": r.wall_s,
        "timer_ns_removed_per_call": r.timer_ns,
    }
    if floor:
        out["hash_ns_per_token"] = floor
        out["allocate_above_core_hash_ns_per_token"] = (
            out["allocate_ns_per_token"] - floor["core_hash_blocks"]
        )
        out["allocate_above_sha256_2x64B_ns_per_token"] = (
            out["allocate_ns_per_token"] - floor["sha256_2x64B"]
        )
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument(
        "--impl",
        default="rust",
        help="comma list of rust, reference, and rust+running / reference+running (decode "
        "through a RunningBatch instead of append_batch)",
    )
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--seed", type=int, default=SEED)
    p.add_argument("--repeat", type=int, default=1, help="replays per manager (fresh each time)")
    p.add_argument(
        "--pool-fraction", type=float, default=POOL_FRACTION, help="pool over peak demand"
    )
    p.add_argument("--json", help="write the figures to this file")
    a = p.parse_args(argv)
    w = generate(a.requests, a.seed)
    num_blocks = size_pool(w, fraction=a.pool_fraction)
    floor = hashing_floor(w)
    runs = [(i, k) for i in a.impl.split(",") for k in range(a.repeat)]
    rows = [
        summary(
            replay(
                make(i.removesuffix("+running"), num_blocks),
                w,
                impl=f"{i}#{k + 1}",
                running_batch=i.endswith("+running"),
            ),
            w,
            floor,
        )
        for i, k in runs
    ]
    print(f"{a.requests} requests, {w.prompt_tokens} prompt tokens, {w.generated_tokens} generated")
    print(f"pool {num_blocks} blocks of {BLOCK_SIZE} ({a.pool_fraction:.0%} of peak demand)")
    print("SHA-256 ns per prompt token: " + ", ".join(f"{k} {v:.2f}" for k, v in floor.items()))
    for key in rows[0]:
        if key != "hash_ns_per_token":
            vals = [r[key] for r in rows]
            shown = [f"{v:.3f}" if isinstance(v, float) else str(v) for v in vals]
            print(f"  {key:<44}" + "".join(f"{s:>20}" for s in shown))
    if len(rows) > 1:
        same = all(r["hits_fingerprint"] == rows[0]["hits_fingerprint"] for r in rows)
        print(f"same hits to the token in every manager: {same}")
        if not same:
            return 1
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"workload_seed": a.seed, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
