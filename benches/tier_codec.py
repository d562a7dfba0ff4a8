"""Compression ratio and speed of the tier codecs on KV written by the pool (issue 11).

    python benches/tier_codec.py [--out benches/results/tier_codec-<machine>-<date>.md]
                                 [--small] [--repeat N]

Data (every block is the bytes a tier stores for it: ``pool.buffer[:, :, block]``, all
layers, K then V, ``[layers, 2, block_size, kv_heads, head_dim]``, contiguous):

- ``transformer``: a decode loop of a small decoder with random weights (no trained model
  is available here), on a CPU ``KVCachePool`` of fp16 or bf16, driven by a
  ``BlockManager``: token embeddings N(0, 1), per layer RMSNorm, Q/K/V projections, RoPE
  (theta 10000) on Q and K, causal attention, output projection and a SiLU MLP, weights
  N(0, 1/fan_in), residual stream, computed in float32 (K, V and the decode query cast
  to the pool's dtype, round to nearest even, for the pool). Prompts of Zipf-distributed tokens,
  a third of them behind one of three shared system prompts, are prefilled (K/V of the
  tokens past the prefix hit written with ``pool.write`` through the manager's slot
  mapping; attention of the prompt computed densely), then every sequence decodes greedily
  one token per step: K/V written with ``pool.write``, attention read back from the pool
  with ``paged_decode_attention``. Every full block of every sequence is measured once.
- ``e2e-loop``: the K/V of the model of tests/kernels/test_engine_loop_e2e.py (each token's K/V is
  standard normal float32 from an RNG seeded by the digest of its prefix), written with
  ``pool.write`` into an fp16 or bf16 pool through a ``BlockManager``'s slot mapping:
  i.i.d. Gaussian values, no structure across tokens, heads or channels.
- ``random`` and ``zeros``: uniform random bytes and zero bytes in blocks of the same
  size, the two bounds.

For each codec: the ratio (raw bytes over payload bytes, a block that saves less than 1/64
stored raw as the tiers do, and the share of blocks stored raw), compress and decompress
GB/s on one thread (best of --repeat passes over all blocks), and the order-0 entropy of
each byte plane after the shuffle, the size a byte-wise entropy coder (zstd's literals
stage, nvCOMP's ANS) would approach and lz4 (which has no entropy stage) cannot. Then the
tiers themselves: put and get GB/s of `HostTier` and `CompressedHostTier` (framing and the
HMAC-SHA256 MAC included), the MAC alone, blake2b-64 alone (the checksum of the entry format
before the MAC), and the compress speed with 2 threads.

These are not the KV of a trained model: trained models' K has a few large-magnitude
channels and RoPE structure that random weights only partly reproduce, so real KV may
compress differently (published lossless figures for bf16 KV with entropy coding are about
1.4x; docs/tiers.md).
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import hmac
import math
import os
import platform
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

import pagedkv
from pagedkv.tiers import codec as C
from pagedkv.tiers.base import TierKey
from pagedkv.tiers.entry import Namespace
from pagedkv.tiers.host import CompressedHostTier, HostTier

# ---- the models ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Shape:
    layers: int = 4
    hidden: int = 1024
    heads: int = 8
    kv_heads: int = 4
    head_dim: int = 128
    mlp: int = 2816
    vocab: int = 4096
    block_size: int = 16
    seqs: int = 8
    prompt: tuple[int, int] = (96, 240)  # prompt lengths drawn from this range
    system: int = 48  # shared system prompt length
    decode: int = 48  # decode steps per sequence

    @property
    def block_bytes(self) -> int:
        return 2 * self.layers * self.block_size * self.kv_heads * self.head_dim * 2


FULL = Shape()
SMALL = Shape(
    layers=2, hidden=256, heads=4, kv_heads=2, head_dim=64, mlp=512, vocab=512, seqs=3,
    prompt=(24, 40), system=16, decode=8,
)  # fmt: skip


def _torch() -> Any:
    import torch

    return torch


class RandomTransformer:
    """A decoder with random weights (module docstring); float32 on the CPU."""

    def __init__(self, s: Shape, seed: int = 0) -> None:
        torch = _torch()
        g = torch.Generator().manual_seed(seed)
        self.s = s

        def w(i: int, o: int) -> Any:
            return torch.randn(i, o, generator=g) / math.sqrt(i)

        self.emb = torch.randn(s.vocab, s.hidden, generator=g)
        self.layers = [
            {
                "q": w(s.hidden, s.heads * s.head_dim),
                "k": w(s.hidden, s.kv_heads * s.head_dim),
                "v": w(s.hidden, s.kv_heads * s.head_dim),
                "o": w(s.heads * s.head_dim, s.hidden),
                "up": w(s.hidden, s.mlp),
                "gate": w(s.hidden, s.mlp),
                "down": w(s.mlp, s.hidden),
            }
            for _ in range(s.layers)
        ]
        inv = 1.0 / (10000.0 ** (torch.arange(0, s.head_dim, 2).float() / s.head_dim))
        self.inv_freq = inv

    @staticmethod
    def _norm(x: Any) -> Any:
        return x * (x.pow(2).mean(-1, keepdim=True) + 1e-6).rsqrt()

    def _rope(self, x: Any, pos: Any) -> Any:
        """x [tokens, heads, dim], pos [tokens] (rotate-half RoPE)."""
        torch = _torch()
        ang = pos.float()[:, None] * self.inv_freq[None, :]
        cos = torch.cat([ang.cos(), ang.cos()], -1)[:, None, :]
        sin = torch.cat([ang.sin(), ang.sin()], -1)[:, None, :]
        half = x.shape[-1] // 2
        rot = torch.cat([-x[..., half:], x[..., :half]], -1)
        return x * cos + rot * sin

    def _qkv(self, lw: dict[str, Any], h: Any, pos: Any) -> tuple[Any, Any, Any]:
        s = self.s
        x = self._norm(h)
        q = self._rope((x @ lw["q"]).view(-1, s.heads, s.head_dim), pos)
        k = self._rope((x @ lw["k"]).view(-1, s.kv_heads, s.head_dim), pos)
        v = (x @ lw["v"]).view(-1, s.kv_heads, s.head_dim)
        return q, k, v

    def _finish(self, lw: dict[str, Any], h: Any, att: Any) -> Any:
        torch = _torch()
        h = h + att.reshape(att.shape[0], -1) @ lw["o"]
        x = self._norm(h)
        return h + (torch.nn.functional.silu(x @ lw["gate"]) * (x @ lw["up"])) @ lw["down"]

    def prefill(self, pool: Any, tokens: list[int], slots: np.ndarray, first: int) -> int:
        """Run the prompt; write K/V of positions ``first ..`` (into ``slots``); return the
        next token (greedy)."""
        torch = _torch()
        s = self.s
        pos = torch.arange(len(tokens))
        h = self.emb[torch.tensor(tokens)]
        for i, lw in enumerate(self.layers):
            q, k, v = self._qkv(lw, h, pos)
            pool.write(i, k[first:].to(pool.dtype), v[first:].to(pool.dtype), slots)
            rep = s.heads // s.kv_heads
            att = torch.nn.functional.scaled_dot_product_attention(
                q.transpose(0, 1),
                k.repeat_interleave(rep, 1).transpose(0, 1),
                v.repeat_interleave(rep, 1).transpose(0, 1),
                is_causal=True,
            ).transpose(0, 1)
            h = self._finish(lw, h, att)
        return int((self._norm(h[-1]) @ self.emb.T).argmax())

    def decode(
        self,
        pool: Any,
        tokens: list[int],
        positions: list[int],
        slots: np.ndarray,
        tables: np.ndarray,
        lens: np.ndarray,
    ) -> list[int]:
        """One step for a batch: the K/V of each new token is written first, then its
        attention reads the sequence back from the pool."""
        torch = _torch()
        from pagedkv.device.pool import paged_decode_attention

        pos = torch.tensor(positions)
        h = self.emb[torch.tensor(tokens)]
        for i, lw in enumerate(self.layers):
            q, k, v = self._qkv(lw, h, pos)
            pool.write(i, k.to(pool.dtype), v.to(pool.dtype), slots)
            att = paged_decode_attention(q.to(pool.dtype), pool, i, tables, lens).float()
            h = self._finish(lw, h, att)
        return [int(x) for x in (self._norm(h) @ self.emb.T).argmax(-1)]


def _prompts(s: Shape, rng: np.random.Generator) -> list[list[int]]:
    def zipf(n: int) -> list[int]:
        return [int(x) % s.vocab for x in rng.zipf(1.2, n)]

    systems = [zipf(s.system) for _ in range(3)]
    out = []
    for i in range(s.seqs):
        n = int(rng.integers(*s.prompt))
        pre = systems[i % 3] if i % 3 != 2 else []
        out.append(pre + zipf(n - len(pre)))
    return out


def _full_blocks(m: Any, pool: Any, sids: list[int], s: Shape) -> list[bytes]:
    """The bytes of every full block of the sequences, each block once."""
    torch = _torch()
    seen: set[int] = set()
    out = []
    for sid in sids:
        full = m.num_tokens(sid) // s.block_size
        for b in m.block_table(sid)[:full]:
            if b in seen:
                continue
            seen.add(b)
            t = pool.buffer[:, :, b].contiguous()
            out.append(t.view(torch.int16).numpy().tobytes())
    return out


def transformer_blocks(dtype: str, s: Shape = FULL, seed: int = 0) -> list[bytes]:
    """Run the random-weights decoder's loop on a CPU pool of `dtype`; its full blocks."""
    torch = _torch()
    from pagedkv.device.pool import KVCachePool

    torch.manual_seed(seed)
    model = RandomTransformer(s, seed)
    rng = np.random.default_rng(seed)
    prompts = _prompts(s, rng)
    need = sum(-(-(len(p) + s.decode) // s.block_size) for p in prompts) + 4
    m = pagedkv.BlockManager(need, s.block_size)
    pool = KVCachePool(s.layers, need, s.block_size, s.kv_heads, s.head_dim, dtype, "cpu")
    toks: dict[int, list[int]] = {}
    with torch.inference_mode():
        for sid, p in enumerate(prompts):
            hit = m.allocate(sid, p)
            assert hit is not None
            slots = np.asarray(m.slot_mapping([sid], len(p) - hit))
            toks[sid] = [*p, model.prefill(pool, p, slots, hit)]
        sids = sorted(toks)
        for _ in range(s.decode):
            for sid in sids:
                pairs = m.append(sid, [toks[sid][-1]])
                assert pairs is not None
                if pairs:
                    pool.copy_blocks(np.asarray(pairs, np.int32))
            ids = np.array(sids, np.int64)
            slots = np.asarray(m.slot_mapping(ids, 1))
            lens = np.array([m.num_tokens(x) for x in sids], np.int32)
            nxt = model.decode(
                pool,
                [toks[x][-1] for x in sids],
                [m.num_tokens(x) - 1 for x in sids],
                slots,
                m.block_tables(ids, 0),
                lens,
            )
            for sid, t in zip(sids, nxt, strict=True):
                toks[sid].append(t)
    return _full_blocks(m, pool, sids, s)


def e2e_loop_blocks(dtype: str, s: Shape = FULL, seed: int = 0) -> list[bytes]:
    """The K/V of tests/kernels/test_engine_loop_e2e.py's model (i.i.d. N(0, 1) per token from an
    RNG seeded by the prefix digest), written through a manager's slots into a CPU pool."""
    torch = _torch()
    from pagedkv.device.pool import KVCachePool

    rng = np.random.default_rng(seed)
    prompts = [p + [int(x) for x in rng.integers(0, 1000, s.decode)] for p in _prompts(s, rng)]
    need = sum(-(-len(p) // s.block_size) for p in prompts) + 4
    m = pagedkv.BlockManager(need, s.block_size)
    pool = KVCachePool(s.layers, need, s.block_size, s.kv_heads, s.head_dim, dtype, "cpu")
    root = hashlib.blake2b(b"engine-loop-e2e", digest_size=16).digest()
    shape = (s.layers, 2, s.kv_heads, s.head_dim)
    for sid, p in enumerate(prompts):
        hit = m.allocate(sid, p)
        assert hit is not None
        d, rows = root, []
        for t in p:
            d = hashlib.blake2b(d + t.to_bytes(4, "little"), digest_size=16).digest()
            g = np.random.default_rng(int.from_bytes(d[:8], "little"))
            rows.append(g.standard_normal(shape, dtype=np.float32))
        kv = torch.from_numpy(np.stack(rows[hit:])).to(pool.dtype)
        slots = np.asarray(m.slot_mapping([sid], len(p) - hit))
        for layer in range(s.layers):
            pool.write(layer, kv[:, layer, 0], kv[:, layer, 1], slots)
    return _full_blocks(m, pool, list(range(len(prompts))), s)


def bound_blocks(kind: str, n: int, size: int, seed: int = 0) -> list[bytes]:
    rng = np.random.default_rng(seed)
    if kind == "zeros":
        return [bytes(size)] * n
    return [rng.integers(0, 256, size, dtype=np.uint8).tobytes() for _ in range(n)]


# ---- measuring ---------------------------------------------------------------------------------

CODECS = {
    "lz4": lambda: C.Lz4Codec(2),
    "shuffle2+lz4": lambda: C.ShuffleLz4Codec(2),
}


def _best(fn: Any, repeat: int) -> float:
    best = math.inf
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def entropy_ratio(blocks: list[bytes], item: int = 2) -> float:
    """Raw size over the order-0 entropy of each byte plane of the shuffled blocks (each
    block coded alone, as the tiers do)."""
    bits = 0.0
    raw = 0
    for b in blocks:
        a = np.frombuffer(b, np.uint8)
        raw += a.size
        body = a.size - a.size % item
        planes = a[:body].reshape(-1, item).T
        for plane in [*planes, a[body:]]:
            if plane.size == 0:
                continue
            p = np.bincount(plane, minlength=256) / plane.size
            p = p[p > 0]
            bits += float(-(p * np.log2(p)).sum()) * plane.size
    return raw * 8 / bits if bits else math.inf


@dataclass
class CodecRow:
    codec: str
    ratio: float
    raw_share: float
    compress_gbs: float
    decompress_gbs: float


def measure_codec(name: str, blocks: list[bytes], repeat: int) -> CodecRow:
    codec = CODECS[name]()
    raw = sum(len(b) for b in blocks)
    encs = [codec.encode(b) for b in blocks]
    stored = sum(len(e.payload) for e in encs)
    raw_share = sum(e.codec_id == C.RAW for e in encs) / len(encs)
    t_enc = _best(lambda: [codec.encode(b) for b in blocks], repeat)
    for e, b in zip(encs, blocks, strict=True):
        assert C.decode(e.codec_id, e.item_size, e.payload, len(b)) == b
    # memoryviews, as a tier passes them: a raw block's decode is then a real copy
    views = [
        (e.codec_id, e.item_size, memoryview(e.payload), len(b))
        for e, b in zip(encs, blocks, strict=True)
    ]
    t_dec = _best(lambda: [C.decode(*v) for v in views], repeat)
    return CodecRow(name, raw / stored, raw_share, raw / t_enc / 1e9, raw / t_dec / 1e9)


def measure_tiers(blocks: list[bytes], repeat: int) -> dict[str, float]:
    """put and get GB/s through the tiers (framing and MAC included), the MAC and blake2b-64
    alone, and shuffle+lz4 compress speed with 2 threads (the GIL is released)."""
    ns = Namespace("bench", "tier_codec", "bfloat16", 16)
    raw = sum(len(b) for b in blocks)
    keys = [TierKey(0, i.to_bytes(8, "little")) for i in range(len(blocks))]
    out: dict[str, float] = {}
    for label, make in (
        ("HostTier", lambda: HostTier(4 * raw, ns)),
        ("CompressedHostTier", lambda: CompressedHostTier(4 * raw, ns)),
    ):
        tier = make()
        t_put = _best(
            lambda t=tier: [t.put(k, b) for k, b in zip(keys, blocks, strict=True)], repeat
        )
        t_get = _best(lambda t=tier: [t.get(k) for k in keys], repeat)
        assert all(tier.get(k) == b for k, b in zip(keys, blocks, strict=True))
        out[f"{label} put"] = raw / t_put / 1e9
        out[f"{label} get"] = raw / t_get / 1e9
    t = _best(lambda: [hashlib.blake2b(b, digest_size=8).digest() for b in blocks], repeat)
    out["blake2b-64"] = raw / t / 1e9
    key = bytes(32)
    t = _best(lambda: [hmac.new(key, b, "sha256").digest() for b in blocks], repeat)
    out["HMAC-SHA256 (the entry MAC)"] = raw / t / 1e9
    codec = C.ShuffleLz4Codec(2)

    def threads(n: int) -> None:
        ths = [
            threading.Thread(target=lambda i=i: [codec.encode(b) for b in blocks[i::n]])
            for i in range(n)
        ]
        for th in ths:
            th.start()
        for th in ths:
            th.join()

    for n in (1, 2):
        t = _best(lambda n=n: threads(n), repeat)
        out[f"shuffle2+lz4 compress, {n} thread{'s' * (n > 1)}"] = raw / t / 1e9
    return out


def measure_planes(blocks: list[bytes], repeat: int) -> list[str]:
    """Where the ratio comes from: lz4 on each byte plane of the shuffled blocks alone,
    and shuffle+lz4 with lz4's acceleration (its "fast" mode) traded for speed."""
    import lz4.block

    rows = []
    for label, k in (("low bytes", 0), ("high bytes", 1)):
        part = []
        for b in blocks:
            s = C.shuffle(b, 2)
            half = len(s) // 2
            part.append(s[k * half : (k + 1) * half].tobytes())
        raw = sum(len(p) for p in part)
        stored = sum(len(lz4.block.compress(p, store_size=False)) for p in part)
        t = _best(lambda part=part: [lz4.block.compress(p, store_size=False) for p in part], repeat)
        rows.append(f"| lz4 on the {label} alone | {raw / stored:.3f} | {raw / t / 1e9:.2f} |")
    raw = sum(len(b) for b in blocks)
    for acc in (1, 4, 16):
        codec = C.ShuffleLz4Codec(2, acceleration=acc)
        stored = sum(len(codec.encode(b).payload) for b in blocks)
        t = _best(lambda c=codec: [c.encode(b) for b in blocks], repeat)
        rows.append(
            f"| shuffle2+lz4, acceleration {acc} | {raw / stored:.3f} | {raw / t / 1e9:.2f} |"
        )
    return rows


def datasets(small: bool) -> dict[str, list[bytes]]:
    s = SMALL if small else FULL
    out: dict[str, list[bytes]] = {}
    for dtype in ("float16", "bfloat16"):
        short = "fp16" if dtype == "float16" else "bf16"
        out[f"transformer {short}"] = transformer_blocks(dtype, s)
        out[f"e2e-loop {short}"] = e2e_loop_blocks(dtype, s)
    n = len(out["transformer fp16"])
    out["random bytes"] = bound_blocks("random", n, s.block_bytes)
    out["zeros"] = bound_blocks("zeros", n, s.block_bytes)
    return out


def report(small: bool, repeat: int, command: str = "python benches/tier_codec.py") -> str:
    import lz4
    import torch

    s = SMALL if small else FULL
    t0 = time.perf_counter()
    data = datasets(small)
    t_data = time.perf_counter() - t0
    lines = [
        f"# Tier codecs on pool-written KV ({datetime.date.today().isoformat()})",
        "",
        f"Command: `{command}` (from the repository root, pagedkv installed or "
        "`PYTHONPATH=python`)",
        "",
        f"Machine: {platform.machine()}, {os.cpu_count()} CPUs ({_cpu_model()}), "
        f"Python {platform.python_version()}, numpy {np.__version__}, torch "
        f"{torch.__version__}, lz4 {lz4.__version__} (lz4.block, default mode).",
        "",
        f"Shape: {s.layers} layers, {s.kv_heads} KV heads x {s.head_dim}, blocks of "
        f"{s.block_size} tokens = {s.block_bytes // 1024} KiB per block in fp16/bf16 "
        f"(all layers, K and V); model hidden {s.hidden}, {s.heads} query heads, MLP {s.mlp}, "
        f"vocab {s.vocab}; {s.seqs} sequences, prompts of {s.prompt[0]}..{s.prompt[1] - 1} "
        f"tokens, {s.decode} decode steps. Data generated in {t_data:.0f} s. What the data is: "
        "see the docstring of benches/tier_codec.py (random-weights decoder on the CPU pool; "
        "the e2e loop's i.i.d. Gaussian model; random bytes; zeros).",
        "",
        "One thread, best of the passes; ratio = raw / stored payload (blocks that save "
        "under 1/64 are stored raw, as the tiers do: 'raw' is their share); 'entropy' = "
        "raw / order-0 entropy of the shuffled byte planes (what a byte-wise entropy coder "
        "would approach; lz4 has no entropy stage).",
        "",
        "| data | blocks | codec | ratio | raw | compress GB/s | decompress GB/s | entropy |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, blocks in data.items():
        ent = entropy_ratio(blocks)
        for cname in CODECS:
            r = measure_codec(cname, blocks, repeat)
            lines.append(
                f"| {name} | {len(blocks)} | {cname} | {r.ratio:.3f} | "
                f"{100 * r.raw_share:.0f}% | {r.compress_gbs:.2f} | {r.decompress_gbs:.2f} | "
                f"{ent:.3f} |"
            )
    for name in ("transformer bf16", "transformer fp16"):
        lines += [
            "",
            f"Byte planes and lz4 acceleration, {name} (one thread):",
            "",
            "| what | ratio | compress GB/s |",
            "|---|---|---|",
            *measure_planes(data[name], repeat),
        ]
    lines += [
        "",
        "Through the tiers (put / get include the entry framing and the HMAC-SHA256 "
        "MAC, checked on every get), on the transformer bf16 blocks:",
        "",
    ]
    lines += ["| what | GB/s |", "|---|---|"]
    for k, v in measure_tiers(data["transformer bf16"], repeat).items():
        lines.append(f"| {k} | {v:.2f} |")
    return "\n".join(lines) + "\n"


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, help="also write the table to this file")
    ap.add_argument("--small", action="store_true", help="the small shape (seconds)")
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args(argv)
    _torch().set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    argv = sys.argv[1:] if argv is None else argv
    text = report(args.small, args.repeat, " ".join(["python benches/tier_codec.py", *argv]))
    sys.stdout.write(text)
    if args.out:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
