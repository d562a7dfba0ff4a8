"""A small continuous-batching scheduler that drives any block manager, step by step.

Per step (time advances one step at a time; idle stretches between arrivals are skipped):

1. arrivals: requests whose arrival step has come join the waiting queue (a later chat turn
   arrives `delay` steps after the turn before it finished);
2. swap in preempted sequences, oldest first, when room returns;
3. admit waiting requests (FIFO) while `can_allocate` allows and the step's token budget (prompt
   tokens not served from the prefix cache) lasts; fork the samples or beams a request asks for;
4. beam search: in each beam group, now and then prune a beam (free) and fork a survivor;
5. decode one token for every running sequence with one `append_batch`; when it does not fit,
   preempt the newest sequence (swap out when CPU blocks exist, else free it and recompute it
   later) and retry;
6. `free_batch` the finished sequences.

Every manager call is timed (`calls.TimedCalls`); per step the usage, cached blocks, queue
lengths, running hit rate, internal fragmentation and manager time are recorded.
"""

from __future__ import annotations

import heapq
import random
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from pagedkv.alloc_status import AllocStatus
from pagedkv.sim.calls import Call, TimedCalls
from pagedkv.sim.requests import Request, Workload, decode_tokens, generated_tokens
from pagedkv.stats import Stats

BEAM_PRUNE_PROBABILITY = 0.3  # per step and beam group: free one beam, fork a survivor


class ManagerLike(Protocol):
    """The part of the pagedkv manager API that `run_workload` calls."""

    @property
    def num_blocks(self) -> int: ...
    @property
    def block_size(self) -> int: ...
    @property
    def num_available_blocks(self) -> int: ...
    @property
    def num_free_blocks(self) -> int: ...
    @property
    def num_cached_blocks(self) -> int: ...
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


@dataclass(slots=True)
class StepSeries:
    """One entry per executed step, sampled after the decode (before finished ones leave)."""

    step: list[int] = field(default_factory=list)  # the simulated clock
    usage: list[float] = field(default_factory=list)  # used blocks / num_blocks
    cached_blocks: list[int] = field(default_factory=list)
    running: list[int] = field(default_factory=list)
    waiting: list[int] = field(default_factory=list)
    swapped: list[int] = field(default_factory=list)
    hit_rate: list[float] = field(default_factory=list)  # prefix hits so far / prompt tokens
    fragmentation: list[float] = field(default_factory=list)  # unused slots of held blocks
    manager_ns: list[int] = field(default_factory=list)  # time inside manager calls

    def as_dict(self) -> dict[str, list[int] | list[float]]:
        return {name: getattr(self, name) for name in self.__slots__}


@dataclass(slots=True)
class SimResult:
    """What happened in one replay."""

    requests: int = 0
    finished_requests: int = 0
    rejected_requests: int = 0  # can never fit the pool
    steps: int = 0  # steps executed
    clock_steps: int = 0  # simulated time, idle stretches included
    finished_sequences: int = 0
    rejected_sequences: int = 0
    pruned_sequences: int = 0  # beams freed by pruning
    forks: int = 0
    preempted_recompute: int = 0
    preempted_swap: int = 0
    swap_ins: int = 0
    prompt_tokens: int = 0  # tokens passed to allocate (recomputes included)
    prefix_hit_tokens: int = 0  # of those, served from the prefix cache
    decode_tokens: int = 0  # tokens appended by append_batch
    copy_pairs: int = 0  # copy-on-write pairs returned by append_batch
    manager_calls: int = 0
    manager_ns: int = 0  # time spent inside manager calls
    wall_s: float = 0.0
    series: StepSeries = field(default_factory=StepSeries, repr=False)
    final_stats: Stats | None = field(default=None, repr=False)
    trace: list[Call] | None = field(default=None, repr=False)
    results: list[Any] | None = field(default=None, repr=False)

    @property
    def tokens(self) -> int:
        return self.prompt_tokens + self.decode_tokens

    @property
    def ns_per_token(self) -> float:
        return self.manager_ns / self.tokens if self.tokens else 0.0

    @property
    def hit_rate(self) -> float:
        return self.prefix_hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def preemptions(self) -> int:
        return self.preempted_recompute + self.preempted_swap

    def summary(self) -> str:
        """A few lines of plain text (the command prints `report.summary_table` instead)."""
        return "\n".join(
            [
                f"steps       {self.steps}; sequences finished {self.finished_sequences}, "
                f"rejected {self.rejected_sequences}; forks {self.forks}",
                f"preemptions {self.preempted_recompute} recompute, {self.preempted_swap} swap",
                f"tokens      {self.prompt_tokens} prompt + {self.decode_tokens} decode = "
                f"{self.tokens}; copy-on-write pairs {self.copy_pairs}",
                f"time        wall {self.wall_s:.3f} s; inside {self.manager_calls} manager "
                f"calls {self.manager_ns / 1e9:.3f} s = {self.ns_per_token:.1f} ns/token",
            ]
        )


