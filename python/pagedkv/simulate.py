"""A small synthetic serving workload, replayed through a block manager.

`generate_workload` builds a deterministic list of requests: a few hundred prompts that share a
handful of system prompts of various lengths, each with a unique suffix, some with a tenant
salt, a few asking for parallel samples. `run_workload` plays the part of an engine's
scheduler around any manager with the pagedkv API (the Rust `BlockManager` or the pure-Python
`ReferenceBlockManager`): it admits requests while blocks last, decodes one token per running
sequence per step with one `append_batch`, preempts the newest sequence when a step does not fit
(swap-out when CPU blocks exist, else free and recompute later), forks sequences for parallel
sampling and frees finished ones. With a small pool, cached prefixes are evicted constantly.

The benches reuse both functions, and `record=True` keeps the exact list of manager calls so
that a benchmark can replay the same trace on another manager with no scheduler in the way
(`replay_trace`).

Run it with `python -m pagedkv simulate`.
"""

from __future__ import annotations

import random
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from pagedkv.alloc_status import AllocStatus
from pagedkv.stats import Stats

VOCAB_SIZE = 32_000

# The block manager surface the scheduler uses: both implementations satisfy it.


class ManagerLike(Protocol):
    """The part of the pagedkv manager API that `run_workload` calls."""

    @property
    def num_blocks(self) -> int: ...
    @property
    def block_size(self) -> int: ...
    @property
    def num_available_blocks(self) -> int: ...
    def allocate(
        self,
        seq_id: int,
        token_ids: Any,
        *,
        cache_salt: str | bytes | None = None,
        lora_id: int | None = None,
        lookahead: int = 0,
    ) -> int | None: ...
    def append_batch(self, seq_ids: Any, token_ids: Any) -> Any: ...
    def fork(self, parent_id: int, child_id: int) -> None: ...
    def free(self, seq_id: int) -> None: ...
    def free_batch(self, seq_ids: Any) -> None: ...
    def swap_out(self, seq_id: int) -> list[tuple[int, int]] | None: ...
    def swap_in(self, seq_id: int) -> list[tuple[int, int]] | None: ...
    def can_allocate(self, num_tokens: int) -> AllocStatus: ...
    def can_swap_in(self, seq_id: int) -> AllocStatus: ...
    def stats(self) -> Stats: ...
    def check_invariants(self) -> None: ...


# --------------------------------------------------------------------------------------------
# Workload


@dataclass(frozen=True, slots=True, eq=False)
class Request:
    """One request: its prompt (uint32 token ids), tokens to generate, and how many samples."""

    request_id: int
    prompt: npt.NDArray[np.uint32]
    max_new_tokens: int
    num_samples: int = 1
    cache_salt: str | None = None
    system_prompt: int = 0  # which shared system prompt the prompt starts with


@dataclass(frozen=True, slots=True)
class Workload:
    """A deterministic list of requests (all arriving at once: a closed-loop replay)."""

    requests: tuple[Request, ...]
    seed: int
    system_prompt_lengths: tuple[int, ...]

    @property
    def prompt_tokens(self) -> int:
        return sum(len(r.prompt) for r in self.requests)

    @property
    def max_new_tokens(self) -> int:
        return sum(r.max_new_tokens * r.num_samples for r in self.requests)

    def describe(self) -> str:
        samples = sum(r.num_samples for r in self.requests)
        return (
            f"{len(self.requests)} requests ({samples} sequences with parallel samples), "
            f"{len(self.system_prompt_lengths)} system prompts of "
            f"{', '.join(map(str, self.system_prompt_lengths))} tokens, "
            f"{self.prompt_tokens} prompt tokens, up to {self.max_new_tokens} generated, "
            f"seed {self.seed}"
        )


