"""A workload on which eviction policies differ: a hot set of prompts asked again every round,
between rounds a scan of prompts asked once (`sim.policies`' tests and docs).

Each round asks each of `hot` prompts (`hot_tokens` tokens each, the same every round) once,
then `scan` prompts of `scan_tokens` tokens that never come back. One request arrives every
`spacing` steps and generates one token, so requests hardly overlap and what a prompt finds
is what the cache kept. When the scan and the rest of the hot set together exceed the cache,
least-recently-released eviction has flushed every hot prompt before it comes back (no hot
hit after the first round); a policy that keeps blocks seen twice apart from blocks seen once
(S3-FIFO's main queue, ARC's frequent list) keeps the hot set while the scan passes through.
"""

from __future__ import annotations

import numpy as np

from pagedkv.sim.requests import VOCAB_SIZE, Request, Workload


def build_scan_workload(
    rounds: int = 6,
    *,
    hot: int = 8,
    hot_tokens: int = 256,
    passes: int = 2,
    scan: int = 6,
    scan_tokens: int = 1024,
    spacing: int = 2,
    seed: int = 0,
) -> Workload:
    """`rounds` rounds of the hot set then the scan (see the module docstring). The hot
    requests are kind "hot", the scan's "scan"."""
    for name, value in (("rounds", rounds), ("hot", hot), ("passes", passes), ("spacing", spacing)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    for name, value in (("hot_tokens", hot_tokens), ("scan_tokens", scan_tokens)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    if scan < 0:
        raise ValueError(f"scan must be >= 0, got {scan}")
    rng = np.random.default_rng(seed)
    hot_prompts = [rng.integers(0, VOCAB_SIZE, hot_tokens, dtype=np.uint32) for _ in range(hot)]
    requests: list[Request] = []

    def add(prompt: np.ndarray, kind: str, system_prompt: int = 0) -> None:
        requests.append(
            Request(
                request_id=len(requests),
                prompt_len=len(prompt),
                prompt_tokens=prompt,
                max_new_tokens=1,
                kind=kind,
                system_prompt=system_prompt,
                arrival_step=len(requests) * spacing,
            )
        )

    for _ in range(rounds):
        for _ in range(passes):
            for i, prompt in enumerate(hot_prompts):
                add(prompt, "hot", i)
        for _ in range(scan):
            add(rng.integers(0, VOCAB_SIZE, scan_tokens, dtype=np.uint32), "scan")
    return Workload(tuple(requests), seed, (hot_tokens,), name="scan")


__all__ = ["build_scan_workload"]