@dataclass(slots=True)
class _Seq:
    seq_id: int
    request: Request
    generated: int = 0
    forked: bool = False  # samples and beams are forked at the first admission only
    # Who generated which tokens: (owner seq id, first position), so that a forked sequence
    # recomputed after preemption gets back exactly the tokens it held.
    segments: tuple[tuple[int, int], ...] = ()

    @property
    def num_tokens(self) -> int:
        return self.request.prompt_len + self.generated

    def all_tokens(self) -> npt.NDArray[np.uint32]:
        """Prompt plus generated tokens: what a (re)computation must allocate."""
        prompt = self.request.prompt
        if not self.generated:
            return prompt
        end = self.num_tokens
        parts = [prompt]
        segs = self.segments
        for i, (owner, start) in enumerate(segs):
            stop = min(segs[i + 1][1] if i + 1 < len(segs) else end, end)
            if stop > start:
                parts.append(generated_tokens(owner, start, stop))
        return np.concatenate(parts)


class _Scheduler:
    def __init__(
        self,
        manager: ManagerLike,
        workload: Workload,
        *,
        max_batch: int,
        max_batch_tokens: int,
        record: bool,
        check: bool,
        progress: Callable[[int, int], None] | None,
    ) -> None:
        self.m = manager
        self.call = TimedCalls(manager, record)
        self.res = SimResult(requests=len(workload.requests))
        self.max_batch = max_batch
        self.max_batch_tokens = max_batch_tokens
        self.check = check
        self.progress = progress
        self.use_swap = manager.stats().num_cpu_blocks > 0
        self.rng = random.Random(workload.seed)
        self.by_id = {r.request_id: r for r in workload.requests}
        self.arrivals: list[tuple[int, int]] = []
        self.dependents: dict[int, list[Request]] = {}
        for r in workload.requests:
            if r.after is not None and r.after in self.by_id:
                self.dependents.setdefault(r.after, []).append(r)
            else:
                self.arrivals.append((r.arrival_step, r.request_id))
        heapq.heapify(self.arrivals)
        self.next_id = max(self.by_id, default=-1) + 1
        self.live: dict[int, int] = {}  # request id -> sequences not yet ended
        self.waiting: deque[_Seq] = deque()
        self.swapped: deque[_Seq] = deque()
        self.running: list[_Seq] = []
        self.clock = 0
        self.blocked_at = -1  # available blocks when the queue's head last failed to allocate

    # ------------------------------------------------------------------ bookkeeping

    def _end(self, s: _Seq) -> None:
        """A sequence ended (finished, pruned or rejected); maybe its request too."""
        rid = s.request.request_id
        self.live[rid] -= 1
        if self.live[rid]:
            return
        del self.live[rid]
        self.res.finished_requests += 1
        for d in self.dependents.pop(rid, ()):
            heapq.heappush(self.arrivals, (self.clock + 1 + d.delay, d.request_id))

    def _reject(self, s: _Seq) -> None:
        res = self.res
        if not s.forked:  # its samples or beams will never exist either
            res.rejected_sequences += s.request.sequences
            res.rejected_requests += 1
        else:
            res.rejected_sequences += 1
        self._end(s)

    def _fork(self, parent: _Seq) -> None:
        child = _Seq(
            self.next_id,
            parent.request,
            parent.generated,
            True,
            (*parent.segments, (self.next_id, parent.num_tokens)),
        )
        self.next_id += 1
        self.call("fork", parent.seq_id, child.seq_id)
        self.res.forks += 1
        self.live[parent.request.request_id] += 1
        self.running.append(child)

    def _preempt(self, victim: _Seq) -> None:
        if self.use_swap and self.call("swap_out", victim.seq_id) is not None:
            self.res.preempted_swap += 1
            self.swapped.append(victim)
            return
        self.call("free", victim.seq_id)
        self.res.preempted_recompute += 1
        self.waiting.appendleft(victim)

    # ------------------------------------------------------------------ the phases of a step

    def _arrive(self) -> None:
        if not (self.waiting or self.swapped or self.running):
            self.clock = max(self.clock, self.arrivals[0][0])  # skip the idle stretch
        while self.arrivals and self.arrivals[0][0] <= self.clock:
            _, rid = heapq.heappop(self.arrivals)
            r = self.by_id[rid]
            self.waiting.append(_Seq(rid, r, segments=((rid, r.prompt_len),)))
            self.live[rid] = 1

    def _swap_in(self) -> None:
        call, swapped, running = self.call, self.swapped, self.running
        while swapped and len(running) < self.max_batch:
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
            self.res.swap_ins += 1

    def _admit(self) -> None:
        call, m, res, waiting, running = self.call, self.m, self.res, self.waiting, self.running
        if not running:
            self.blocked_at = -1  # the whole pool is available: always try
        budget = self.max_batch_tokens
        while not self.swapped and waiting and len(running) < self.max_batch and budget > 0:
            s = waiting[0]
            n = s.num_tokens
            if call("can_allocate", n) == AllocStatus.NEVER:
                waiting.popleft()
                self._reject(s)
                continue
            # LATER only means "not with the watermark kept free": allocate counts prefix hits
            # and ignores the watermark, so try it (vLLM v1 admits the same way).
            if m.num_available_blocks <= self.blocked_at:
                break  # it did not fit last time and nothing was released since
            hit = call("allocate", s.seq_id, s.all_tokens(), cache_salt=s.request.cache_salt)
            if hit is None:
                self.blocked_at = m.num_available_blocks
                break
            self.blocked_at = -1
            waiting.popleft()
            res.prompt_tokens += n
            res.prefix_hit_tokens += hit
            budget -= n - hit
            running.append(s)
            if not s.forked:
                s.forked = True
                for _ in range(s.request.sequences - 1):
                    self._fork(s)

    def _prune_beams(self) -> None:
        groups: dict[int, list[_Seq]] = {}
        for s in self.running:
            if s.request.beam_width > 1:
                groups.setdefault(s.request.request_id, []).append(s)
        rng = self.rng
        for members in groups.values():
            if len(members) < 2 or rng.random() >= BEAM_PRUNE_PROBABILITY:
                continue
            victim = members.pop(rng.randrange(len(members)))
            self.call("free", victim.seq_id)
            self.running.remove(victim)
            self.res.pruned_sequences += 1
            self._end(victim)
            self._fork(members[rng.randrange(len(members))])

    def _decode(self) -> bool:
        """One token for every running sequence; False when nothing could run."""
        running, res = self.running, self.res
        ids = np.fromiter((s.seq_id for s in running), dtype=np.uint64, count=len(running))
        pos = np.fromiter((s.num_tokens for s in running), dtype=np.uint64, count=len(running))
        toks = decode_tokens(ids, pos)
        ids = ids.astype(np.int64)
        while True:
            pairs = self.call("append_batch", ids, toks)
            if pairs is not None:
                break
            victim = running.pop()
            ids, toks = ids[:-1], toks[:-1]
            if not running:
                # Even alone with the whole pool it cannot grow: give up on it.
                self.call("free", victim.seq_id)
                self._reject(victim)
                return False
            self._preempt(victim)
        res.copy_pairs += len(pairs)
        res.decode_tokens += len(running)
        return True

    def _retire(self) -> float:
        """Count the new tokens, free the finished sequences; returns the fragmentation."""
        bs = self.m.block_size
        used = reserved = 0
        done: list[_Seq] = []
        still: list[_Seq] = []
        for s in self.running:
            s.generated += 1
            n = s.num_tokens
            used += n
            reserved += -(-n // bs) * bs
            if s.generated >= s.request.max_new_tokens:
                done.append(s)
            else:
                still.append(s)
        if done:
            self.call("free_batch", np.fromiter((s.seq_id for s in done), dtype=np.int64))
            self.res.finished_sequences += len(done)
            for s in done:
                self._end(s)
        self.running = still
        return 1.0 - used / reserved if reserved else 0.0

    # ------------------------------------------------------------------ the loop

    def run(self) -> SimResult:
        t_start = time.perf_counter()
        m, res, call, series = self.m, self.res, self.call, self.res.series
        num_blocks = m.num_blocks
        while self.arrivals or self.waiting or self.swapped or self.running:
            self._arrive()
            res.steps += 1
            ns0 = call.ns
            self._swap_in()
            self._admit()
            if not self.running:
                if self.waiting or self.swapped:
                    # Nothing runs and nothing could be admitted: only possible if the head of
                    # the queue can never be served; the checks above make this unreachable.
                    raise RuntimeError("scheduler made no progress")
            else:
                self._prune_beams()
                if not self._decode():
                    self.running = []
            cached = m.num_cached_blocks
            series.usage.append((num_blocks - m.num_free_blocks - cached) / num_blocks)
            series.cached_blocks.append(cached)
            series.running.append(len(self.running))
            series.waiting.append(len(self.waiting))
            series.swapped.append(len(self.swapped))
            series.fragmentation.append(self._retire())
            series.hit_rate.append(res.hit_rate)
            series.manager_ns.append(call.ns - ns0)
            series.step.append(self.clock)
            if self.check:
                m.check_invariants()
            if self.progress is not None:
                self.progress(res.finished_requests, res.requests)
            self.clock += 1
        res.clock_steps = self.clock
        res.manager_ns = call.ns
        res.manager_calls = call.calls
        res.trace = call.trace
        res.results = call.results
        res.final_stats = m.stats()
        res.wall_s = time.perf_counter() - t_start
        return res


def run_workload(
    manager: ManagerLike,
    workload: Workload,
    *,
    max_batch: int = 256,
    max_batch_tokens: int = 8192,
    record: bool = False,
    check: bool = False,
    progress: Callable[[int, int], None] | None = None,
) -> SimResult:
    """Replay `workload` through `manager` (see the module docstring for one step).

    `max_batch`: running sequences at most; `max_batch_tokens`: prompt tokens computed per step
    (the first admission of a step always goes ahead, however long its prompt); `record`: keep
    every call and answer in the result; `check`: `check_invariants()` after every step;
    `progress(finished_requests, requests)` is called after every step.
    """
    if max_batch < 1:
        raise ValueError("max_batch must be >= 1")
    if max_batch_tokens < 1:
        raise ValueError("max_batch_tokens must be >= 1")
    return _Scheduler(
        manager,
        workload,
        max_batch=max_batch,
        max_batch_tokens=max_batch_tokens,
        record=record,
        check=check,
        progress=progress,
    ).run()


__all__ = ["ManagerLike", "SimResult", "StepSeries", "run_workload"]
