"""Workloads of the kinds the published claims speak of (`simulate --ablate-claims`).

Seeded and deterministic like the built-in ones (`sim.workloads`), each shaped after the
setting a claim names:

- `short`: many short sequences: one of 16 short system prompts (32..96 tokens) plus 4..24
  tokens of its own, 2..16 tokens generated, one arrival per step: requests rarely overlap,
  so a prompt's prefix is found only if the blocks of an earlier, finished request are kept;
- `repetitive`: highly repetitive prompts: one of 2 system prompts of 1,024 tokens plus 8..32
  tokens of its own, 32..128 generated, 4 arrivals per step (many run at once);
- `long-chat`: long conversations: 8..16 turns, each prompt the whole conversation so far plus
  a message of 64..512 tokens, 32..256 tokens generated per turn.

Beam search uses the built-in `beam` workload.
"""

from __future__ import annotations

import random

import numpy as np

from pagedkv.sim.requests import VOCAB_SIZE, Request, Workload, generated_tokens

CLAIM_WORKLOADS = ("short", "repetitive", "long-chat")


def _tokens(rng: np.random.Generator, n: int) -> np.ndarray:
    return rng.integers(0, VOCAB_SIZE, size=n, dtype=np.uint32)


def _prefixed(
    name: str,
    num_requests: int,
    seed: int,
    *,
    prefixes: list[int],
    own: tuple[int, int],
    new: tuple[int, int],
    arrival_rate: float,
) -> Workload:
    rng = random.Random(seed)
    nrng = np.random.default_rng(seed)
    system = [_tokens(nrng, n) for n in prefixes]
    clock = 0.0
    requests = []
    for rid in range(num_requests):
        sp = rng.randrange(len(system))
        prompt = np.concatenate([system[sp], _tokens(nrng, rng.randint(*own))])
        clock += rng.expovariate(arrival_rate)
        requests.append(
            Request(
                request_id=rid,
                prompt_len=len(prompt),
                prompt_tokens=prompt,
                max_new_tokens=rng.randint(*new),
                system_prompt=sp,
                arrival_step=int(clock),
                kind=name,
            )
        )
    return Workload(tuple(requests), seed, tuple(prefixes), name=name)


def _long_chat(num_requests: int, seed: int) -> Workload:
    rng = random.Random(seed)
    nrng = np.random.default_rng(seed)
    system = _tokens(nrng, 600)
    requests: list[Request] = []
    clock = 0.0
    while len(requests) < num_requests:
        clock += rng.expovariate(0.05)
        history = system
        prev: Request | None = None
        for _ in range(min(num_requests - len(requests), rng.randint(8, 16))):
            if prev is not None:
                assert prev.prompt_tokens is not None
                reply = generated_tokens(
                    prev.request_id, prev.prompt_len, prev.prompt_len + prev.max_new_tokens
                )
                history = np.concatenate([prev.prompt_tokens, reply])
            prompt = np.concatenate([history, _tokens(nrng, rng.randint(64, 512))])
            prev = Request(
                request_id=len(requests),
                prompt_len=len(prompt),
                prompt_tokens=prompt,
                max_new_tokens=rng.randint(32, 256),
                arrival_step=int(clock),
                after=None if prev is None else prev.request_id,
                delay=0 if prev is None else rng.randint(5, 60),
                kind="long-chat",
            )
            requests.append(prev)
    return Workload(tuple(requests), seed, (len(system),), name="long-chat")


def build_claim_workload(kind: str, num_requests: int, *, seed: int = 0) -> Workload:
    """One of `CLAIM_WORKLOADS` with `num_requests` requests (chat turns count one each)."""
    if num_requests < 1:
        raise ValueError(f"num_requests must be >= 1, got {num_requests}")
    if kind == "short":
        return _prefixed(
            "short",
            num_requests,
            seed,
            prefixes=[32 + (64 * i) // 15 for i in range(16)],
            own=(4, 24),
            new=(2, 16),
            arrival_rate=1.0,
        )
    if kind == "repetitive":
        return _prefixed(
            "repetitive",
            num_requests,
            seed,
            prefixes=[1024, 1024],
            own=(8, 32),
            new=(32, 128),
            arrival_rate=4.0,
        )
    if kind == "long-chat":
        return _long_chat(num_requests, seed)
    raise ValueError(f"unknown claim workload {kind!r}; choose one of {', '.join(CLAIM_WORKLOADS)}")


__all__ = ["CLAIM_WORKLOADS", "build_claim_workload"]
