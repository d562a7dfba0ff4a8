"""The host-memory tiers (docs/tiers.md, "Host tiers"): `HostTier` keeps blocks raw,
`CompressedHostTier` through a codec (byte shuffle + lz4 by default). Both are LRU stores
under a byte budget that counts what they hold (entry header, 89 bytes, plus payload).

Both implement `TierStore`: every method is thread-safe and none raises for a missing or
damaged entry. The lock guards only the index (an ordered dict of entries) and the
counters: compressing, framing and MACing a put, and checking, decompressing and copying a
get, run outside it, so several threads do that work at once (lz4, numpy's copies and
OpenSSL's HMAC-SHA256 all release the GIL on large buffers).

A put that does not fit evicts the least recently used entries until it does; an entry
larger than the whole budget is dropped (nothing is evicted for it). `get` refreshes an
entry's recency; `count_present` does not (it is a look-up, not a use). A get whose entry
fails its check (header, lengths, MAC, codec) is a miss, counted in `corrupt`, and the
entry is removed from the store (reported by `drain_removed` like an eviction).

Entries are plain ``bytearray`` objects, not pinned memory: `get` returns ``bytes`` (the
interface), a copy the caller stages for the host-to-device copy, so pinning the store's
own memory would save nothing until the interface lets a caller read an entry in place
(see docs/tiers.md).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

from pagedkv.tiers import codec as C
from pagedkv.tiers.base import TierKey, TierStats, TierStore
from pagedkv.tiers.entry import (
    EntryError,
    Namespace,
    check_secret,
    decode_entry,
    encode_entry,
    process_secret,
)

#: Element size of the dtypes a namespace may name (the shuffle's stride); others use 2.
_ITEM_SIZES = {
    "float32": 4,
    "fp32": 4,
    "float16": 2,
    "fp16": 2,
    "half": 2,
    "bfloat16": 2,
    "bf16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "fp8": 1,
    "int8": 1,
    "uint8": 1,
}


def item_size_of(dtype: str) -> int:
    """The element size of a namespace's dtype name (``torch.`` prefix allowed); 2 if
    unknown."""
    return _ITEM_SIZES.get(dtype.lower().removeprefix("torch."), 2)


def _as_bytes_view(data: bytes | bytearray | memoryview) -> memoryview:
    mv = memoryview(data)
    if not mv.c_contiguous:
        raise ValueError("a block's bytes must be one contiguous buffer")
    return mv if mv.format == "B" and mv.ndim == 1 else mv.cast("B")


def _check_namespace(namespace: object) -> None:
    if not isinstance(namespace, Namespace):
        raise TypeError(f"namespace must be a pagedkv.tiers.Namespace, got {namespace!r}")


def _check_key(key: TierKey) -> None:
    group: object = key.group
    digest: object = key.digest
    if isinstance(group, bool) or not isinstance(group, int) or not 0 <= group <= 0xFF:
        raise ValueError(f"group must be an int in 0..255, got {group!r}")
    if not isinstance(digest, bytes) or len(digest) > 32:
        raise ValueError("digest must be bytes, at most 32 of them")


class _HostStore:
    """An LRU byte-budgeted store of framed entries in host memory (module docstring)."""

    medium: str = "CPU"

    def __init__(
        self,
        budget_bytes: int,
        namespace: Namespace,
        codec: C.Codec,
        name: str,
        secret: bytes | None,
    ) -> None:
        if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int):
            raise TypeError(f"budget_bytes must be an int, got {budget_bytes!r}")
        if budget_bytes < 0:
            raise ValueError("budget_bytes must be at least 0")
        _check_namespace(namespace)
        # Not an attribute of the public API, never in repr: see docs/tiers.md.
        self._secret = process_secret() if secret is None else check_secret(secret)
        self.budget_bytes = budget_bytes
        self.namespace = namespace
        self.codec = codec
        self._ns_id = namespace.ident()
        self._lock = threading.Lock()
        #: key -> (entry, its size when stored: what the budget was charged)
        self._entries: OrderedDict[TierKey, tuple[bytearray, int]] = OrderedDict()
        self._stored = 0
        self._removed: list[TierKey] = []
        self._stats = TierStats(name)
        self._stats.extra.update(
            {"stored_bytes_in": 0.0, "budget_bytes": float(budget_bytes), "raw_fallbacks": 0.0}
        )
        # The codec's own time (compressing codecs only): its throughput, apart from framing.
        self._stats.extra.update(
            {"seconds_encode": 0.0, "seconds_decode": 0.0, "decoded_bytes": 0.0}
        )
        self._stats.extra["discards"] = 0.0

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(budget_bytes={self.budget_bytes}, "
            f"namespace={self.namespace!r}, codec={self.codec!r})"
        )

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    # ---- TierStore ----------------------------------------------------------------------

    def put(self, key: TierKey, data: bytes | memoryview) -> bool:
        """Store a block's raw bytes under `key`, evicting the least recently used entries
        until it fits; False (a dropped put) when the entry is larger than the budget or
        the codec failed. A key already present is replaced."""
        t0 = time.perf_counter()
        key = TierKey(*key)
        _check_key(key)
        raw = _as_bytes_view(data)
        raw_len = raw.nbytes
        blob: bytearray | None = None
        fallback = False
        coded = self.codec.codec_id != C.RAW
        t_enc = 0.0
        try:
            t1 = time.perf_counter()
            enc = self.codec.encode(raw)
            t_enc = time.perf_counter() - t1 if coded else 0.0
            fallback = enc.codec_id == C.RAW and self.codec.codec_id != C.RAW and raw_len > 0
            blob = bytearray(
                encode_entry(
                    self._ns_id,
                    key.group,
                    key.digest,
                    enc.codec_id,
                    enc.item_size,
                    raw_len,
                    memoryview(enc.payload),
                    secret=self._secret,
                )
            )
        except Exception:
            blob = None  # the codec failed: the block is dropped, never half-written
        with self._lock:
            st = self._stats
            if blob is None or len(blob) > self.budget_bytes:
                st.dropped_puts += 1
                st.errors += blob is None
                st.seconds_put += time.perf_counter() - t0
                return False
            size = len(blob)
            old = self._entries.pop(key, None)
            if old is not None:
                self._stored -= old[1]
            while self._stored + size > self.budget_bytes:
                victim, (_, vsize) = self._entries.popitem(last=False)
                self._stored -= vsize
                self._removed.append(victim)
                st.evictions += 1
            self._entries[key] = (blob, size)
            self._stored += size
            st.puts += 1
            st.raw_bytes_in += raw_len
            st.extra["stored_bytes_in"] += size
            st.extra["raw_fallbacks"] += fallback
            st.extra["seconds_encode"] += t_enc
            st.seconds_put += time.perf_counter() - t0
        return True

    def get(self, key: TierKey) -> bytes | None:
        """The raw bytes under `key` (checked against the key, lengths and MAC, then
        decoded), or None; a damaged entry is removed and counted in `corrupt`."""
        t0 = time.perf_counter()
        key = TierKey(*key)
        with self._lock:
            self._stats.gets += 1
            slot = self._entries.get(key)
            if slot is None:
                self._stats.misses += 1
                self._stats.seconds_get += time.perf_counter() - t0
                return None
            self._entries.move_to_end(key)
        blob = slot[0]
        out: bytes | None = None
        corrupt = False
        t_dec = 0.0
        coded = False
        try:
            e = decode_entry(
                memoryview(blob), self._ns_id, key.group, key.digest, secret=self._secret
            )
            t1 = time.perf_counter()
            out = C.decode(e.codec, e.item_size, e.payload, e.raw_len)
            coded = e.codec != C.RAW  # a block kept raw (compression did not pay) decodes free
            t_dec = time.perf_counter() - t1 if coded else 0.0
        except EntryError:
            corrupt = True
        except Exception:
            out = None  # out of memory, say: a miss, the entry stays
        with self._lock:
            st = self._stats
            if out is None:
                st.misses += 1
                if corrupt:
                    st.corrupt += 1
                    if self._entries.get(key) is slot:  # not replaced meanwhile
                        del self._entries[key]
                        self._stored -= slot[1]
                        self._removed.append(key)
                else:
                    st.errors += 1
            else:
                st.hits += 1
                st.raw_bytes_out += len(out)
                st.extra["seconds_decode"] += t_dec
                st.extra["decoded_bytes"] += len(out) if coded else 0
            st.seconds_get += time.perf_counter() - t0
        return out

    def count_present(self, keys: Sequence[TierKey]) -> int:
        """How many of `keys`, from the first, are stored (recency unchanged; an entry is
        checked only when read, so a damaged one counts here and misses in `get`)."""
        n = 0
        with self._lock:
            for k in keys:
                if TierKey(*k) not in self._entries:
                    break
                n += 1
        return n

    def present_each(self, keys: Sequence[TierKey]) -> list[bool]:
        """Whether each key is stored (recency unchanged; as `count_present`, but key by
        key: a window group's blocks need not be a leading run)."""
        with self._lock:
            entries = self._entries
            return [TierKey(*k) in entries for k in keys]

    def discard(self, key: TierKey) -> None:
        """Forget `key` if present (reported by `drain_removed`)."""
        key = TierKey(*key)
        with self._lock:
            slot = self._entries.pop(key, None)
            if slot is not None:
                self._stored -= slot[1]
                self._removed.append(key)
                self._stats.extra["discards"] += 1

    def drain_removed(self) -> list[TierKey]:
        """Keys evicted, discarded or dropped as damaged since the last call, oldest first
        (the list grows until drained: the tier manager drains it every step)."""
        with self._lock:
            out, self._removed = self._removed, []
        return out

    def stats(self) -> TierStats:
        """A snapshot of the counters; `entries` and `stored_bytes` are the current ones."""
        with self._lock:
            return replace(
                self._stats,
                entries=len(self._entries),
                stored_bytes=self._stored,
                extra=dict(self._stats.extra),
            )

    # ---- beyond the interface -----------------------------------------------------------

    def clear(self) -> None:
        """Forget every entry (each reported by `drain_removed`)."""
        with self._lock:
            self._removed.extend(self._entries)
            self._stats.extra["discards"] += len(self._entries)
            self._entries.clear()
            self._stored = 0


class HostTier(_HostStore):
    """Raw blocks in host memory under a byte budget, LRU (medium ``"CPU"``). The budget
    counts each entry's framing too: a block of B bytes takes B + 89. `secret` keys the
    entries' MAC (16 bytes or more); by default the process's random secret, which suits a
    store that never shares its entries with another process."""

    medium = "CPU"

    def __init__(
        self,
        budget_bytes: int,
        namespace: Namespace,
        *,
        name: str = "host",
        secret: bytes | None = None,
    ) -> None:
        _check_namespace(namespace)
        codec = C.RawCodec(item_size_of(namespace.dtype))
        super().__init__(budget_bytes, namespace, codec, name, secret)


class CompressedHostTier(_HostStore):
    """Compressed blocks in host memory under a byte budget of stored (compressed and
    framed) bytes, LRU (medium ``"CPU_COMPRESSED"``). ``codec`` defaults to
    ``ShuffleLz4Codec`` by the element size of the namespace's dtype (2 for fp16/bf16); a
    block that compresses by less than 1/64 is kept raw. `secret` as for `HostTier`."""

    medium = "CPU_COMPRESSED"

    def __init__(
        self,
        budget_bytes: int,
        namespace: Namespace,
        codec: C.Codec | None = None,
        *,
        name: str = "host_compressed",
        secret: bytes | None = None,
    ) -> None:
        _check_namespace(namespace)
        if codec is None:
            codec = C.ShuffleLz4Codec(item_size_of(namespace.dtype))
        if not isinstance(codec, C.Codec):
            raise TypeError("codec must be a pagedkv.tiers.codec.Codec")
        super().__init__(budget_bytes, namespace, codec, name, secret)


if TYPE_CHECKING:  # mypy checks that both implement the interface

    def _implements(a: HostTier, b: CompressedHostTier) -> tuple[TierStore, TierStore]:
        return a, b


__all__ = ["CompressedHostTier", "HostTier", "item_size_of"]
