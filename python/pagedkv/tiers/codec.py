"""Codecs of the stored blocks (docs/tiers.md, "Codecs").

A codec turns a block's raw bytes into a payload and back. ``encode`` returns an
``Encoded(codec_id, item_size, payload)``; the id and item size go into the entry header
(``tiers/entry.py``), so that ``decode`` (module level) can undo any entry whatever codec
the store that reads it is configured with.

- ``RawCodec`` (id 0): the bytes as they are.
- ``Lz4Codec`` (id 1): the ``lz4`` package's block format (no frame, no stored size: the
  entry header holds the raw length). It releases the GIL, so several threads compress at
  once.
- ``ShuffleLz4Codec`` (id 2): a byte shuffle by the element size (2 for fp16/bf16: all
  low bytes, then all high bytes), done with numpy, then lz4. A tail shorter than one
  element is kept as it is after the shuffled part.

A compressing codec whose payload saves less than 1/64 of the raw size returns the raw
bytes as codec 0 instead, so incompressible KV costs no decode time.

Decoding a payload that fails to decompress, or decompresses to another length than the
header says, raises ``EntryError``: the store reads it as a miss.

Adding a codec (zstd, say): subclass ``Codec`` with a new ``codec_id`` (3 is the next
free one; ids are one byte and never reused), implement ``_compress`` and ``_decompress``
(``_decompress`` gets the expected raw length; raise anything on damage and ``decode``
turns it into ``EntryError``), and ``register`` an instance so that ``decode`` can read its
entries. Import the compression library inside the codec, as ``Lz4Codec`` does, so that
``import pagedkv`` keeps needing numpy only.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

from pagedkv.tiers.entry import EntryError

#: A compressed payload is kept only when it saves at least 1/MIN_SAVING of the raw size.
MIN_SAVING = 64

RAW, LZ4, SHUFFLE_LZ4 = 0, 1, 2

Buffer = bytes | bytearray | memoryview


class Encoded(NamedTuple):
    """What a codec made of a block: the id and item size for the entry header, and the
    payload (raw bytes when compression did not pay: codec 0)."""

    codec_id: int
    item_size: int
    payload: Buffer


def _raw(data: Buffer, item_size: int) -> Encoded:
    return Encoded(RAW, item_size, data)


def pays(raw_len: int, payload_len: int) -> bool:
    """Whether a payload of `payload_len` bytes saves at least 1/64 of `raw_len`."""
    return raw_len > 0 and MIN_SAVING * (raw_len - payload_len) >= raw_len


class Codec:
    """The interface: ``encode(data) -> Encoded``; ``decode`` undoes a payload of this
    codec's id. Subclasses implement ``_compress``/``_decompress``; ``RawCodec`` neither."""

    codec_id: int = RAW
    name: str = "raw"

    def __init__(self, item_size: int = 1) -> None:
        if isinstance(item_size, bool) or not isinstance(item_size, int):
            raise TypeError(f"item_size must be an int, got {item_size!r}")
        if not 1 <= item_size <= 0xFFFF:
            raise ValueError(f"item_size must be in 1..65535, got {item_size}")
        #: The element size of the data (2 for fp16/bf16); the shuffle's stride.
        self.item_size = item_size

    def __repr__(self) -> str:
        return f"{type(self).__name__}(item_size={self.item_size})"

    def encode(self, data: Buffer) -> Encoded:
        """The payload of `data` under this codec, or the raw bytes (codec 0) when the
        compressed payload would save less than 1/64."""
        if self.codec_id == RAW or len(data) == 0:
            return _raw(data, self.item_size)
        payload = self._compress(data)
        if not pays(len(data), len(payload)):
            return _raw(data, self.item_size)
        return Encoded(self.codec_id, self.item_size, payload)

    def decode(self, payload: Buffer, raw_len: int, item_size: int) -> bytes:
        """The raw bytes of a payload of this codec (``raw_len`` from the header);
        `EntryError` if it does not decompress to exactly that many bytes."""
        try:
            out = self._decompress(payload, raw_len, item_size)
        except EntryError:
            raise
        except Exception as e:
            raise EntryError(f"{self.name} payload does not decode: {e}") from e
        if len(out) != raw_len:
            raise EntryError(f"{self.name} payload decodes to {len(out)} bytes, not {raw_len}")
        return out

    def _compress(self, data: Buffer) -> Buffer:
        raise NotImplementedError

    def _decompress(self, payload: Buffer, raw_len: int, item_size: int) -> bytes:
        return bytes(payload)


class RawCodec(Codec):
    """Codec 0: the block's bytes unchanged."""

    codec_id = RAW
    name = "raw"


_LZ4_MAX_RATIO = 255  # a sequence of lz4 adds at most 255 bytes per byte of input


def _lz4_block() -> Any:
    try:
        import lz4.block
    except ImportError as e:  # pragma: no cover - exercised only without the extra
        raise ImportError(
            "the lz4 codecs need the `lz4` package: pip install 'pagedkv[tiers]'"
        ) from e
    return lz4.block


