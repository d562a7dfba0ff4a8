"""What a workload is made of: requests, and the tokens a sequence "samples".

A `Request` holds its prompt either as tokens or as trace hash ids (turned into tokens only
when the scheduler admits it, so a 60 M-token trace never sits in memory at once), how many
tokens it generates, how many samples or beams it asks for, and when it arrives: at
`arrival_step`, or, for a later turn of a chat, `delay` steps after request `after` finished
(and never before `arrival_step`: a trace's follow-up keeps its logged time unless its parent
is still running then).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from pagedkv._core import trace_tokens

VOCAB_SIZE = 32_000
TRACE_BLOCK_TOKENS = 512  # tokens per hash id in the Mooncake trace format (Bailian's: 16)

_M64 = 0xFFFFFFFFFFFFFFFF


def generated_token(seq_id: int, position: int) -> int:
    """The token a sequence 'samples' at `position`: a fixed function, so reruns agree."""
    return (((seq_id * 0x9E3779B1) ^ (position * 0x85EBCA77)) & 0xFFFFFFFF) % VOCAB_SIZE


def generated_tokens(seq_id: int, start: int, stop: int) -> npt.NDArray[np.uint32]:
    """`generated_token(seq_id, p)` for `p` in `start..stop`, as a uint32 array."""
    pos = np.arange(start, stop, dtype=np.uint64)
    mixed = np.uint64((seq_id * 0x9E3779B1) & _M64) ^ (pos * np.uint64(0x85EBCA77))
    return ((mixed & np.uint64(0xFFFFFFFF)) % np.uint64(VOCAB_SIZE)).astype(np.uint32)


def decode_tokens(
    seq_ids: npt.NDArray[np.uint64], positions: npt.NDArray[np.uint64]
) -> npt.NDArray[np.uint32]:
    """`generated_token` for many (sequence, position) pairs at once (one decode step)."""
    mixed = (seq_ids * np.uint64(0x9E3779B1)) ^ (positions * np.uint64(0x85EBCA77))
    return ((mixed & np.uint64(0xFFFFFFFF)) % np.uint64(VOCAB_SIZE)).astype(np.uint32)


def hash_id_tokens(
    hash_ids: npt.NDArray[np.int64], length: int, block_tokens: int = TRACE_BLOCK_TOKENS
) -> npt.NDArray[np.uint32]:
    """The first `length` pseudo-tokens of a trace prompt: `block_tokens` per hash id.

    Token `j` of block id `h` is a fixed function of `(h, j)` (splitmix64 of
    `h * block_tokens + j`, kept to 31 bits), so equal ids give equal tokens and different ids,
    in practice, never do (ids must stay below `2^64 / block_tokens` for that).
    """
    base: npt.NDArray[np.uint64] = hash_ids.astype(np.uint64) * np.uint64(block_tokens)
    offsets = np.arange(block_tokens, dtype=np.uint64)
    x: npt.NDArray[np.uint64] = np.add.outer(base, offsets).ravel()[:length]
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    x = x ^ (x >> np.uint64(31))
    return (x & np.uint64(0x7FFFFFFF)).astype(np.uint32)


@dataclass(frozen=True, slots=True, eq=False)
class Request:
    """One request of a workload (see the module docstring)."""

    request_id: int
    prompt_len: int
    max_new_tokens: int
    num_samples: int = 1  # parallel sampling: forks at admission
    beam_width: int = 1  # beam search: forks at admission, pruned and re-forked while decoding
    cache_salt: str | None = None
    system_prompt: int = 0  # which shared system prompt (or document) the prompt starts with
    arrival_step: int = 0
    after: int | None = None  # arrives `delay` steps after this request finished
    delay: int = 0
    kind: str = "shared-prefix"
    prompt_tokens: npt.NDArray[np.uint32] | None = None
    hash_ids: npt.NDArray[np.int64] | None = None
    hash_block_tokens: int = TRACE_BLOCK_TOKENS  # prompt tokens per hash id

    @property
    def prompt(self) -> npt.NDArray[np.uint32]:
        """The prompt's token ids (built from the hash ids for trace requests)."""
        if self.prompt_tokens is not None:
            return self.prompt_tokens
        assert self.hash_ids is not None
        # `hash_id_tokens` in Rust: the numpy version (the tests' reference) costs a long
        # trace's replay several seconds, once per admission.
        out: npt.NDArray[np.uint32] = trace_tokens(
            self.hash_ids, self.prompt_len, self.hash_block_tokens
        )
        return out

    @property
    def sequences(self) -> int:
        """Sequences it decodes at once: its samples or its beams."""
        return max(self.num_samples, self.beam_width)


@dataclass(frozen=True, slots=True)
class Workload:
    """A deterministic list of requests, in arrival order."""

    requests: tuple[Request, ...]
    seed: int
    system_prompt_lengths: tuple[int, ...] = ()
    name: str = "shared-prefix"
    # A trace replay: milliseconds of arrival time per step. None: a built-in, seeded workload.
    ms_per_step: float | None = None

    @property
    def prompt_tokens(self) -> int:
        return sum(r.prompt_len for r in self.requests)

    @property
    def max_new_tokens(self) -> int:
        return sum(r.max_new_tokens * r.sequences for r in self.requests)

    def describe(self) -> str:
        kinds: dict[str, int] = {}
        for r in self.requests:
            kinds[r.kind] = kinds.get(r.kind, 0) + 1
        mix = ", ".join(f"{k} {v}" for k, v in kinds.items())
        samples = sum(r.sequences for r in self.requests)
        last = max((r.arrival_step for r in self.requests), default=0)
        if self.ms_per_step is None:
            origin = f"seed {self.seed}"
        else:
            origin = f"{self.ms_per_step:g} ms per step = {last * self.ms_per_step / 1000:.1f} s"
        return (
            f"{self.name}: {len(self.requests)} requests ({mix}; {samples} sequences), "
            f"{self.prompt_tokens} prompt tokens, {self.max_new_tokens} to generate, "
            f"arrivals over {last} steps ({origin})"
        )


__all__ = [
    "TRACE_BLOCK_TOKENS",
    "VOCAB_SIZE",
    "Request",
    "Workload",
    "decode_tokens",
    "generated_token",
    "generated_tokens",
    "hash_id_tokens",
]