def generate_workload(
    num_requests: int = 300,
    *,
    seed: int = 0,
    num_system_prompts: int = 6,
    max_system_prompt: int = 2048,
    suffix_tokens: tuple[int, int] = (8, 384),
    new_tokens: tuple[int, int] = (4, 160),
    parallel_sampling_rate: float = 0.06,
    salted_rate: float = 0.1,
) -> Workload:
    """Build a deterministic shared-prefix workload.

    Each request starts with one of `num_system_prompts` system prompts (lengths spread up to
    `max_system_prompt`, the shorter ones more popular), followed by a unique suffix of
    `suffix_tokens` (inclusive range) tokens; it generates `new_tokens` tokens. A fraction
    `parallel_sampling_rate` asks for 2-4 samples (forks), a fraction `salted_rate` carries one
    of two tenant salts (so its prefix never hits the unsalted copies).
    """
    if num_requests < 0:
        raise ValueError("num_requests must be >= 0")
    if num_system_prompts < 1:
        raise ValueError("num_system_prompts must be >= 1")
    rng = random.Random(seed)
    lengths = tuple(
        max(1, round(max_system_prompt * (i + 1) / num_system_prompts) - rng.randrange(16))
        for i in range(num_system_prompts)
    )
    system_prompts = [[rng.randrange(VOCAB_SIZE) for _ in range(length)] for length in lengths]
    # Zipf-like popularity: system prompt i is chosen with weight 1 / (i + 1).
    weights = [1.0 / (i + 1) for i in range(num_system_prompts)]
    requests = []
    for rid in range(num_requests):
        sp = rng.choices(range(num_system_prompts), weights)[0]
        suffix = [rng.randrange(VOCAB_SIZE) for _ in range(rng.randint(*suffix_tokens))]
        samples = rng.randint(2, 4) if rng.random() < parallel_sampling_rate else 1
        salt = f"tenant-{rng.randrange(2)}" if rng.random() < salted_rate else None
        requests.append(
            Request(
                request_id=rid,
                prompt=np.asarray(system_prompts[sp] + suffix, dtype=np.uint32),
                max_new_tokens=rng.randint(*new_tokens),
                num_samples=samples,
                cache_salt=salt,
                system_prompt=sp,
            )
        )
    return Workload(tuple(requests), seed, lengths)


def generated_token(seq_id: int, position: int) -> int:
    """The token a sequence 'samples' at `position`: a fixed function, so reruns agree."""
    return (((seq_id * 0x9E3779B1) ^ (position * 0x85EBCA77)) & 0xFFFFFFFF) % VOCAB_SIZE


def generated_tokens(seq_id: int, start: int, stop: int) -> npt.NDArray[np.uint32]:
    """`generated_token(seq_id, p)` for `p` in `start..stop`, as a uint32 array."""
    pos = np.arange(start, stop, dtype=np.uint64)
    mixed = np.uint64((seq_id * 0x9E3779B1) & 0xFFFFFFFFFFFFFFFF) ^ (pos * np.uint64(0x85EBCA77))
    return ((mixed & np.uint64(0xFFFFFFFF)) % np.uint64(VOCAB_SIZE)).astype(np.uint32)


# --------------------------------------------------------------------------------------------
# Scheduler


@dataclass(slots=True)
class _Seq:
    seq_id: int
    request: Request
    generated: int = 0
    forked: bool = False  # children are created at the parent's first admission

    @property
    def num_tokens(self) -> int:
        return len(self.request.prompt) + self.generated

    def all_tokens(self) -> npt.NDArray[np.uint32]:
        """Prompt plus generated tokens: what a recompute must allocate."""
        if not self.generated:
            return self.request.prompt
        plen = len(self.request.prompt)
        gen = generated_tokens(self.seq_id, plen, plen + self.generated)
        return np.concatenate([self.request.prompt, gen])