class Lz4Codec(Codec):
    """Codec 1: lz4's block format, default mode (``acceleration`` > 1 trades ratio for
    speed, as lz4's "fast" mode)."""

    codec_id = LZ4
    name = "lz4"

    def __init__(self, item_size: int = 1, *, acceleration: int = 1) -> None:
        super().__init__(item_size)
        if acceleration < 1:
            raise ValueError("acceleration must be at least 1")
        self.acceleration = acceleration
        self._lz4 = _lz4_block()

    def _compress(self, data: Buffer) -> Buffer:
        if self.acceleration == 1:
            out: bytes = self._lz4.compress(data, store_size=False)
        else:
            out = self._lz4.compress(
                data, mode="fast", acceleration=self.acceleration, store_size=False
            )
        return out

    def _decompress(self, payload: Buffer, raw_len: int, item_size: int) -> bytes:
        if raw_len == 0:
            raise EntryError("an empty block is never compressed")
        if raw_len > _LZ4_MAX_RATIO * len(payload) + 64:
            # lz4 cannot expand more than that: do not allocate what a bad header asks for
            raise EntryError(f"{len(payload)} bytes of lz4 cannot hold {raw_len}")
        out: bytes = self._lz4.decompress(payload, uncompressed_size=raw_len)
        return out


def shuffle(data: Buffer, item_size: int) -> np.ndarray:
    """Byte ``k`` of every element first, for k = 0 .. item_size-1, then the tail shorter
    than one element as it is. A uint8 array of ``len(data)`` bytes."""
    a = np.frombuffer(data, np.uint8)
    if item_size == 1:
        return a
    body = a.size - a.size % item_size
    m = body // item_size
    out = np.empty(a.size, np.uint8)
    if item_size == 2:  # fp16/bf16: two passes over 16-bit words, no strided byte copies
        v = a[:body].view("<u2")
        out[:m] = v  # the low bytes (the assignment keeps the low 8 bits)
        np.right_shift(v, 8, out=out[m:body], casting="unsafe")
    else:
        r = a[:body].reshape(m, item_size)
        for k in range(item_size):
            out[k * m : (k + 1) * m] = r[:, k]
    out[body:] = a[body:]
    return out


def unshuffle(data: Buffer, item_size: int) -> bytes:
    """The inverse of `shuffle`."""
    a = np.frombuffer(data, np.uint8)
    if item_size == 1:
        return a.tobytes()
    body = a.size - a.size % item_size
    m = body // item_size
    out = np.empty(a.size, np.uint8)
    if item_size == 2:
        o = out[:body].view("<u2")
        np.left_shift(a[m:body], 8, out=o, dtype="<u2")
        o |= a[:m]
    else:
        o2 = out[:body].reshape(m, item_size)
        for k in range(item_size):
            o2[:, k] = a[k * m : (k + 1) * m]
    out[body:] = a[body:]
    return out.tobytes()


class ShuffleLz4Codec(Lz4Codec):
    """Codec 2: byte shuffle by ``item_size`` (the entry header keeps it), then lz4."""

    codec_id = SHUFFLE_LZ4
    name = "shuffle+lz4"

    def __init__(self, item_size: int = 2, *, acceleration: int = 1) -> None:
        super().__init__(item_size, acceleration=acceleration)

    def _compress(self, data: Buffer) -> Buffer:
        return super()._compress(shuffle(data, self.item_size).data)

    def _decompress(self, payload: Buffer, raw_len: int, item_size: int) -> bytes:
        if item_size < 1:
            raise EntryError("item size 0")
        return unshuffle(super()._decompress(payload, raw_len, item_size), item_size)


# ---- decoding any entry -----------------------------------------------------------------

_DECODERS: dict[int, Callable[[], Codec]] = {
    RAW: RawCodec,
    LZ4: Lz4Codec,
    SHUFFLE_LZ4: ShuffleLz4Codec,
}
_INSTANCES: dict[int, Codec] = {}


def register(codec_id: int, factory: Callable[[], Codec]) -> None:
    """Make `decode` read payloads of `codec_id` with ``factory()`` (made on first use)."""
    if not 0 <= codec_id <= 0xFF:
        raise ValueError("codec ids are one byte")
    _DECODERS[codec_id] = factory
    _INSTANCES.pop(codec_id, None)


def decode(codec_id: int, item_size: int, payload: Buffer, raw_len: int) -> bytes:
    """The raw bytes of an entry's payload; `EntryError` for an unknown codec or a payload
    that does not decode to exactly `raw_len` bytes."""
    codec = _INSTANCES.get(codec_id)
    if codec is None:
        factory = _DECODERS.get(codec_id)
        if factory is None:
            raise EntryError(f"unknown codec {codec_id}")
        try:
            codec = _INSTANCES[codec_id] = factory()
        except ImportError as e:
            raise EntryError(f"codec {codec_id} is not available here: {e}") from e
    return codec.decode(payload, raw_len, item_size)


def codec_by_name(name: str, item_size: int = 2) -> Codec:
    """``"raw"``, ``"lz4"``, ``"shuffle+lz4"`` (also ``"shuffle-lz4"``)."""
    key = name.lower().replace("-", "+").replace("_", "+")
    if key in ("raw", "none"):
        return RawCodec(item_size)
    if key == "lz4":
        return Lz4Codec(item_size)
    if key in ("shuffle+lz4", "shufflelz4"):
        return ShuffleLz4Codec(item_size)
    raise ValueError(f"unknown codec {name!r}: raw, lz4, shuffle+lz4")


__all__ = [
    "LZ4",
    "MIN_SAVING",
    "RAW",
    "SHUFFLE_LZ4",
    "Codec",
    "Encoded",
    "Lz4Codec",
    "RawCodec",
    "ShuffleLz4Codec",
    "codec_by_name",
    "decode",
    "pays",
    "register",
    "shuffle",
    "unshuffle",
]
