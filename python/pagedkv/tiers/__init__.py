"""Tiers below the GPU: host memory, compressed host memory and a shared Redis-protocol
store (docs/tiers.md). The core says which blocks leave the GPU (evictions) and where hits
are; these stores keep the bytes, keyed by the block's chain digest and its group, inside a
namespace, each entry framed with a MAC keyed by the tier's secret so that a wrong, damaged
or forged entry is a miss.
"""

from __future__ import annotations

from pagedkv.tiers.base import TierKey, TierStats, TierStore
from pagedkv.tiers.codec import Codec, Lz4Codec, RawCodec, ShuffleLz4Codec
from pagedkv.tiers.entry import EntryError, Namespace, decode_entry, encode_entry
from pagedkv.tiers.host import CompressedHostTier, HostTier

__all__ = [
    "Codec",
    "CompressedHostTier",
    "EntryError",
    "HostTier",
    "Lz4Codec",
    "Namespace",
    "RawCodec",
    "ShuffleLz4Codec",
    "TierKey",
    "TierStats",
    "TierStore",
    "decode_entry",
    "encode_entry",
]
