"""The built-in workloads: seeded, deterministic, sized to finish in seconds by default.

- `shared-prefix`: prompts that start with one of a few system prompts (Zipf popularity), a
  unique suffix, some tenant-salted (never hit the unsalted copies), a few with parallel samples;
- `chat`: multi-turn conversations; each turn's prompt is the whole conversation so far (system
  prompt, every earlier message and reply, the replies being exactly the tokens the earlier
  turn generated) plus a new message; a turn arrives some steps after the previous one finished;
- `sampling`: parallel sampling, n = 2..8 samples forked from one prompt;
- `beam`: beam search, 2..6 beams forked at admission, pruned and re-forked while decoding
  (copy-on-write of the shared last block, pruned beams freed);
- `long-doc`: a few long documents, each asked several short questions;
- `mixed` (the default): all of the above, interleaved.

Requests arrive by a Poisson process of `arrival_rate` requests per step (0: all at step 0).
`generate_workload` is the original closed-loop shared-prefix workload (kept as it was).
"""

from __future__ import annotations

import random
from collections.abc import Callable

import numpy as np

from pagedkv.sim.requests import VOCAB_SIZE, Request, Workload, generated_tokens

WORKLOADS = ("mixed", "shared-prefix", "chat", "sampling", "beam", "long-doc")

