"""A small continuous-batching scheduler that drives any block manager, step by step.

Two ways to schedule a step (time advances one step at a time; idle stretches between
arrivals are skipped):

**Chunked prefill** (`max_num_batched_tokens=N`, what the `simulate` command does; vLLM v1's
scheduler): every step has a budget of `N` tokens, prefill and decode alike.

1. arrivals: requests whose arrival step has come join the waiting queue (a later chat turn
   arrives `delay` steps after the turn before it finished, and not before its own arrival
   step: a trace's follow-up waits for its parent only when the parent ends late);
2. swap in preempted sequences, oldest first, when room returns;
3. beam search: in each beam group, now and then prune a beam (free) and fork a survivor;
4. running sequences first: every sequence whose prompt was fully scheduled before this step
   decodes one token (`append_batch`), taking one token of the budget, `1 + k` with
   speculative decoding (`lookahead=k` reserves the slots of `k` draft tokens); when the
   blocks run out, preempt the newest running sequence (swap out when CPU blocks exist, else
   free it and recompute it later) and retry;
5. then the partially prefilled sequences continue, in admission order: `extend(seq, chunk)`
   with `chunk` = what is left of the budget (at most the rest of the prompt, and at most
   `long_prefill_token_threshold` when set, so that several prompts prefill side by side); out
   of blocks, preempt the newest sequence not yet scheduled in this step (itself if none);
6. then, if nothing was preempted in this step, admit waiting requests (FIFO) while the budget
   lasts: `can_allocate(prompt_token_ids, num_new_tokens=chunk, cache_salt=...)` (hit-aware;
   LATER waits while anything runs), then `allocate(seq, prompt, num_new_tokens=chunk)`,
   whose answer (the hit tokens) says how much of the prompt came from the prefix cache: the
   budget pays for the `min(chunk, prompt - hit)` tokens computed. A request whose prompt is
   not fully scheduled does not decode yet; when it is, its samples or beams are forked and it
   decodes from the next step on;
7. aborts (`abort_rate`): each request with a running sequence is aborted with that
   probability; the abort comes after scheduling but before the step ran, so each sequence is
   freed with `free(seq, num_computed_tokens=c)`, `c` = its tokens scheduled before this step
   (the manager retracts the blocks only this step would have computed);
8. the step runs; speculative decoding: each speculating sequence accepts each of its `k`
   drafts with probability `spec_acceptance`, stopping at the first rejection; the `a`
   accepted ones are appended (`append(seq, accepted)`: their KV is already in the lookahead
   slots) and `truncate(seq, num_tokens)` gives back the blocks only rejected drafts used;
9. `free_batch` the finished sequences.

**Whole prompts** (`max_num_batched_tokens=None`, the original scheduler, kept as it was):
admission (step 6) comes before the decode and allocates the whole prompt at once, under a
budget of `max_batch_tokens` prompt tokens computed per step (prefix hits free, decodes not
counted, the first admission of a step always goes ahead); `can_allocate` gets the token
count; every running sequence, the newly admitted included, decodes in the same step.
Speculative decoding and aborts work the same way in both.

A sequence preempted in the step it was scheduled in (possible only with whole prompts) is
freed with `num_computed_tokens` too, and recomputed rather than swapped.

Every manager call is timed (`calls.TimedCalls`); per step the usage, cached blocks, queue
lengths, running hit rate, internal fragmentation, tokens scheduled and manager time are
recorded. `check=True` runs `check_invariants()` after every step and keeps an independent
record of the block contents scheduled (`record.ScheduleRecord`): a prefix hit on a block
whose tokens were never scheduled (or were retracted by an abort) raises
`record.UnscheduledHitError`. `watch` (an `observer.ScheduleObserver`, such as
`mrc.MRCRecorder`) is told the same story: what was allocated, scheduled, appended, forked,
swapped and freed.

This loop is the reference. For the options in its scope (chunked prefill without beams,
speculation, aborts, tiers or Python callbacks; docs/scheduling-loop.md) the same loop runs in
Rust (`sim.rust_loop`), making the same manager calls; `run_workload(loop=...)` picks.
"""

from __future__ import annotations

import heapq
import random
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import numpy.typing as npt

from pagedkv.alloc_status import AllocStatus
from pagedkv.sim.calls import Call, TimedCalls
from pagedkv.sim.observer import ScheduleObserver
from pagedkv.sim.record import ScheduleRecord
from pagedkv.sim.requests import VOCAB_SIZE, Request, Workload, generated_tokens
from pagedkv.stats import Stats

if TYPE_CHECKING:
    from pagedkv.sim.tier_run import TierDriver

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
    @property
    def num_groups(self) -> int: ...
    def allocate(
        self,
        seq_id: int,
        token_ids: Any,
        *,
        num_new_tokens: int | None = None,
        cache_salt: str | bytes | None = None,
        lora_id: int | None = None,
        lookahead: int = 0,
    ) -> int | None: ...
    def extend(
        self, seq_id: int, num_new_tokens: int, *, lookahead: int = 0
    ) -> list[tuple[int, int]] | None: ...
    def append(
        self, seq_id: int, token_ids: Any, *, lookahead: int = 0
    ) -> list[tuple[int, int]] | None: ...
    def append_batch(self, seq_ids: Any, token_ids: Any, *, lookahead: int = 0) -> Any: ...
    def truncate(self, seq_id: int, num_tokens: int) -> list[tuple[int, int]] | None: ...
    def fork(self, parent_id: int, child_id: int) -> None: ...
    def free(self, seq_id: int, *, num_computed_tokens: int | None = None) -> None: ...
    def free_batch(self, seq_ids: Any) -> None: ...
    def swap_out(self, seq_id: int) -> list[tuple[int, int]] | None: ...
    def swap_in(self, seq_id: int) -> list[tuple[int, int]] | None: ...
    def can_allocate(
        self,
        num_tokens: Any,
        *,
        num_new_tokens: int | None = None,
        cache_salt: str | bytes | None = None,
        lora_id: int | None = None,
    ) -> AllocStatus: ...
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
    hit_rate: list[float] = field(default_factory=list)  # workload hits so far / its prompt tokens
    fragmentation: list[float] = field(default_factory=list)  # unused slots of held blocks
    manager_ns: list[int] = field(default_factory=list)  # time inside manager calls
    scheduled_tokens: list[int] = field(default_factory=list)  # computed this step, drafts too
    live_tokens: list[int] = field(default_factory=list)  # tokens the running sequences hold
    preemptions: list[int] = field(default_factory=list)  # sequences preempted in the step

    def as_dict(self) -> dict[str, list[int] | list[float]]:
        return {name: getattr(self, name) for name in self.__slots__}


