"""One program of requests run through vLLM 0.33's scheduler with vLLM's own KV-cache
manager and with pagedkv's, and the schedule each produced, step by step (tests/vllm).

A program is the requests (arrival step, id, prompt, output length) and the model's answers:
for speculative decoding, each decoding request's drafts and how many of them are accepted,
drawn from a generator seeded by the program, so both runs see the same answers for the same
schedule. The schedule of a step is what it scheduled per request (tokens and drafts), whom it
preempted, the free blocks after the step and the requests finished by then.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.request import Request

from vllm_scheduler import build_scheduler, give_drafts, run_step

init_none_hash(sha256)


@dataclass(frozen=True)
class Arrival:
    step: int
    rid: str
    prompt: tuple[int, ...]
    max_tokens: int


@dataclass
class Program:
    """Requests and the scheduler's configuration (`build_scheduler`'s keywords)."""

    arrivals: list[Arrival]
    steps: int
    config: dict[str, Any] = field(default_factory=dict)
    num_drafts: int = 0  # drafts proposed per decoding request and step
    seed: int = 0


@dataclass(frozen=True)
class Step:
    scheduled: tuple[tuple[str, int, int], ...]  # (request, tokens, drafts)
    preempted: tuple[str, ...]
    free_blocks: int
    finished: tuple[str, ...]


def run(which: str, program: Program, *, built: list[Any] | None = None) -> list[Step]:
    """The schedule of `program` under `which` ("vllm" or "pagedkv"); the scheduler is
    appended to `built` when given (to read its manager afterwards)."""
    bs = program.config.get("block_size", 16)
    scheduler = build_scheduler(which, **program.config)
    if built is not None:
        built.append(scheduler)
    hasher = get_request_block_hasher(bs, sha256)
    rng = random.Random(program.seed)
    finished: set[str] = set()
    trace = []
    for i in range(program.steps):
        for a in program.arrivals:
            if a.step == i:
                scheduler.add_request(
                    Request(
                        request_id=a.rid,
                        prompt_token_ids=list(a.prompt),
                        sampling_params=SamplingParams(max_tokens=a.max_tokens, ignore_eos=True),
                        pooling_params=None,
                        block_hasher=hasher,
                    )
                )
        # The answers depend only on the generator and on what was scheduled, so two runs
        # that scheduled the same get the same answers.
        accepted = {r: rng.randint(0, program.num_drafts) for r in sorted(scheduler.requests)}
        out, _ = run_step(scheduler, 7 + i % 5, accepted=accepted)
        if program.num_drafts:
            drafts = {
                r.request_id: [3 + (j + i) % 4 for j in range(program.num_drafts)]
                for r in scheduler.running
                if r.num_computed_tokens >= r.num_prompt_tokens
            }
            give_drafts(scheduler, drafts)
        finished |= {a.rid for a in program.arrivals if a.step <= i} - set(scheduler.requests)
        spec = out.scheduled_spec_decode_tokens
        trace.append(
            Step(
                scheduled=tuple(
                    sorted(
                        (r, n, len(spec.get(r, ()))) for r, n in out.num_scheduled_tokens.items()
                    )
                ),
                preempted=tuple(sorted(out.preempted_req_ids or ())),
                free_blocks=scheduler.kv_cache_manager.block_pool.get_num_free_blocks(),
                finished=tuple(sorted(finished)),
            )
        )
    return trace


def run_async(which: str, program: Program) -> list[tuple[Any, ...]]:
    """`program` under vLLM's asynchronous scheduler: each step is scheduled before the
    previous step's output is processed (one step in flight). Prompts must fit one step
    (each scheduled request samples one token). Records, per step, what it scheduled and the
    free blocks after the schedule and after the update."""
    from vllm_runner_output import runner_output

    bs = program.config.get("block_size", 16)
    scheduler = build_scheduler(which, async_scheduling=True, **program.config)
    hasher = get_request_block_hasher(bs, sha256)
    pool = scheduler.kv_cache_manager.block_pool
    trace: list[tuple[Any, ...]] = []
    pending = None
    for i in range(program.steps):
        for a in program.arrivals:
            if a.step == i:
                scheduler.add_request(
                    Request(
                        request_id=a.rid,
                        prompt_token_ids=list(a.prompt),
                        sampling_params=SamplingParams(max_tokens=a.max_tokens, ignore_eos=True),
                        pooling_params=None,
                        block_hasher=hasher,
                    )
                )
        out = scheduler.schedule()
        scheduled = tuple(sorted(out.num_scheduled_tokens.items()))
        after_schedule = pool.get_num_free_blocks()
        if pending is not None:
            ids = list(pending.num_scheduled_tokens)
            output = runner_output(ids, [[7 + i % 5] for _ in ids])
            scheduler.update_from_output(pending, output)
        pending = out
        trace.append((i, scheduled, after_schedule, pool.get_num_free_blocks()))
    return trace


def first_difference(theirs: list[Step], ours: list[Step]) -> str | None:
    """Where two schedules first differ, in words (None when they are the same)."""
    for i, (a, b) in enumerate(zip(theirs, ours, strict=True)):
        if a != b:
            return f"step {i}: vLLM {a}, pagedkv {b}"
    return None


def finished_at(trace: list[Step], rid: str) -> int | None:
    """The step by which `rid` had finished (None: it never did)."""
    return next((i for i, s in enumerate(trace) if rid in s.finished), None)


__all__ = ["Arrival", "Program", "Step", "finished_at", "first_difference", "run", "run_async"]
