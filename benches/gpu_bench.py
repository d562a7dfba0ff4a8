"""Kernel bandwidth on a GPU: each kernel against the measured device-to-device copy rate
and the memory roofline; decode attention also against torch's scaled_dot_product_attention
on pre-gathered K/V. CUDA events, warm-up, median of several runs.

    python benches/gpu_bench.py [--out benches/results/h200.md] [--peak-tbs 4.8]

Targets on an H200 (DESIGN.md): write, gather, copy_blocks >= 90 % of the copy rate; decode
attention >= 80 % of the roofline for batch 64, 4k context, 32 query heads over 8 KV heads,
head_dim 128, bf16.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pagedkv.device.pool import KVCachePool, paged_decode_attention, swap_blocks


def timed(fn: Callable[[], Any], warmup: int = 3, runs: int = 15) -> float:
    """Median seconds of fn() on the current stream, by CUDA events."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(runs):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return statistics.median(times)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--peak-tbs", type=float, default=4.8, help="nominal HBM TB/s (H200: 4.8)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    name = torch.cuda.get_device_name(dev)
    rng = np.random.default_rng(0)
    rows: list[tuple[str, str, float, float, str]] = []  # kernel, shape, us, TB/s, verdict

    # measured device-to-device copy rate (read + write counted)
    n = 1 << 30
    src = torch.empty(n, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    t = timed(lambda: dst.copy_(src))
    copy_tbs = 2 * n / t / 1e12
    rows.append(("torch copy_ (D2D)", "1 GiB", t * 1e6, copy_tbs, "reference"))

    def add(kernel: str, shape: str, seconds: float, nbytes: float, target: float) -> None:
        tbs = nbytes / seconds / 1e12
        frac = tbs / copy_tbs
        rows.append(
            (kernel, shape, seconds * 1e6, tbs, f"{frac:.0%} of copy (target {target:.0%})")
        )

    t0 = time.time()
    # ---- write: 16k tokens x 8 heads x 128, bf16, random slots
    pool = KVCachePool(1, 8192, 16, 8, 128, "bfloat16", dev)
    pool.warmup()
    print(f"warmup (compile or load every kernel): {time.time() - t0:.1f} s", flush=True)
    tokens = 16384
    slots = rng.permutation(8192 * 16)[:tokens].astype(np.int64)
    slots_d = torch.from_numpy(slots).to(dev)
    k = torch.randn((tokens, 8, 128), dtype=torch.bfloat16, device=dev)
    v = torch.randn_like(k)
    t = timed(lambda: pool.write(0, k, v, slots_d))
    add("write", f"{tokens} tok x 8 x 128 bf16", t, 4 * k.numel() * 2, 0.9)

    # ---- gather: 64 sequences x 1024 tokens
    tables = rng.permutation(8192)[: 64 * 64].reshape(64, 64).astype(np.int32)
    cu = np.arange(65, dtype=np.int32) * 1024
    kk, _ = pool.gather(0, tables, cu)
    torch.cuda.synchronize()
    t = timed(lambda: pool.gather(0, tables, cu))
    add("gather", "64 seq x 1024 tok", t, 4 * kk.numel() * 2, 0.9)

    # ---- copy_blocks: 32 layers, 1024 pairs
    pool = KVCachePool(32, 4096, 16, 8, 128, "bfloat16", dev)
    perm = rng.permutation(4096).astype(np.int32)
    pairs = np.stack([perm[:1024], perm[1024:2048]], axis=1)
    pairs_d = torch.from_numpy(pairs).to(dev)
    t = timed(lambda: pool.copy_blocks(pairs_d))
    add("copy_blocks", "1024 pairs x 32 layers", t, 2 * 1024 * pool.bytes_per_block, 0.9)

    # ---- swap out / in with a pinned CPU pool (PCIe: compared with nothing, just reported)
    cpu = pool.swap_pool(512)
    sp = np.stack([perm[:512], np.arange(512, dtype=np.int32)], axis=1)
    t = timed(lambda: swap_blocks(pool, cpu, sp), warmup=1, runs=5)
    by = 512 * pool.bytes_per_block
    rows.append(("swap out (D2H)", "512 blocks x 32 layers", t * 1e6, by / t / 1e12, "PCIe"))
    sp_in = np.stack([np.arange(512, dtype=np.int32), perm[2048:2560]], axis=1)
    t = timed(lambda: swap_blocks(cpu, pool, sp_in), warmup=1, runs=5)
    rows.append(("swap in (H2D)", "512 blocks x 32 layers", t * 1e6, by / t / 1e12, "PCIe"))

    # ---- decode attention: batch 64, 4k context, 32 q heads / 8 kv heads, 128, bf16
    batch, ctx, hq, hkv, dim, bs = 64, 4096, 32, 8, 128, 16
    nb = batch * ctx // bs
    pool = KVCachePool(1, nb, bs, hkv, dim, "bfloat16", dev)
    pool.buffer.normal_()
    tables = rng.permutation(nb).reshape(batch, ctx // bs).astype(np.int32)
    lens = np.full(batch, ctx, np.int32)
    tables_d = torch.from_numpy(tables).to(dev)
    lens_d = torch.from_numpy(lens).to(dev)
    q = torch.randn((batch, hq, dim), dtype=torch.bfloat16, device=dev)
    out = paged_decode_attention(q, pool, 0, tables_d, lens_d, max_seq_len=ctx)
    t = timed(lambda: paged_decode_attention(q, pool, 0, tables_d, lens_d, max_seq_len=ctx))
    kv_bytes = 2 * batch * ctx * hkv * dim * 2
    tbs = kv_bytes / t / 1e12
    rows.append(
        (
            "paged decode",
            f"b{batch} ctx{ctx} {hq}/{hkv} d{dim} bf16",
            t * 1e6,
            tbs,
            f"{tbs / args.peak_tbs:.0%} of {args.peak_tbs} TB/s, "
            f"{tbs / copy_tbs:.0%} of copy (target 80%)",
        )
    )
    kd, vd = pool.gather(0, tables, np.arange(batch + 1, dtype=np.int32) * ctx)
    kd = kd.view(batch, ctx, hkv, dim).transpose(1, 2).contiguous()
    vd = vd.view(batch, ctx, hkv, dim).transpose(1, 2).contiguous()
    q4 = q.unsqueeze(2)
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def run_sdpa() -> Any:
        return sdpa(q4, kd, vd, enable_gqa=True)

    ref = run_sdpa().squeeze(2)
    err = float((out.float() - ref.float()).norm() / ref.float().norm())
    t = timed(run_sdpa)
    rows.append(
        (
            "torch SDPA (dense K/V)",
            "same, pre-gathered",
            t * 1e6,
            kv_bytes / t / 1e12,
            f"rel diff {err:.1e}",
        )
    )

    lines = [
        f"GPU: {name}; torch {torch.__version__}; measured D2D copy {copy_tbs:.2f} TB/s "
        "(read+write); roofline = bytes moved / time",
        "",
        "| kernel | shape | median us | TB/s | verdict |",
        "|---|---|---:|---:|---|",
        *(f"| {a} | {b} | {c:.1f} | {d:.3f} | {e} |" for a, b, c, d, e in rows),
    ]
    table = "\n".join(lines)
    print(table)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