@dataclass(slots=True)
class SimResult:
    """What happened in one replay."""

    steps: int = 0
    finished_sequences: int = 0
    rejected_sequences: int = 0  # can never fit the pool
    forks: int = 0
    preempted_recompute: int = 0
    preempted_swap: int = 0
    prompt_tokens: int = 0  # tokens passed to allocate (recomputes included)
    decode_tokens: int = 0  # tokens appended by append_batch
    copy_pairs: int = 0  # copy-on-write pairs returned by append_batch
    manager_calls: int = 0
    manager_ns: int = 0  # time spent inside manager calls
    wall_s: float = 0.0
    trace: list[tuple[str, tuple[Any, ...], dict[str, Any]]] | None = field(
        default=None, repr=False
    )
    results: list[Any] | None = field(default=None, repr=False)

    @property
    def tokens(self) -> int:
        return self.prompt_tokens + self.decode_tokens

    @property
    def ns_per_token(self) -> float:
        return self.manager_ns / self.tokens if self.tokens else 0.0

    def summary(self) -> str:
        return "\n".join(
            [
                f"steps       {self.steps}; sequences finished {self.finished_sequences}, "
                f"rejected {self.rejected_sequences}; forks {self.forks}",
                f"preemptions {self.preempted_recompute} recompute, {self.preempted_swap} swap",
                f"tokens      {self.prompt_tokens} prompt + {self.decode_tokens} decode = "
                f"{self.tokens}; copy-on-write pairs {self.copy_pairs}",
                f"time        wall {self.wall_s:.3f} s; inside {self.manager_calls} manager "
                f"calls {self.manager_ns / 1e9:.3f} s = {self.ns_per_token:.1f} ns/token "
                f"(wall {self.wall_s * 1e9 / max(self.tokens, 1):.1f} ns/token)",
            ]
        )


class _Calls:
    """Calls the manager, timing each call and optionally recording it."""

    __slots__ = ("calls", "manager", "ns", "results", "trace")

    def __init__(self, manager: ManagerLike, record: bool) -> None:
        self.manager = manager
        self.ns = 0
        self.calls = 0
        self.trace: list[tuple[str, tuple[Any, ...], dict[str, Any]]] | None = (
            [] if record else None
        )
        self.results: list[Any] | None = [] if record else None

    def __call__(self, name: str, *args: Any, **kwargs: Any) -> Any:
        fn = getattr(self.manager, name)
        t0 = time.perf_counter_ns()
        out = fn(*args, **kwargs)
        self.ns += time.perf_counter_ns() - t0
        self.calls += 1
        if self.trace is not None and self.results is not None:
            self.trace.append((name, args, kwargs))
            self.results.append(out)
        return out


