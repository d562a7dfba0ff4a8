"""The KV the simulator writes when it runs tiers on a CPU pool (`sim.tier_run`): K and V of
the first attention layer of a decoder with random weights, for any token at any position.

Layer 0 of a decoder computes, for token `t` at position `p`: `x = RMSNorm(E[t])`,
`K = RoPE(x W_k, p)`, `V = x W_v` (per KV head; RoPE theta 10000, rotating half of each
head's channels against the other half, as Llama does). Here `E` is N(0, 1) over a vocabulary
of 32,768 ids (token ids are taken modulo it), `W_k` and `W_v` are N(0, 1/hidden). The
pool stores it in bfloat16 (round to nearest even). This is the most realistic KV that
costs little enough to write for every token of the shared trace; it is not a trained
model's (their K has a few large channels that random weights lack), and deeper layers mix
the whole prefix in, which layer 0 does not: the check of `--check` (`sim.tier_run`) is
therefore exact per token and position, and the chain digests keep prefixes apart.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

VOCAB = 32768
HIDDEN = 256
ROPE_THETA = 10000.0


class LayerZeroKV:
    """`kv(tokens, positions)` -> K, V float32 `[n, num_kv_heads, head_dim]`."""

    def __init__(self, num_kv_heads: int, head_dim: int, *, seed: int = 0) -> None:
        if head_dim % 2:
            raise ValueError("head_dim must be even (RoPE rotates channel pairs)")
        rng = np.random.default_rng(seed)
        emb = rng.standard_normal((VOCAB, HIDDEN), dtype=np.float32)
        x = emb / np.sqrt(np.mean(emb * emb, axis=1, keepdims=True) + 1e-6)
        scale = np.float32(1.0 / np.sqrt(HIDDEN))
        wk = rng.standard_normal((HIDDEN, num_kv_heads * head_dim), dtype=np.float32) * scale
        wv = rng.standard_normal((HIDDEN, num_kv_heads * head_dim), dtype=np.float32) * scale
        self.shape = (num_kv_heads, head_dim)
        self._k = (x @ wk).reshape(VOCAB, num_kv_heads, head_dim)
        self._v = (x @ wv).reshape(VOCAB, num_kv_heads, head_dim)
        half = head_dim // 2
        self._inv_freq = ROPE_THETA ** (-np.arange(half, dtype=np.float64) * 2 / head_dim)
        # cos and sin of every position up to the longest seen (grown by doubling): a
        # position's rotation is computed once, not once per write.
        self._cos = np.empty((0, 1, half), dtype=np.float32)
        self._sin = np.empty((0, 1, half), dtype=np.float32)

    def _rotations(self, end: int) -> None:
        n = max(1024, len(self._cos))
        while n < end:
            n *= 2
        angle = np.arange(n, dtype=np.float64)[:, None] * self._inv_freq
        self._cos = np.cos(angle).astype(np.float32)[:, None, :]
        self._sin = np.sin(angle).astype(np.float32)[:, None, :]

    def __call__(
        self, tokens: npt.NDArray[np.integer], positions: npt.NDArray[np.integer]
    ) -> tuple[npt.NDArray[np.float32], npt.NDArray[np.float32]]:
        ids = np.asarray(tokens, dtype=np.int64) % VOCAB
        pos = np.asarray(positions, dtype=np.int64)
        if len(pos) and int(pos.max()) >= len(self._cos):
            self._rotations(int(pos.max()) + 1)
        k = self._k[ids]
        cos, sin = self._cos[pos], self._sin[pos]
        half = self.shape[1] // 2
        a, b = k[..., :half], k[..., half:]
        rotated = np.concatenate((a * cos - b * sin, b * cos + a * sin), axis=-1)
        return rotated, self._v[ids]


__all__ = ["LayerZeroKV"]
