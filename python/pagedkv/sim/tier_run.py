"""Tiers below the GPU in the simulator (`--host-tier-bytes`, `--compress`, `--remote`).

The tiered run drives a `pagedkv.tiers.TieredCache` over the run's manager. The scheduler's
block-taking calls go through it (`TierDriver.target`), so each call's evicted blocks are
demoted before it returns, in the calling thread (`workers=0`: the run is deterministic),
and `allocate` continues each prefix match in the tiers. No torch is needed either way.

Two ways to run it (`--tier-data`):

- **count** (the default without `--compress`, `--remote` or `--check`): no byte moves. Each
  host tier is a `tiers.digests.DigestTier` that keeps the digests of the blocks it holds,
  `N // (model bytes per block)` of them, with a raw host tier's LRU rules: the hits,
  demotions and promotions are those of a raw `HostTier` of N bytes, at the cost of a dict
  operation per block.
- **real** (the default with `--compress`, `--remote` or `--check`; compression and a server
  need bytes): a numpy `HostKVPool` stands in for the GPU's pool: one layer of 2 KV heads x
  64 in bfloat16 (8 KiB per block of 16, K and V), into which every step writes the KV of
  the tokens it computed (`sim.tier_kv`: layer 0 of a random-weight decoder), through the
  manager's slot mapping, as an engine would. Evicted blocks are copied out of it, loaded
  blocks written back into it, copy-on-write pairs and swaps applied to it: the tiers move,
  compress, MAC and check real bytes, and the run reports their throughput. With `--check`,
  every prefix hit (GPU or tier) is read back from the pool once the step ran, and every
  finished sequence's whole KV before it is freed, and compared, token by token, with the
  KV its tokens and positions give.

Budgets are given in the bytes of the model's KV (`--kv-bytes-per-token`, or a `--model`
whose KV is one full-attention group; llama-3-8b's 128 KiB per token when neither is
given): a tier of N bytes holds `N // (model bytes per block)` raw blocks. With real bytes
its store gets the budget that holds exactly that many of the data pool's blocks (entry
header included), so the hit rates are those of the model's sizes, and a compressed tier
holds as many more blocks as the data pool's KV compresses. Bytes demoted and promoted are
reported in the model's bytes (`bytes_demoted`), and in the data pool's
(`data_bytes_demoted`, 0 when counting).
"""

from __future__ import annotations

import secrets
import uuid
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from pagedkv.sim import units
from pagedkv.sim.kv_bytes import KVBytes
from pagedkv.sim.option_names import DEFAULT_MODEL, TIER_DATA

DATA_LAYERS, DATA_HEADS, DATA_DIM, DATA_DTYPE = 1, 2, 64, "bfloat16"


def parse_bytes(text: str) -> int:
    """A byte size >= 1 in `sim.units`' syntax: ``1073741824``, ``64GiB``, ``512GB``."""
    return units.parse_bytes(text)


@dataclass(frozen=True, slots=True)
class TierOptions:
    """The tiers of a tiered run, from the command line."""

    kv: KVBytes
    host_bytes: int | None = None
    compress: str | None = None  # a codec name: the host tier (and the remote) compress
    remote: str | None = None
    remote_cluster: bool = False
    data: str = "count"  # "count": no bytes move; "real": a data pool's bytes (TIER_DATA)

    def __post_init__(self) -> None:
        if self.data not in TIER_DATA:
            raise ValueError(f"tier data must be one of {', '.join(TIER_DATA)}, got {self.data!r}")
        if self.data == "count" and self.compress is not None:
            raise ValueError("--compress needs the blocks' bytes: give --tier-data real")
        if self.data == "count" and self.remote is not None:
            raise ValueError("--remote stores bytes on a server: give --tier-data real")

    def describe(self, block_size: int) -> str:
        per = self.kv.per_block(block_size)
        parts = []
        if self.host_bytes is not None:
            kind = f"compressed ({self.compress})" if self.compress else "raw"
            parts.append(
                f"host {self.host_bytes / (1 << 30):g} GiB {kind} = "
                f"{self.host_bytes // per} raw blocks"
            )
        if self.remote is not None:
            cluster = " cluster" if self.remote_cluster else ""
            parts.append(f"remote{cluster} {self.remote} ({self.compress or 'raw'})")
        data = (
            "count-only (block digests, no bytes)"
            if self.data == "count"
            else f"real bytes: data pool {DATA_LAYERS} layer x {DATA_HEADS} heads x "
            f"{DATA_DIM} {DATA_DTYPE}"
        )
        return (
            "; ".join(parts) + f"; budgets in {self.kv.bytes_per_token} bytes of KV per token "
            f"({self.kv.source}); {data}"
        )