def run_workload(
    manager: ManagerLike,
    workload: Workload,
    *,
    max_batch: int = 256,
    record: bool = False,
) -> SimResult:
    """Replay `workload` through `manager` as a simple continuous-batching scheduler would.

    Per step: swap in preempted sequences (oldest first), admit waiting ones (FIFO, checked
    with `can_allocate`) up to `max_batch`, fork new requests that want several samples, decode
    one token for every running sequence with one `append_batch` (on None, preempt the newest
    sequence and retry), then `free_batch` the finished ones.
    """
    t_start = time.perf_counter()
    res = SimResult()
    call = _Calls(manager, record)
    use_swap = manager.stats().num_cpu_blocks > 0
    next_id = len(workload.requests)

    waiting: deque[_Seq] = deque(_Seq(r.request_id, r) for r in workload.requests)
    swapped: deque[_Seq] = deque()
    running: list[_Seq] = []
    blocked_at = -1  # available blocks when the head of the queue last failed to allocate

    def preempt(victim: _Seq) -> None:
        if use_swap and call("swap_out", victim.seq_id) is not None:
            res.preempted_swap += 1
            swapped.append(victim)
            return
        call("free", victim.seq_id)
        res.preempted_recompute += 1
        waiting.appendleft(victim)

    while waiting or swapped or running:
        res.steps += 1
        # 1. Swap in (preempted sequences first, as vLLM does), then admit new work.
        while swapped and len(running) < max_batch:
            s = swapped[0]
            status = call("can_swap_in", s.seq_id)
            # LATER: wait for running sequences to finish. NEVER (it grew into the watermark)
            # and nothing else running: swap_in itself ignores the watermark, so try it.
            if status == AllocStatus.LATER or (status == AllocStatus.NEVER and running):
                break
            if call("swap_in", s.seq_id) is None:
                break
            swapped.popleft()
            running.append(s)
        if not running:
            blocked_at = -1  # the whole pool is available: always try
        while not swapped and waiting and len(running) < max_batch:
            s = waiting[0]
            n = s.num_tokens
            status = call("can_allocate", n)
            if status == AllocStatus.NEVER:
                waiting.popleft()
                res.rejected_sequences += 1
                continue
            # LATER only means "not with the watermark kept free": allocate counts prefix hits
            # and ignores the watermark, so try it (vLLM v1 admits the same way).
            if manager.num_available_blocks <= blocked_at:
                break  # it did not fit last time and nothing was released since
            tokens = s.all_tokens()
            if call("allocate", s.seq_id, tokens, cache_salt=s.request.cache_salt) is None:
                blocked_at = manager.num_available_blocks
                break
            blocked_at = -1
            waiting.popleft()
            res.prompt_tokens += n
            running.append(s)
            if not s.forked and s.seq_id < len(workload.requests):
                s.forked = True
                for _ in range(s.request.num_samples - 1):
                    child = _Seq(next_id, s.request, s.generated, forked=True)
                    next_id += 1
                    call("fork", s.seq_id, child.seq_id)
                    res.forks += 1
                    running.append(child)
        if not running:
            if waiting or swapped:
                # Nothing runs and nothing could be admitted: only possible if the head of the
                # queue can never be served; the checks above make this unreachable.
                raise RuntimeError("scheduler made no progress")
            break

        # 2. Decode one token for every running sequence.
        ids = np.fromiter((s.seq_id for s in running), dtype=np.int64, count=len(running))
        toks = np.fromiter(
            (generated_token(s.seq_id, s.num_tokens) for s in running),
            dtype=np.int64,
            count=len(running),
        )
        while True:
            pairs = call("append_batch", ids, toks)
            if pairs is not None:
                break
            victim = running.pop()
            ids, toks = ids[:-1], toks[:-1]
            if not running:
                # Even alone with the whole pool it cannot grow: give up on it.
                call("free", victim.seq_id)
                res.rejected_sequences += 1
                break
            preempt(victim)
        if pairs is None:
            continue
        res.copy_pairs += len(pairs)
        res.decode_tokens += len(running)

        # 3. Retire finished sequences.
        done: list[int] = []
        still: list[_Seq] = []
        for s in running:
            s.generated += 1
            if s.generated >= s.request.max_new_tokens:
                done.append(s.seq_id)
            else:
                still.append(s)
        if done:
            call("free_batch", np.asarray(done, dtype=np.int64))
            res.finished_sequences += len(done)
        running = still

    res.manager_ns = call.ns
    res.manager_calls = call.calls
    res.trace = call.trace
    res.results = call.results
    res.wall_s = time.perf_counter() - t_start
    return res


# --------------------------------------------------------------------------------------------
# Trace replay


def bind_trace(
    manager: object, trace: Sequence[tuple[str, tuple[Any, ...], dict[str, Any]]]
) -> list[tuple[Any, tuple[Any, ...], dict[str, Any]]]:
    """Resolve a recorded trace's method names on `manager` (done once, before timing)."""
    return [(getattr(manager, name), args, kwargs) for name, args, kwargs in trace]


def replay_trace(bound: Sequence[tuple[Any, tuple[Any, ...], dict[str, Any]]]) -> None:
    """Make every recorded call again, in order (see `bind_trace`)."""
    for fn, args, kwargs in bound:
        fn(*args, **kwargs)


def same_result(a: Any, b: Any) -> bool:
    """Whether two managers' answers to the same call agree (arrays compared by value)."""
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return bool(np.array_equal(np.asarray(a), np.asarray(b)))
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return len(a) == len(b) and all(same_result(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


__all__ = [
    "VOCAB_SIZE",
    "ManagerLike",
    "Request",
    "SimResult",
    "Workload",
    "bind_trace",
    "generate_workload",
    "generated_token",
    "generated_tokens",
    "replay_trace",
    "run_workload",
    "same_result",
]