# Share of the requests of each kind in the mixed workload (a chat item makes 4 turns on average,
# so it is drawn a quarter as often as its share of the requests).
_MIX = {"shared-prefix": 0.4, "chat": 0.25, "sampling": 0.1, "beam": 0.05, "long-doc": 0.2}
_ITEM_WEIGHTS = {k: v / (4 if k == "chat" else 1) for k, v in _MIX.items()}


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
    """Build the closed-loop shared-prefix workload (every request arrives at step 0).

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
        prompt = np.asarray(system_prompts[sp] + suffix, dtype=np.uint32)
        requests.append(
            Request(
                request_id=rid,
                prompt_len=len(prompt),
                prompt_tokens=prompt,
                max_new_tokens=rng.randint(*new_tokens),
                num_samples=samples,
                cache_salt=salt,
                system_prompt=sp,
            )
        )
    return Workload(tuple(requests), seed, lengths)


class _Builder:
    """Accumulates requests of several kinds with consecutive ids and Poisson arrivals."""

    def __init__(self, seed: int, arrival_rate: float, doc_tokens: int) -> None:
        self.rng = random.Random(seed)
        self.np_rng = np.random.default_rng(seed)
        self.arrival_rate = arrival_rate
        self.clock = 0.0
        self.requests: list[Request] = []
        self.system = [self.tokens(n) for n in (96, 400, 800, 1500)]
        self.chat_system = [self.tokens(n) for n in (200, 600)]
        doc_lengths = (doc_tokens // 2, doc_tokens * 3 // 4, doc_tokens)
        self.docs = [self.tokens(max(1, n)) for n in doc_lengths for _ in range(2)]

    def tokens(self, n: int) -> np.ndarray:
        return self.np_rng.integers(0, VOCAB_SIZE, size=n, dtype=np.uint32)

    def arrive(self) -> int:
        """The next arrival step of the Poisson process."""
        if self.arrival_rate > 0:
            self.clock += self.rng.expovariate(self.arrival_rate)
        return int(self.clock)

    def add(self, prompt: np.ndarray, new_tokens: int, kind: str, **kw: object) -> Request:
        req = Request(
            request_id=len(self.requests),
            prompt_len=len(prompt),
            prompt_tokens=prompt,
            max_new_tokens=new_tokens,
            kind=kind,
            **kw,  # type: ignore[arg-type]
        )
        self.requests.append(req)
        return req

    def _zipf(self, n: int) -> int:
        return self.rng.choices(range(n), [1.0 / (i + 1) for i in range(n)])[0]

    def shared_prefix(self, budget: int) -> int:
        sp = self._zipf(len(self.system))
        prompt = np.concatenate([self.system[sp], self.tokens(self.rng.randint(8, 384))])
        salt = f"tenant-{self.rng.randrange(2)}" if self.rng.random() < 0.1 else None
        self.add(
            prompt,
            self.rng.randint(4, 160),
            "shared-prefix",
            cache_salt=salt,
            system_prompt=sp,
            arrival_step=self.arrive(),
        )
        return 1

    def chat(self, budget: int) -> int:
        turns = min(budget, self.rng.randint(2, 6))
        sp = self.rng.randrange(len(self.chat_system))
        history = self.chat_system[sp]
        arrival = self.arrive()
        prev: Request | None = None
        for _ in range(turns):
            if prev is not None:
                assert prev.prompt_tokens is not None
                reply = generated_tokens(
                    prev.request_id, prev.prompt_len, prev.prompt_len + prev.max_new_tokens
                )
                history = np.concatenate([prev.prompt_tokens, reply])
            prompt = np.concatenate([history, self.tokens(self.rng.randint(16, 256))])
            prev = self.add(
                prompt,
                self.rng.randint(16, 256),
                "chat",
                system_prompt=sp,
                arrival_step=arrival,
                after=None if prev is None else prev.request_id,
                delay=0 if prev is None else self.rng.randint(5, 60),
            )
        return turns

    def sampling(self, budget: int) -> int:
        sp = self._zipf(len(self.system))
        prompt = np.concatenate([self.system[sp], self.tokens(self.rng.randint(16, 256))])
        n = self.rng.randint(2, 8)
        self.add(
            prompt,
            self.rng.randint(16, 200),
            "sampling",
            num_samples=n,
            system_prompt=sp,
            arrival_step=self.arrive(),
        )
        return 1

    def beam(self, budget: int) -> int:
        prompt = self.tokens(self.rng.randint(64, 512))
        self.add(
            prompt,
            self.rng.randint(16, 128),
            "beam",
            beam_width=self.rng.randint(2, 6),
            arrival_step=self.arrive(),
        )
        return 1

    def long_doc(self, budget: int) -> int:
        d = self._zipf(len(self.docs))
        prompt = np.concatenate([self.docs[d], self.tokens(self.rng.randint(16, 128))])
        self.add(
            prompt,
            self.rng.randint(16, 256),
            "long-doc",
            system_prompt=d,
            arrival_step=self.arrive(),
        )
        return 1


def build_workload(
    kind: str = "mixed",
    num_requests: int = 300,
    *,
    seed: int = 0,
    arrival_rate: float = 2.0,
    doc_tokens: int = 8192,
) -> Workload:
    """Build one of `WORKLOADS` with `num_requests` requests (chat turns count one each).

    `arrival_rate`: mean requests per step of the Poisson arrival process (0: all at once);
    `doc_tokens`: the longest document of the long-document workload.
    """
    if kind not in WORKLOADS:
        raise ValueError(f"unknown workload {kind!r}; choose one of {', '.join(WORKLOADS)}")
    if num_requests < 0:
        raise ValueError("num_requests must be >= 0")
    if arrival_rate < 0:
        raise ValueError("arrival_rate must be >= 0")
    if doc_tokens < 2:
        raise ValueError("doc_tokens must be >= 2")
    b = _Builder(seed, arrival_rate, doc_tokens)
    makers: dict[str, Callable[[int], int]] = {
        "shared-prefix": b.shared_prefix,
        "chat": b.chat,
        "sampling": b.sampling,
        "beam": b.beam,
        "long-doc": b.long_doc,
    }
    kinds = list(_MIX) if kind == "mixed" else [kind]
    weights = [_ITEM_WEIGHTS[k] for k in kinds]
    while len(b.requests) < num_requests:
        k = b.rng.choices(kinds, weights)[0]
        makers[k](num_requests - len(b.requests))
    lengths = tuple(len(p) for p in b.system)
    return Workload(tuple(b.requests), seed, lengths, name=kind)


__all__ = ["WORKLOADS", "build_workload", "generate_workload"]