@dataclass(slots=True)
class SimResult:
    """What happened in one replay."""

    requests: int = 0
    finished_requests: int = 0  # ended in any way: finished, rejected or aborted
    rejected_requests: int = 0  # can never fit the pool
    aborted_requests: int = 0
    steps: int = 0  # steps executed
    clock_steps: int = 0  # simulated time, idle stretches included
    finished_sequences: int = 0
    rejected_sequences: int = 0
    aborted_sequences: int = 0
    pruned_sequences: int = 0  # beams freed by pruning
    forks: int = 0
    preempted_recompute: int = 0
    preempted_swap: int = 0
    swap_ins: int = 0
    prompt_tokens: int = 0  # tokens passed to allocate (recomputes included)
    prefix_hit_tokens: int = 0  # of those, served from the prefix cache
    recomputed_tokens: int = 0  # of prompt_tokens, allocated again after a preemption
    recomputed_hit_tokens: int = 0  # of prefix_hit_tokens, hits of those re-allocations
    decode_tokens: int = 0  # tokens appended (accepted drafts included)
    output_tokens: int = 0  # tokens generated by the sequences that finished (their outputs)
    copy_pairs: int = 0  # copy-on-write pairs returned by append_batch, append and extend
    copied_forks: int = 0  # forks made by copying (`fork_copies`), not by sharing
    copied_fork_tokens: int = 0  # tokens those copies allocated blocks for
    max_num_batched_tokens: int | None = None  # the per-step budget; None: whole prompts
    long_prefill_token_threshold: int = 0  # prompt tokens per request and step (0: no cap)
    prefill_chunks: int = 0  # allocate and extend calls that scheduled prompt tokens
    extend_calls: int = 0
    chunked_prompts: int = 0  # prompts whose prefill took more than one step
    scheduled_tokens: int = 0  # tokens computed over all steps (prompt, decode, drafts)
    spec_tokens: int = 0  # drafts per speculating sequence and step (0: no speculation)
    spec_acceptance: float = 0.0  # probability each draft is accepted
    decode_steps: int = 0  # (sequence, step) pairs that decoded
    draft_tokens: int = 0  # drafts proposed (lookahead slots reserved)
    accepted_drafts: int = 0  # drafts accepted (before the cap at max_new_tokens)
    truncate_calls: int = 0
    abort_rate: float = 0.0
    manager_calls: int = 0
    manager_ns: int = 0  # time spent inside manager calls
    wall_s: float = 0.0
    stopped_early: bool = False  # `until` ended the run before every request finished
    loop: str = "python"  # the scheduling loop that ran it: "python" or "rust" (`sim.rust_loop`)
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
    def workload_prompt_tokens(self) -> int:
        """Prompt tokens of the workload's own admissions (recomputes left out)."""
        return self.prompt_tokens - self.recomputed_tokens

    @property
    def workload_hit_rate(self) -> float:
        """The hit rate over the workload's own admissions (recomputes left out)."""
        hits = self.prefix_hit_tokens - self.recomputed_hit_tokens
        return hits / self.workload_prompt_tokens if self.workload_prompt_tokens else 0.0

    @property
    def preemptions(self) -> int:
        return self.preempted_recompute + self.preempted_swap

    @property
    def acceptance_rate(self) -> float:
        """Accepted drafts over proposed drafts."""
        return self.accepted_drafts / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def tokens_per_step(self) -> float:
        """Tokens a decoding sequence gains per step (1 without speculation)."""
        return self.decode_tokens / self.decode_steps if self.decode_steps else 0.0

    def summary(self) -> str:
        """A few lines of plain text (the command prints `report.summary_table` instead)."""
        return "\n".join(
            [
                f"steps       {self.steps}; sequences finished {self.finished_sequences}, "
                f"rejected {self.rejected_sequences}, aborted {self.aborted_sequences}; "
                f"forks {self.forks}",
                f"preemptions {self.preempted_recompute} recompute, {self.preempted_swap} swap",
                f"tokens      {self.prompt_tokens} prompt + {self.decode_tokens} decode = "
                f"{self.tokens}; copy-on-write pairs {self.copy_pairs}",
                f"time        wall {self.wall_s:.3f} s; inside {self.manager_calls} manager "
                f"calls {self.manager_ns / 1e9:.3f} s = {self.ns_per_token:.1f} ns/token",
            ]
        )


@dataclass(slots=True, eq=False)  # compared by identity: `in running` is a hot path
class _Seq:
    seq_id: int
    request: Request
    generated: int = 0  # tokens appended so far (the manager holds prompt + these)
    forked: bool = False  # samples and beams are forked at the first admission only
    # Who generated which tokens: (owner seq id, first position), so that a forked sequence
    # recomputed after preemption gets back exactly the tokens it held.
    segments: tuple[tuple[int, int], ...] = ()
    scheduled: int = 0  # tokens scheduled in the manager (its num_scheduled_tokens)
    computed: int = 0  # of those, the ones whose step ran (scheduled = computed between steps)
    chunks: int = 0  # scheduling calls of the current prefill
    admitted: bool = False  # allocated (or forked) before: another allocation recomputes
    copy_salt: str | None = None  # a fork made by copying: its blocks share with no one

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

    def token_range(self, start: int, stop: int) -> npt.NDArray[np.uint32]:
        """Tokens `start..stop` of `all_tokens()`, without building the rest."""
        prompt = self.request.prompt
        plen = len(prompt)
        if stop <= plen:
            return prompt[start:stop]
        parts = [prompt[start:plen]] if start < plen else []
        segs = self.segments
        for i, (owner, first) in enumerate(segs):
            last = segs[i + 1][1] if i + 1 < len(segs) else stop
            a, b = max(first, start), min(last, stop)
            if b > a:
                parts.append(generated_tokens(owner, a, b))
        return np.concatenate(parts) if parts else prompt[:0]


