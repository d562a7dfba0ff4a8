"""Content keys of full blocks, fast enough to key every block of a 60 M-token trace.

The miss-ratio curve needs one integer per full block that is equal exactly when two blocks
would be the same prefix-cache entry: the same tokens in the block *and* the same tokens
before it, under the same cache salt and LoRA id. The manager's digests would do, but asking
for them costs a call and a bytes object per block, and the curve should not trust the code it
checks; so, like `record.ScheduleRecord`, this keys contents on its own, with a 64-bit chain
computed by numpy for a whole prompt at once:

    c_i = sum_j mix(token_{iB+j}) * Q^(B-1-j)      (one block's content, mod 2^64)
    K_i = K_{i-1} * P + c_i                         (the chain; K_-1 from salt and LoRA id)
    key_i = finish(K_i)

The chain unrolls to `K_i = P^(i+1) K_-1 + P^i * cumsum_j(c_j * P^-j)` (P is odd, so it has an
inverse mod 2^64), which numpy computes without a loop; uint64 arithmetic wraps mod 2^64 as the
formula wants. `mix` makes the content non-linear in the tokens; `finish` spreads the bits, so
that any bits of a key can pick a sample (SHARDS). Two different contents share a key with
probability about 2^-64 per pair: for ten million blocks, about one chance in 10^5.
"""

from __future__ import annotations

import hashlib

import numpy as np
import numpy.typing as npt

U64 = npt.NDArray[np.uint64]

_MASK = (1 << 64) - 1
_P = 0x9E3779B97F4A7C15  # chain multiplier (odd)
_P_INV = pow(_P, -1, 1 << 64)
_Q = 0xC2B2AE3D27D4EB4F  # in-block multiplier (odd)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


def _finish(x: U64) -> U64:
    """splitmix64's finaliser: every output bit depends on every input bit."""
    x = (x ^ (x >> np.uint64(30))) * _M1
    x = (x ^ (x >> np.uint64(27))) * _M2
    return x ^ (x >> np.uint64(31))


class _Powers:
    """`base^0 .. base^(n-1)` mod 2^64, grown on demand."""

    def __init__(self, base: int) -> None:
        self.base = base
        self.table: U64 = np.ones(1, dtype=np.uint64)

    def __call__(self, n: int) -> U64:
        have = len(self.table)
        if n > have:
            more = [0] * (max(n, 2 * have) - have)
            x = int(self.table[-1])
            for i in range(len(more)):
                x = x * self.base & _MASK
                more[i] = x
            self.table = np.concatenate([self.table, np.asarray(more, dtype=np.uint64)])
        return self.table[:n]


_P_POW = _Powers(_P)
_P_INV_POW = _Powers(_P_INV)
_Q_POW = _Powers(_Q)


def root(cache_salt: str | bytes | None, lora_id: int | None) -> int:
    """`K_-1`: the chain's start for a salt and a LoRA id (equal only when both are)."""
    salt = cache_salt.encode() if isinstance(cache_salt, str) else cache_salt
    tag = b"none" if salt is None else b"salt:" + salt
    digest = hashlib.blake2b(tag + f"|lora:{lora_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def contents(tokens: npt.NDArray[np.integer], block_size: int) -> U64:
    """`c_i` of each full block of `tokens` (a trailing partial block is ignored)."""
    nb = len(tokens) // block_size
    t = np.asarray(tokens[: nb * block_size], dtype=np.uint64).reshape(nb, block_size)
    t = _finish(t + np.uint64(1))
    weights = _Q_POW(block_size)[::-1]
    out: U64 = (t * weights).sum(axis=1, dtype=np.uint64)
    return out


def chain(start: int, c: U64) -> tuple[U64, int]:
    """The keys of blocks with contents `c` following chain state `start`, and the chain
    state after the last one (to continue it)."""
    n = len(c)
    if n == 0:
        return np.zeros(0, dtype=np.uint64), start
    s = np.cumsum(c * _P_INV_POW(n), dtype=np.uint64)
    p = _P_POW(n + 1)
    raw = p[:n] * s + p[1:] * np.uint64(start)
    return _finish(raw), int(raw[-1])


def step(states: U64, c: U64) -> tuple[U64, U64]:
    """One block for each of many chains: the keys and the new chain states."""
    raw: U64 = states * np.uint64(_P) + c
    return _finish(raw), raw


__all__ = ["chain", "contents", "root", "step"]