class TierCheckError(AssertionError):
    """A prefix hit whose KV in the pool is not what its tokens give (`--check`)."""


class _TierTarget:
    """The manager with its block-taking calls routed through a `TieredCache`."""

    __slots__ = ("_m", "_tc")
    DUTIES = frozenset({"extend", "append", "append_batch", "truncate", "swap_in", "fork"})

    def __init__(self, manager: Any, tc: Any) -> None:
        self._m = manager
        self._tc = tc

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tc if name in self.DUTIES else self._m, name)


class TierDriver:
    """The scheduler's handle on the tiers (`sim.scheduler` calls it at each moment a real
    engine would touch the KV): allocate through the tiers, apply copies and swaps, write
    each step's KV, and finally report."""

    def __init__(
        self,
        manager: Any,
        options: TierOptions,
        *,
        num_cpu_blocks: int,
        hash_algo: str,
        check: bool = False,
        stores: list[Any] | None = None,
    ) -> None:
        """`stores`, when given, are the tier stores to use instead of the ones `options`
        describes (several nodes sharing one store): the caller owns them, so `close` leaves
        them open."""
        from pagedkv.tiers.cache import TieredCache

        bs = manager.block_size
        self.m = manager
        self.options = options
        self.check = check
        self.real = options.data == "real"
        if check and not self.real:
            raise ValueError("--check reads the KV back: it needs --tier-data real")
        #: Whether the scheduler must hand each step's tokens to `write` (real bytes only).
        self.writes_kv = self.real
        self.model_block = options.kv.per_block(bs)
        self.pool: Any = None
        self.swap: Any = None
        self.data_block = 0
        if self.real:
            from pagedkv.sim.tier_kv import LayerZeroKV
            from pagedkv.tiers.blocks import block_nbytes
            from pagedkv.tiers.host_pool import HostKVPool

            self.pool = HostKVPool(
                DATA_LAYERS, manager.num_blocks, bs, DATA_HEADS, DATA_DIM, DATA_DTYPE
            )
            self.swap = self.pool.swap_pool(num_cpu_blocks) if num_cpu_blocks else None
            self.kv = LayerZeroKV(DATA_HEADS, DATA_DIM)
            self.data_block = block_nbytes(self.pool)
        self._own_stores = stores is None
        self.stores = self._stores(bs) if stores is None else list(stores)
        self.tc = TieredCache(
            manager, self.pool, self.stores, hash_algo=hash_algo, workers=0, events=False
        )
        self.checked_tokens = 0
        self.pending_checks: dict[int, npt.NDArray[np.uint32]] = {}
        self.allocated: set[int] = set()  # sequences allocated once: a later one recomputes
        self.workload_tier_hit_tokens = 0  # tier hits of first allocations (workload prompts)

    def _stores(self, bs: int) -> list[Any]:
        from pagedkv.tiers.entry import HEADER_BYTES, Namespace
        from pagedkv.tiers.factory import StoreSpec, build_stores

        o = self.options
        if not self.real:
            from pagedkv.tiers.digests import DigestTier

            if o.host_bytes is None:
                raise ValueError("give --host-tier-bytes (count-only runs have a host tier)")
            cap = o.host_bytes // self.model_block
            return [DigestTier(cap, block_bytes=self.model_block, name="host", medium="CPU")]
        # A fresh tenant per run: a shared server's entries of another run never hit here.
        ns = Namespace(
            "pagedkv-sim",
            f"{DATA_LAYERS}x{DATA_HEADS}x{DATA_DIM}",
            DATA_DTYPE,
            bs,
            tenant=f"run-{uuid.uuid4().hex}",
        )
        if o.host_bytes is None and o.remote is None:
            raise ValueError("give --host-tier-bytes or --remote (or both)")
        host = None
        if o.host_bytes is not None:
            host = (o.host_bytes // self.model_block) * (self.data_block + HEADER_BYTES)
        spec = StoreSpec(
            host_bytes=host,
            codec=o.compress or "raw",
            redis_url=o.remote,
            redis_cluster=o.remote_cluster,
            # The run's own MAC secret, like its namespace: no other run's entry passes.
            secret=secrets.token_bytes(32) if o.remote is not None else None,
            ttl=3600.0,
        )
        return list(build_stores(spec, ns))

    # ---- the scheduler's calls ---------------------------------------------------------

    def target(self) -> Any:
        """What the scheduler calls instead of the manager: the block-taking calls go to the
        `TieredCache` (each demotes what it evicted before returning), the rest to the
        manager."""
        return _TierTarget(self.m, self.tc)

    def allocate(
        self,
        seq_id: int,
        tokens: npt.NDArray[np.uint32],
        *,
        num_new_tokens: int | None,
        cache_salt: str | bytes | None,
    ) -> tuple[int, int] | None:
        """Allocate through the tiers and load what they hold: `(tokens cached, tokens
        scheduled)`, or None (nothing changed)."""
        alloc = self.tc.allocate(
            seq_id, tokens, num_new_tokens=num_new_tokens, cache_salt=cache_salt
        )
        if alloc is None:
            return None
        hit = self.tc.load(alloc)
        if seq_id in self.allocated:
            pass  # a recomputation after preemption: not the workload's own prompt
        else:
            self.allocated.add(seq_id)
            self.workload_tier_hit_tokens += hit - alloc.gpu_hit_tokens
        if self.check and hit:
            # Read back once the step ran: a hit may be on blocks another sequence of the
            # same step computes (its KV is written before attention reads it, as in vLLM).
            self.pending_checks[seq_id] = tokens[:hit]
        return hit, int(self.m.num_scheduled_tokens(seq_id))

    def copy(self, pairs: Any) -> None:
        """Copy-on-write pairs `(src, dst)` the manager returned: copy the KV now."""
        if self.pool is not None and len(pairs):
            self.pool.copy_blocks(np.asarray(pairs, dtype=np.int64).reshape(-1, 2))

    def swapped(self, pairs: Any, *, out: bool) -> None:
        """`swap_out` pairs `(gpu, cpu)` or `swap_in` pairs `(cpu, gpu)`: move the KV."""
        from pagedkv.tiers.host_pool import swap_host_blocks

        if self.swap is None or not len(pairs):
            return
        a = np.asarray(pairs, dtype=np.int64).reshape(-1, 2)
        if out:
            swap_host_blocks(self.pool, self.swap, a)
        else:
            swap_host_blocks(self.swap, self.pool, a)

    def write(self, items: list[tuple[int, int, npt.NDArray[np.uint32]]]) -> None:
        """The step ran: `(seq_id, first position, tokens)` had their KV computed, the last
        scheduled tokens of each sequence."""
        if items and self.pool is not None:
            self._write(items)
        checks, self.pending_checks = self.pending_checks, {}
        for seq_id, tokens in checks.items():
            self._check_hit(seq_id, tokens)

    def _write(self, items: list[tuple[int, int, npt.NDArray[np.uint32]]]) -> None:
        n = len(items)
        ids = np.fromiter((s for s, _, _ in items), dtype=np.int64, count=n)
        counts = np.fromiter((len(t) for _, _, t in items), dtype=np.int64, count=n)
        starts = np.fromiter((p for _, p, _ in items), dtype=np.int64, count=n)
        slots = self.m.slot_mapping(ids, counts)
        tokens = np.concatenate([t for _, _, t in items])
        # Position of each token: its item's first position plus its index in the item.
        first_index = np.cumsum(counts) - counts
        pos = np.arange(len(tokens), dtype=np.int64) + np.repeat(starts - first_index, counts)
        # A fork shares its parent's blocks: write each slot once (both give the same KV).
        slots, first = np.unique(slots, return_index=True)
        k, v = self.kv(tokens[first], pos[first])
        self.pool.write(0, k, v, slots)

    def finished(self, items: list[tuple[int, npt.NDArray[np.uint32]]]) -> None:
        """`(seq_id, tokens)` of sequences about to be freed after their last step: with
        `--check`, every position must hold its KV (lost copies or swaps show here)."""
        if self.check:
            for seq_id, tokens in items:
                self._check_hit(seq_id, tokens)

    def _check_hit(self, seq_id: int, tokens: npt.NDArray[np.uint32]) -> None:
        from pagedkv.errors import PagedKVError

        bs = self.m.block_size
        try:
            table = np.asarray(self.m.block_table(seq_id), dtype=np.int64)
        except PagedKVError:
            return  # it left (aborted, preempted) or was swapped out before the step ran
        pos = np.arange(len(tokens))
        blocks, offsets = table[pos // bs], pos % bs
        k, v = self.kv(tokens, pos)
        for what, want in ((0, k), (1, v)):
            got = self.pool.read(0, what, blocks, offsets)
            bad = ~(got == self.pool.stored(want)).reshape(len(tokens), -1).all(axis=1)
            if bool(bad.any()):
                p = int(np.flatnonzero(bad)[0])
                raise TierCheckError(
                    f"sequence {seq_id}: the {'KV'[what]} at position {p} (block "
                    f"{int(blocks[p])}) is not the one its tokens give"
                )
        self.checked_tokens += len(tokens)

    # ---- the end -----------------------------------------------------------------------

    def close(self) -> dict[str, Any]:
        """Wait for the stores, close them, and return the tier figures."""
        self.tc.flush()
        s = self.tc.stats()
        self.tc.close()
        for store in self.stores if self._own_stores else ():
            closer = getattr(store, "close", None)
            if closer is not None:
                closer()
        raw = sum(t.raw_bytes_in for t in s.stores)
        stored = sum(t.extra.get("stored_bytes_in", 0.0) for t in s.stores)
        per_tier = []
        for store, st, hit in zip(self.stores, s.stores, s.tier_hit_tokens, strict=True):
            per_tier.append(
                {
                    "name": st.name,
                    "medium": store.medium,
                    "hit_tokens": hit,
                    "compression_ratio": st.compression_ratio,
                    "puts": st.puts,
                    "dropped_puts": st.dropped_puts,
                    "evictions": st.evictions,
                    "entries": st.entries,
                    "gets": st.gets,
                    "hits": st.hits,
                    "misses": st.misses,
                    "corrupt": st.corrupt,
                    "errors": st.errors,
                    "seconds_put": st.seconds_put,
                    "seconds_get": st.seconds_get,
                }
            )
        return {
            "tier_hit_tokens": {t["medium"]: t["hit_tokens"] for t in per_tier},
            "compression_ratio": raw / stored if stored else 1.0,
            "bytes_demoted": s.blocks_demoted * self.model_block,
            "bytes_promoted": s.blocks_promoted * self.model_block,
            "data_bytes_demoted": s.bytes_demoted,
            "data_bytes_promoted": s.bytes_promoted,
            "blocks_demoted": s.blocks_demoted,
            "blocks_promoted": s.blocks_promoted,
            "failed_loads": s.failed_loads,
            "dropped_demotions": s.dropped_demotions,
            "seconds_demote_copy": s.seconds_demote_copy,
            "seconds_load": s.seconds_load,
            "checked_tokens": self.checked_tokens,
            "workload_tier_hit_tokens": self.workload_tier_hit_tokens,
            "tier_data": self.options.data,
            **self._throughput(s),
            "tiers": per_tier,
        }

    def _throughput(self, s: Any) -> dict[str, Any]:
        """With real bytes: GB/s (10^9 bytes) of the data pool's bytes demoted (copy out,
        then every tier's put: encode, frame, MAC, store), promoted (every get: check,
        decode; then the copy in), compressed and decompressed (the codec alone), and the
        time a load adds per promoted block. None when counting (nothing moved)."""
        if not self.real:
            keys = ("demote_gbps", "promote_gbps", "compress_gbps", "decompress_gbps")
            return {**dict.fromkeys(keys), "load_us_per_block": None}
        put = sum(t.seconds_put for t in s.stores)
        enc = sum(t.extra.get("seconds_encode", 0.0) for t in s.stores)
        dec = sum(t.extra.get("seconds_decode", 0.0) for t in s.stores)
        coded = [t for t in s.stores if t.extra.get("seconds_encode")]
        raw_in = sum(t.raw_bytes_in for t in coded)
        raw_out = sum(t.extra.get("decoded_bytes", 0.0) for t in coded)

        def rate(nbytes: float, seconds: float) -> float | None:
            return nbytes / seconds / 1e9 if seconds > 0 and nbytes else None

        return {
            "demote_gbps": rate(s.bytes_demoted, s.seconds_demote_copy + put),
            "promote_gbps": rate(s.bytes_promoted, s.seconds_load),
            "compress_gbps": rate(raw_in, enc),
            "decompress_gbps": rate(raw_out, dec),
            "load_us_per_block": (
                1e6 * s.seconds_load / s.blocks_promoted if s.blocks_promoted else None
            ),
        }


__all__ = ["DEFAULT_MODEL", "TierCheckError", "TierDriver", "TierOptions", "parse_bytes"]