class _Scheduler:
    # False asks the hit-aware `can_allocate` even when the answer is sure (tests compare).
    skip_sure_checks = True

    def __init__(
        self,
        manager: ManagerLike,
        workload: Workload,
        *,
        max_batch: int,
        max_batch_tokens: int,
        max_num_batched_tokens: int | None,
        long_prefill_token_threshold: int,
        spec_tokens: int,
        spec_acceptance: float,
        abort_rate: float,
        record: bool,
        check: bool,
        progress: Callable[[int, int], None] | None,
        observe: Callable[[], None] | None = None,
        watch: ScheduleObserver | None = None,
        tiers: TierDriver | None = None,
        fork_copies: bool = False,
        after_step: Callable[[int, list[int]], None] | None = None,
        until: Callable[[SimResult], bool] | None = None,
        before_step: Callable[[int], None] | None = None,
    ) -> None:
        self.m = manager
        self.fork_copies = fork_copies
        self.after_step = after_step
        self.before_step = before_step
        self.until = until
        self.tiers = tiers
        self.observe = observe
        # With tiers, block-taking calls go through them: each demotes what it evicted.
        self.call = TimedCalls(manager if tiers is None else tiers.target(), record)
        self.res = SimResult(
            requests=len(workload.requests),
            max_num_batched_tokens=max_num_batched_tokens,
            long_prefill_token_threshold=long_prefill_token_threshold,
            spec_tokens=spec_tokens,
            spec_acceptance=spec_acceptance,
            abort_rate=abort_rate,
        )
        self.max_batch = max_batch
        self.max_batch_tokens = max_batch_tokens
        self.budget_per_step = max_num_batched_tokens
        self.chunked = max_num_batched_tokens is not None
        self.chunk_cap = long_prefill_token_threshold or (1 << 62)  # per prompt and step
        self.spec_tokens = spec_tokens
        self.spec_acceptance = spec_acceptance
        self.abort_rate = abort_rate
        self.check = check
        self.record = ScheduleRecord(manager.block_size) if check else None
        # Everyone told what is scheduled: the --check record and the caller's watch.
        self.observers: tuple[ScheduleObserver, ...] = tuple(
            o for o in (self.record, watch) if o is not None
        )
        self.progress = progress
        self.use_swap = manager.stats().num_cpu_blocks > 0
        self.rng = random.Random(workload.seed)
        # Separate streams, so that turning speculation or aborts on changes nothing else.
        self.spec_rng = random.Random(f"spec-{workload.seed}")
        self.abort_rng = random.Random(f"abort-{workload.seed}")
        self.by_id = {r.request_id: r for r in workload.requests}
        # No beam in the workload: `_prune_beams` has nothing to do (and draws nothing).
        self.has_beams = any(r.beam_width > 1 for r in workload.requests)
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
        # (available blocks, chunk) when the queue's head last failed to allocate
        self.blocked_at: tuple[int, int] = (-1, 0)
        self.one_group = manager.num_groups == 1
        self.budget = 0  # tokens left in this step's budget (chunked prefill)
        self.preempted = False  # a preemption in this step: admit nothing more
        self.speculating: list[_Seq] = []  # this step's speculating sequences
        self.lookahead = 0  # and their drafts each
        self.scheduled: int | None = None  # tokens the tiers' last allocate scheduled
        self.ended: list[int] | None = None  # `SteppedScheduler`: requests ended, in order

    # ------------------------------------------------------------------ bookkeeping

    def _end(self, s: _Seq) -> None:
        """A sequence ended (finished, pruned, rejected or aborted); maybe its request too."""
        rid = s.request.request_id
        self.live[rid] -= 1
        if self.live[rid]:
            return
        del self.live[rid]
        self.res.finished_requests += 1
        if self.ended is not None:
            self.ended.append(rid)
        for d in self.dependents.pop(rid, ()):
            # A trace's follow-up keeps its logged arrival unless its parent ends later.
            at = max(self.clock + 1 + d.delay, d.arrival_step)
            heapq.heappush(self.arrivals, (at, d.request_id))

    def _reject(self, s: _Seq) -> None:
        res = self.res
        if not s.forked:  # its samples or beams will never exist either
            res.rejected_sequences += s.request.sequences
            res.rejected_requests += 1
        else:
            res.rejected_sequences += 1
        self._end(s)

    def _free(self, s: _Seq, *, always_pass_computed: bool = False) -> None:
        """Free a resident sequence; the tokens scheduled in this step were never computed."""
        if always_pass_computed or s.computed < s.scheduled:
            self.call("free", s.seq_id, num_computed_tokens=s.computed)
        else:
            self.call("free", s.seq_id)
        for o in self.observers:
            o.free(s.seq_id)

    def _fork(self, parent: _Seq) -> None:
        child = _Seq(
            self.next_id,
            parent.request,
            parent.generated,
            True,
            (*parent.segments, (self.next_id, parent.num_tokens)),
            parent.scheduled,
            parent.computed,
        )
        child.admitted = True
        self.next_id += 1
        self.res.forks += 1
        self.live[parent.request.request_id] += 1
        if self.fork_copies:
            self._copy_fork(parent, child)
            return
        self.call("fork", parent.seq_id, child.seq_id)
        for o in self.observers:
            o.fork(parent.seq_id, child.seq_id)
        self.running.append(child)

    def _copy_fork(self, parent: _Seq, child: _Seq) -> None:
        """Fork sharing off (an ablation): the child gets blocks of its own holding a copy of
        the parent's tokens. A salt of its own keeps the prefix cache from sharing them back;
        when they do not fit, the child waits at the head of the queue (recomputed there)."""
        salt = f"{parent.request.cache_salt or ''}#copy-{child.seq_id}"
        child.copy_salt = salt
        tokens = child.token_range(0, parent.scheduled)
        hit = self.call("allocate", child.seq_id, tokens, cache_salt=salt)
        if hit is None:
            child.scheduled = child.computed = 0
            self.waiting.appendleft(child)
            return
        for o in self.observers:
            o.allocate(child.seq_id, tokens, hit, child.scheduled, cache_salt=salt)
        self.res.copied_forks += 1
        self.res.copied_fork_tokens += len(tokens)
        self.running.append(child)

    def _prefilled(self, s: _Seq) -> None:
        """Its prompt is fully scheduled: fork its samples or beams (first admission only)."""
        if s.chunks > 1:
            self.res.chunked_prompts += 1
        s.chunks = 0
        if not s.forked:
            s.forked = True
            for _ in range(s.request.sequences - 1):
                self._fork(s)

    def _preempt(self, victim: _Seq) -> None:
        self.preempted = True
        # A sequence scheduled in this step is never swapped out: its blocks registered in
        # this step would stay cached without their KV. Free it and recompute it instead.
        if (
            self.use_swap
            and victim.computed == victim.scheduled
            and (pairs := self.call("swap_out", victim.seq_id)) is not None
        ):
            if self.tiers is not None:
                self.tiers.swapped(pairs, out=True)
            self.res.preempted_swap += 1
            self.swapped.append(victim)
            for o in self.observers:
                o.swap_out(victim.seq_id)
            return
        self._free(victim)
        victim.scheduled = victim.computed = victim.chunks = 0
        self.res.preempted_recompute += 1
        self.waiting.appendleft(victim)

    # ------------------------------------------------------------------ the phases of a step

    def _arrive(self) -> None:
        if not (self.waiting or self.swapped or self.running):
            self.clock = max(self.clock, self.arrivals[0][0])  # skip the idle stretch
        while self.arrivals and self.arrivals[0][0] <= self.clock:
            _, rid = heapq.heappop(self.arrivals)
            self._join(self.by_id[rid])

    def _join(self, r: Request) -> None:
        """Request `r` arrives: it waits."""
        self.waiting.append(_Seq(r.request_id, r, segments=((r.request_id, r.prompt_len),)))
        self.live[r.request_id] = 1

    def _swap_in(self) -> None:
        call, swapped, running = self.call, self.swapped, self.running
        while swapped and len(running) < self.max_batch:
            s = swapped[0]
            status = call("can_swap_in", s.seq_id)
            # LATER: wait for running sequences to finish. NEVER (it grew into the watermark)
            # and nothing else running: swap_in itself ignores the watermark, so try it.
            if status == AllocStatus.LATER or (status == AllocStatus.NEVER and running):
                break
            pairs = call("swap_in", s.seq_id)
            if pairs is None:
                break
            if self.tiers is not None:
                self.tiers.swapped(pairs, out=False)
            swapped.popleft()
            running.append(s)
            self.res.swap_ins += 1
            for o in self.observers:
                o.swap_in(s.seq_id)

    def _admit(self) -> None:
        call, m, res, waiting, running = self.call, self.m, self.res, self.waiting, self.running
        if not running:
            self.blocked_at = (-1, 0)  # the whole pool is available: always try
        chunked = self.chunked
        budget = self.budget if chunked else self.max_batch_tokens
        while not self.swapped and waiting and len(running) < self.max_batch and budget > 0:
            if chunked and self.preempted and running:
                break  # vLLM v1 admits nothing in a step that preempted
            s = waiting[0]
            n = s.num_tokens
            fits = call("can_allocate", n)
            if fits == AllocStatus.NEVER:
                waiting.popleft()
                self._reject(s)
                continue
            chunk = min(budget, n, self.chunk_cap) if chunked else n
            available = m.num_available_blocks
            if available <= self.blocked_at[0] and chunk >= self.blocked_at[1]:
                break  # it did not fit last time and nothing was released since
            tokens = s.all_tokens()
            salt = s.request.cache_salt if s.copy_salt is None else s.copy_salt
            if chunked:
                # Hit-aware: a prompt whose prefix is cached needs fewer new blocks. LATER
                # keeps the watermark free while other sequences run (as vLLM v0 did).
                # Asked only when the answer could be other than OK: with one group, a prompt
                # that fits whole beside the watermark with no hit (`fits`) fits with any hit
                # (a hit never needs more blocks than the whole prompt), so hashing it twice
                # would only cost time (a few percent of a long trace's replay).
                if not (fits == AllocStatus.OK and self.one_group and self.skip_sure_checks):
                    status = call("can_allocate", tokens, num_new_tokens=chunk, cache_salt=salt)
                    if status != AllocStatus.OK and running:
                        break
                hit = self._allocate(s.seq_id, tokens, chunk, salt)
            else:
                # LATER only means "not with the watermark kept free": allocate counts prefix
                # hits and ignores the watermark, so try it (vLLM v1 admits the same way).
                hit = self._allocate(s.seq_id, tokens, None, salt)
            if hit is None:
                self.blocked_at = (available, chunk if chunked else 0)
                break
            self.blocked_at = (-1, 0)
            waiting.popleft()
            # Tiers schedule the blocks they load too (and recompute one that fails to load).
            scheduled = hit + min(chunk, n - hit) if self.scheduled is None else self.scheduled
            computed = scheduled - hit
            s.scheduled = scheduled
            s.computed = hit
            s.chunks = 1
            for o in self.observers:
                o.allocate(s.seq_id, tokens, hit, s.scheduled, cache_salt=salt)
            res.prompt_tokens += n
            res.prefix_hit_tokens += hit
            if s.admitted:
                res.recomputed_tokens += n
                res.recomputed_hit_tokens += hit
            s.admitted = True
            res.prefill_chunks += 1
            res.scheduled_tokens += computed
            budget -= computed
            running.append(s)
            if s.scheduled == n:
                self._prefilled(s)
        if chunked:
            self.budget = budget

    def _allocate(
        self, seq_id: int, tokens: npt.NDArray[np.uint32], chunk: int | None, salt: Any
    ) -> int | None:
        """`allocate` (through the tiers if any): the prefix hit, or None."""
        self.scheduled = None
        if self.tiers is None:
            kw: dict[str, Any] = {} if chunk is None else {"num_new_tokens": chunk}
            out: int | None = self.call("allocate", seq_id, tokens, cache_salt=salt, **kw)
            return out
        got: tuple[int, int] | None = self.call.timed(
            self.tiers.allocate, seq_id, tokens, num_new_tokens=chunk, cache_salt=salt
        )
        if got is None:
            return None
        hit, self.scheduled = got
        return hit

    def _copies(self, pairs: Any) -> None:
        self.res.copy_pairs += len(pairs)
        if self.tiers is not None:
            self.tiers.copy(pairs)

    def _step_runs(self) -> None:
        """The step runs: the tiers' pool gets the KV of every token scheduled in it."""
        if self.tiers is None or not self.tiers.writes_kv:
            return  # no tiers, or tiers that count blocks and move no bytes
        self.tiers.write(
            [
                (s.seq_id, s.computed, s.token_range(s.computed, s.scheduled))
                for s in self.running
                if s.scheduled > s.computed
            ]
        )

    def _prefill(self) -> None:
        """Chunked prefill: the partially prefilled sequences continue, oldest first."""
        call, res, running = self.call, self.res, self.running
        for s in list(running):
            if self.budget <= 0:
                return
            # `num_tokens` inlined: this runs for every sequence at every step.
            n = s.scheduled
            if n >= s.request.prompt_len + s.generated or n > s.computed or s not in running:
                continue  # decoding, scheduled in this step already, or preempted meanwhile
            chunk = min(self.budget, s.num_tokens - s.scheduled, self.chunk_cap)
            while True:
                pairs = call("extend", s.seq_id, chunk)
                if pairs is not None:
                    break
                # Preempt the newest sequence not yet scheduled in this step; itself if none.
                victim = next(
                    (v for v in reversed(running) if v is not s and v.scheduled == v.computed),
                    s,
                )
                running.remove(victim)
                self._preempt(victim)
                if victim is s:
                    break
            if pairs is None:
                continue
            s.scheduled += chunk
            s.chunks += 1
            for o in self.observers:
                o.extend(s.seq_id, chunk)
            self._copies(pairs)
            res.extend_calls += 1
            res.prefill_chunks += 1
            res.scheduled_tokens += chunk
            self.budget -= chunk
            if s.scheduled == s.num_tokens:
                self._prefilled(s)

    def _prune_beams(self) -> None:
        if not self.has_beams:
            return
        groups: dict[int, list[_Seq]] = {}
        for s in self.running:
            if s.request.beam_width > 1 and s.scheduled == s.num_tokens:
                groups.setdefault(s.request.request_id, []).append(s)
        rng = self.rng
        for members in groups.values():
            if len(members) < 2 or rng.random() >= BEAM_PRUNE_PROBABILITY:
                continue
            victim = members.pop(rng.randrange(len(members)))
            self._free(victim)
            self.running.remove(victim)
            self.res.pruned_sequences += 1
            self._end(victim)
            self._fork(members[rng.randrange(len(members))])

    def _decode(self) -> bool:
        """One token (plus drafts) for every fully scheduled sequence; False when nothing
        could run."""
        running, res = self.running, self.res
        # `num_tokens` inlined here and below: this runs for every sequence at every step.
        batch = [s for s in running if s.scheduled == s.request.prompt_len + s.generated]
        k = self.spec_tokens
        if self.chunked and batch:
            # Decodes come first in the budget; speculation shrinks to fit it.
            if len(batch) > self.budget:
                batch, k = batch[: self.budget], 0
            else:
                k = min(k, self.budget // len(batch) - 1)
        self.speculating, self.lookahead = [], 0
        if not batch:
            return True
        # `generated_token` of each, inlined: plain ints are faster than numpy for a batch
        # this small (`decode_tokens` gives the same: only the products' low 32 bits count).
        ids = np.array([s.seq_id for s in batch], dtype=np.int64)
        toks = np.array(
            [
                (
                    ((s.seq_id * 0x9E3779B1) ^ ((s.request.prompt_len + s.generated) * 0x85EBCA77))
                    & 0xFFFFFFFF
                )
                % VOCAB_SIZE
                for s in batch
            ],
            dtype=np.uint32,
        )
        kwargs = {"lookahead": k} if k else {}
        while True:
            pairs = self.call("append_batch", ids, toks, **kwargs)
            if pairs is not None:
                break
            victim = running.pop()
            if victim in batch:
                i = batch.index(victim)
                batch.pop(i)
                ids, toks = np.delete(ids, i), np.delete(toks, i)
            if not running:
                # Even alone with the whole pool it cannot grow: give up on it.
                self._free(victim)
                self._reject(victim)
                return False
            self._preempt(victim)
            if not batch:
                return True
        self._copies(pairs)
        res.decode_tokens += len(batch)
        res.decode_steps += len(batch)
        res.scheduled_tokens += len(batch) * (1 + k)
        if self.chunked:
            self.budget -= len(batch) * (1 + k)
        for s in batch:
            s.generated += 1
            s.scheduled += 1
        if self.observers:
            seq_ids = [s.seq_id for s in batch]
            for o in self.observers:
                o.decode(seq_ids, toks)
        if k:
            self.speculating, self.lookahead = batch, k
            res.draft_tokens += len(batch) * k
        return True

    def _abort(self) -> None:
        """Requests aborted after scheduling, before the step ran (see the module docstring)."""
        rng, rate = self.abort_rng, self.abort_rate
        seen: set[int] = set()
        doomed: set[int] = set()
        for s in self.running:
            rid = s.request.request_id
            if rid not in seen:
                seen.add(rid)
                if rng.random() < rate:
                    doomed.add(rid)
        if not doomed:
            return
        res = self.res
        # Newest first: a request that hit blocks another one registered in this step lets go
        # of them before their registrant does, so the registrant's free retracts them.
        for s in reversed(self.running):
            if s.request.request_id in doomed:
                self._free(s, always_pass_computed=True)
                res.aborted_sequences += 1
                self._end(s)
        for s in self.swapped:
            if s.request.request_id in doomed:
                self.call("free", s.seq_id)
                for o in self.observers:
                    o.free(s.seq_id)
                res.aborted_sequences += 1
                self._end(s)
        for s in self.waiting:
            if s.request.request_id in doomed:
                res.aborted_sequences += 1
                self._end(s)
        self.running = [s for s in self.running if s.request.request_id not in doomed]
        self.swapped = deque(s for s in self.swapped if s.request.request_id not in doomed)
        self.waiting = deque(s for s in self.waiting if s.request.request_id not in doomed)
        self.speculating = [s for s in self.speculating if s.request.request_id not in doomed]
        res.aborted_requests += len(doomed)

    def _verify_drafts(self) -> None:
        """The step ran: accept drafts, append the accepted, truncate the rejected."""
        k, p, rng, res = self.lookahead, self.spec_acceptance, self.spec_rng, self.res
        bs = self.m.block_size
        for s in self.speculating:
            n = s.num_tokens  # the decoded token included
            accepted = 0
            while accepted < k and rng.random() < p:
                accepted += 1
            res.accepted_drafts += accepted
            a = min(accepted, s.request.max_new_tokens - s.generated)
            if a > 0:
                drafts = generated_tokens(s.seq_id, n, n + a)
                pairs = self.call("append", s.seq_id, drafts)
                if pairs is None:  # cannot happen: the slots were reserved
                    a = 0
                else:
                    self._copies(pairs)
                    if self.tiers is not None:  # their KV was computed in the draft slots
                        self.tiers.write([(s.seq_id, n, drafts)])
                    s.generated += a
                    s.scheduled += a
                    s.computed = s.scheduled
                    res.decode_tokens += a
                    for o in self.observers:
                        o.append(s.seq_id, drafts)
            # The table holds the blocks of n + k tokens; keep those of the n + a tokens.
            if -(-(n + k) // bs) > -(-(n + a) // bs):
                # None only if the new last block were hashed and had to be copied with no
                # block left: never here, that block holds this step's decoded token.
                pairs = self.call("truncate", s.seq_id, n + a)
                self._copies(pairs or [])
                res.truncate_calls += 1
        self.speculating = []

    def _retire(self, sums: tuple[int, int, bool] | None = None) -> float:
        """Free the finished sequences; returns the fragmentation. `sums`: the running
        sequences' `(used, reserved, any finished)`, when the caller already summed them."""
        if sums is None:
            sums = self._sums()
        used, reserved, finished = sums
        if finished:
            done: list[_Seq] = []
            still: list[_Seq] = []
            for s in self.running:
                (done if s.generated >= s.request.max_new_tokens else still).append(s)
            if self.tiers is not None and self.tiers.check:
                self.tiers.finished([(s.seq_id, s.token_range(0, s.scheduled)) for s in done])
            self.call("free_batch", np.fromiter((s.seq_id for s in done), dtype=np.int64))
            self.res.finished_sequences += len(done)
            for s in done:
                self.res.output_tokens += s.generated
                for o in self.observers:
                    o.free(s.seq_id)
                self._end(s)
            self.running = still
        return 1.0 - used / reserved if reserved else 0.0

    def _sums(self) -> tuple[int, int, bool]:
        """The running sequences' tokens, their slots in whole blocks, and whether any has
        finished."""
        bs = self.m.block_size
        used = reserved = 0
        finished = False
        for s in self.running:
            n = s.scheduled
            used += n
            reserved += -(-n // bs) * bs
            finished = finished or s.generated >= s.request.max_new_tokens
        return used, reserved, finished

    # ------------------------------------------------------------------ the loop

    def _schedule(self) -> bool:
        """Phases 2-6 of a step; False when nothing runs."""
        self._swap_in()
        if self.chunked:
            assert self.budget_per_step is not None
            self.budget = self.budget_per_step
            self._prune_beams()
            if not self._decode():
                self.running = []
            self._prefill()
            self._admit()
        else:
            self._admit()
            if self.running:
                self._prune_beams()
                if not self._decode():
                    self.running = []
        if not self.running and (self.waiting or self.swapped):
            # Nothing runs and nothing could be admitted: only possible if the head of the
            # queue can never be served; the checks above make this unreachable.
            raise RuntimeError("scheduler made no progress")
        return bool(self.running)

    def run(self) -> SimResult:
        t_start = time.perf_counter()
        while self.arrivals or self.waiting or self.swapped or self.running:
            self._arrive()
            self._step()
            self.clock += 1
            if self.until is not None and self.until(self.res):
                self.res.stopped_early = True
                break
        return self._finish(time.perf_counter() - t_start)

    def _step(self) -> None:
        """One executed step at `self.clock`: phases 2-9 and the per-step samples."""
        m, res, call, series = self.m, self.res, self.call, self.res.series
        record = self.record
        num_blocks = m.num_blocks
        res.steps += 1
        ns0 = call.ns
        tokens0 = res.scheduled_tokens
        preempted0 = res.preemptions
        self.preempted = False
        if self.before_step is not None:
            self.before_step(self.clock)
        if record is not None:
            record.begin_step()
        self._schedule()
        if self.abort_rate > 0:
            self._abort()
        # The step runs: what was scheduled now has its KV.
        self._step_runs()
        if record is not None:
            record.step_ran()
        # The step ran: each sequence's scheduled tokens are computed. The same pass sums what
        # the samples and `_retire` need (one pass over the running sequences, not three).
        bs = m.block_size
        live = reserved = 0
        finished = False
        for s in self.running:
            s.computed = n = s.scheduled
            live += n
            reserved += -(-n // bs) * bs
            finished = finished or s.generated >= s.request.max_new_tokens
        sums: tuple[int, int, bool] | None = (live, reserved, finished)
        if self.speculating:
            self._verify_drafts()
            sums = self._sums()  # accepted drafts added
            live = sums[0]
        cached = m.num_cached_blocks
        series.usage.append((num_blocks - m.num_free_blocks - cached) / num_blocks)
        series.cached_blocks.append(cached)
        series.running.append(len(self.running))
        series.waiting.append(len(self.waiting))
        series.swapped.append(len(self.swapped))
        series.live_tokens.append(live)
        if self.observe is not None:
            self.observe()  # sees the same moment as the samples above
        series.fragmentation.append(self._retire(sums))
        series.hit_rate.append(res.workload_hit_rate)
        series.manager_ns.append(call.ns - ns0)
        series.scheduled_tokens.append(res.scheduled_tokens - tokens0)
        series.preemptions.append(res.preemptions - preempted0)
        series.step.append(self.clock)
        if self.after_step is not None:
            self.after_step(self.clock, [s.seq_id for s in self.running])
        if self.check:
            m.check_invariants()
        if self.progress is not None:
            self.progress(res.finished_requests, res.requests)

    def _finish(self, wall_s: float) -> SimResult:
        res, call = self.res, self.call
        res.clock_steps = self.clock
        res.manager_ns = call.ns
        res.manager_calls = call.calls
        res.trace = call.trace
        res.results = call.results
        res.final_stats = self.m.stats()
        res.wall_s = wall_s
        return res


def run_workload(
    manager: ManagerLike,
    workload: Workload,
    *,
    max_batch: int = 256,
    max_batch_tokens: int = 8192,
    max_num_batched_tokens: int | None = None,
    long_prefill_token_threshold: int = 0,
    spec_tokens: int = 0,
    spec_acceptance: float = 0.7,
    abort_rate: float = 0.0,
    record: bool = False,
    check: bool = False,
    progress: Callable[[int, int], None] | None = None,
    observe: Callable[[], None] | None = None,
    watch: ScheduleObserver | None = None,
    tiers: TierDriver | None = None,
    fork_copies: bool = False,
    after_step: Callable[[int, list[int]], None] | None = None,
    until: Callable[[SimResult], bool] | None = None,
    before_step: Callable[[int], None] | None = None,
    loop: str = "auto",
) -> SimResult:
    """Replay `workload` through `manager` (see the module docstring for one step).

    `max_batch`: running sequences at most. `max_num_batched_tokens`: the per-step token
    budget of chunked prefill (decodes, drafts and prompt chunks alike); None (the default)
    schedules whole prompts with `max_batch_tokens` prompt tokens computed per step (the first
    admission of a step always goes ahead, however long its prompt).
    `long_prefill_token_threshold`: with chunked prefill, at most this many prompt tokens of one
    request per step (0: no cap; vLLM's option of that name), so that several prompts prefill
    side by side. `spec_tokens`: draft
    tokens per decoding sequence and step, each accepted with probability `spec_acceptance`.
    `abort_rate`: per step, the probability that each running request is aborted. `record`:
    keep every call and answer in the result; `check`: `check_invariants()` after every step,
    and no prefix hit on a block whose tokens were not scheduled (`record.UnscheduledHitError`);
    `progress(finished_requests, requests)` is called after every step; `observe()` once per
    executed step when the other per-step figures are sampled (after the decode, before the
    finished sequences leave), outside the timed calls: a caller samples more of the manager
    there (the per-group figures of `sim.model_run`). `watch` is told every allocation,
    scheduled chunk, appended token, fork, swap and free (`observer.ScheduleObserver`; the
    miss-ratio curve of `mrc.MRCRecorder`). Two switches for the ablations (`sim.ablate`):
    `fork_copies` forks by copying (the child allocates blocks of its own for the parent's
    tokens) instead of sharing the parent's blocks; `after_step(clock, resident seq ids)` is
    called at the end of every executed step, outside the timed calls. `until(result so far)`
    is asked after every step; True ends the run there (`stopped_early`; the sizing checks
    stop a run that can no longer pass). `before_step(clock)` is called as each executed step
    starts, outside the timed calls (`sim.why` stamps what it learns with the clock).
    `loop`: "auto" runs the Rust loop (`sim.rust_loop`: the same manager calls, made from
    Rust) when every option is in its scope and this Python loop otherwise; "python" always
    runs this one; "rust" raises ValueError naming the option out of its scope. The result's
    `loop` says which ran.
    """
    if loop not in ("auto", "python", "rust"):
        raise ValueError(f"loop must be 'auto', 'python' or 'rust', got {loop!r}")
    _check_options(
        max_batch=max_batch,
        max_batch_tokens=max_batch_tokens,
        max_num_batched_tokens=max_num_batched_tokens,
        long_prefill_token_threshold=long_prefill_token_threshold,
        spec_tokens=spec_tokens,
        spec_acceptance=spec_acceptance,
        abort_rate=abort_rate,
    )
    if fork_copies and tiers is not None:
        raise ValueError("fork_copies does not run with tiers")
    if loop != "python":
        from pagedkv.sim import rust_loop

        blocker = rust_loop.rust_loop_blocker(
            manager,
            workload,
            max_num_batched_tokens=max_num_batched_tokens,
            spec_tokens=spec_tokens,
            abort_rate=abort_rate,
            check=check,
            tiers=tiers,
            fork_copies=fork_copies,
            observe=observe,
            after_step=after_step,
            before_step=before_step,
            watch=watch,
            until=until,
        )
        if blocker is None:
            assert max_num_batched_tokens is not None
            t0 = time.perf_counter()
            out = rust_loop.run_rust_loop(
                manager,
                workload,
                max_batch=max_batch,
                max_num_batched_tokens=max_num_batched_tokens,
                long_prefill_token_threshold=long_prefill_token_threshold,
                skip_sure_checks=_Scheduler.skip_sure_checks,
                record=record,
                progress=progress,
                watch=watch,
                until=until,
            )
            return _rust_result(out, manager, until, time.perf_counter() - t0, spec_acceptance)
        if loop == "rust":
            raise ValueError(f"the Rust scheduling loop does not run {blocker}")
    return _Scheduler(
        manager,
        workload,
        max_batch=max_batch,
        max_batch_tokens=max_batch_tokens,
        max_num_batched_tokens=max_num_batched_tokens,
        long_prefill_token_threshold=long_prefill_token_threshold,
        spec_tokens=spec_tokens,
        spec_acceptance=spec_acceptance,
        abort_rate=abort_rate,
        record=record,
        check=check,
        progress=progress,
        observe=observe,
        watch=watch,
        tiers=tiers,
        fork_copies=fork_copies,
        after_step=after_step,
        until=until,
        before_step=before_step,
    ).run()


def _rust_result(
    out: dict[str, Any],
    manager: ManagerLike,
    until: Callable[[SimResult], bool] | None,
    wall_s: float,
    spec_acceptance: float,
) -> SimResult:
    """The `SimResult` of a replay on the Rust loop (`rust_loop.run_rust_loop`'s figures)."""
    counters = out["counters"]
    res = SimResult(
        **counters,
        spec_acceptance=spec_acceptance,
        series=StepSeries(**out["series"]),
        loop="rust",
        wall_s=wall_s,
    )
    if out["log"] is not None:
        res.trace = [(name, args, kwargs) for name, args, kwargs, _ in out["log"]]
        res.results = [answer for *_, answer in out["log"]]
    res.final_stats = manager.stats()
    if res.stopped_early and until is not None:
        until(res)  # sets its reason: the rule is a function of the figures it stopped at
    return res


def _check_options(
    *,
    max_batch: int,
    max_batch_tokens: int,
    max_num_batched_tokens: int | None,
    long_prefill_token_threshold: int,
    spec_tokens: int,
    spec_acceptance: float,
    abort_rate: float,
) -> None:
    if max_batch < 1:
        raise ValueError("max_batch must be >= 1")
    if max_batch_tokens < 1:
        raise ValueError("max_batch_tokens must be >= 1")
    if max_num_batched_tokens is not None and max_num_batched_tokens < 1:
        raise ValueError("max_num_batched_tokens must be >= 1")
    if long_prefill_token_threshold < 0:
        raise ValueError("long_prefill_token_threshold must be >= 0")
    if spec_tokens < 0:
        raise ValueError("spec_tokens must be >= 0")
    if not 0.0 <= spec_acceptance <= 1.0:
        raise ValueError("spec_acceptance must be in [0, 1]")
    if not 0.0 <= abort_rate <= 1.0:
        raise ValueError("abort_rate must be in [0, 1]")


class SteppedScheduler:
    """The scheduler of `run_workload`, driven from outside one step at a time: a node of a
    simulated cluster (`sim.cluster`), whose router hands it requests as they arrive.

    `submit(request)` makes a request wait (its `arrival_step` and `after` are the caller's
    business); `step(clock)` runs one step at the caller's clock (phases 2-9 of the module
    docstring, the same code as `run_workload`); `take_ended()` returns the ids of the
    requests that ended since the last call (finished, rejected or aborted), so that the
    caller can release the chat turns that wait on them; `result()` ends the run. The
    options are `run_workload`'s. Forked sequences get ids from `FORK_IDS` up, which no
    request id reaches.
    """

    FORK_IDS = 1 << 40

    def __init__(
        self,
        manager: ManagerLike,
        *,
        seed: int = 0,
        max_batch: int = 256,
        max_batch_tokens: int = 8192,
        max_num_batched_tokens: int | None = None,
        long_prefill_token_threshold: int = 0,
        spec_tokens: int = 0,
        spec_acceptance: float = 0.7,
        abort_rate: float = 0.0,
        check: bool = False,
    ) -> None:
        _check_options(
            max_batch=max_batch,
            max_batch_tokens=max_batch_tokens,
            max_num_batched_tokens=max_num_batched_tokens,
            long_prefill_token_threshold=long_prefill_token_threshold,
            spec_tokens=spec_tokens,
            spec_acceptance=spec_acceptance,
            abort_rate=abort_rate,
        )
        self._s = _Scheduler(
            manager,
            Workload((), seed),
            max_batch=max_batch,
            max_batch_tokens=max_batch_tokens,
            max_num_batched_tokens=max_num_batched_tokens,
            long_prefill_token_threshold=long_prefill_token_threshold,
            spec_tokens=spec_tokens,
            spec_acceptance=spec_acceptance,
            abort_rate=abort_rate,
            record=False,
            check=check,
            progress=None,
        )
        self._s.next_id = self.FORK_IDS
        self._s.ended = []
        self._wall_s = 0.0
        self._last_clock = -1

    def submit(self, request: Request) -> None:
        """`request` arrives now and waits (ValueError for a request id seen before, or one
        at or above `FORK_IDS`)."""
        s, rid = self._s, request.request_id
        if not 0 <= rid < self.FORK_IDS:
            raise ValueError(f"request ids must be in [0, 2**40), got {rid}")
        if rid in s.by_id:
            raise ValueError(f"request {rid} was submitted before")
        s.by_id[rid] = request
        s.has_beams = s.has_beams or request.beam_width > 1
        s.res.requests += 1
        s._join(request)

    @property
    def record(self) -> ScheduleRecord | None:
        """The record of scheduled block contents behind `check=True` (else None)."""
        return self._s.record

    @property
    def busy(self) -> bool:
        """Something waits, runs or is swapped out: the next `step` has work."""
        s = self._s
        return bool(s.waiting or s.swapped or s.running)

    def load(self) -> tuple[int, int]:
        """`(tokens, requests)`: the tokens of every waiting, running and swapped-out
        sequence (prompt plus generated so far) and the requests not yet ended."""
        s = self._s
        tokens = sum(q.num_tokens for part in (s.waiting, s.running, s.swapped) for q in part)
        return tokens, len(s.live)

    def step(self, clock: int) -> None:
        """One step at `clock` (ValueError if not after the last step's clock)."""
        if clock <= self._last_clock:
            raise ValueError(f"clock {clock} is not after the last step's ({self._last_clock})")
        t0 = time.perf_counter()
        self._last_clock = self._s.clock = clock
        self._s._step()
        self._wall_s += time.perf_counter() - t0

    def take_ended(self) -> list[int]:
        """Ids of the requests that ended since the last call, in order."""
        s = self._s
        assert s.ended is not None
        out, s.ended = s.ended, []
        return out

    def result(self) -> SimResult:
        """The figures so far (`clock_steps`: the last step's clock + 1; `wall_s`: time
        spent in `step`)."""
        self._s.clock = self._last_clock + 1
        return self._s._finish(self._wall_s)


__all__ = ["ManagerLike", "SimResult", "StepSeries", "SteppedScheduler", "run_workload"]
