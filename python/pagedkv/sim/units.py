"""One syntax for sizes on the `simulate` command line: bytes, and counts (blocks, tokens).

Bytes (`--kv-bytes-per-token`, `--host-tier-bytes`): a whole number of bytes, or a number
and a unit, the unit's case and a space before it free:

- binary (IEC): `KiB`, `MiB`, `GiB`, `TiB`, `PiB` (also `Ki` ... `Pi`): 1024^n bytes;
- decimal (SI): `kB`, `MB`, `GB`, `TB`, `PB`: 1000^n bytes; `B`: bytes.

A bare `K`, `M`, `G`, `T` or `P` is refused: memory sizes written `512G` mean GiB to some
tools and GB to others, and the two differ by 7% at G and 13% at P, so the message asks
for one of the two spellings. `1.5GiB` is taken when it is a whole number of bytes.

Counts (`--num-blocks`, `--cache-tokens`, `--requests`, ...): a whole number, or one with a
decimal suffix `k`, `M`, `G` (1000^n, as counts are everywhere: `64k` = 64000) or a binary
one `Ki`, `Mi`, `Gi` (1024^n: `64Ki` = 65536), in any case (`64K` = `64k` = 64000).

`byte_size` and `count` are the same parsers for argparse's `type=`: their message is what
argparse prints after the option's name.
"""

from __future__ import annotations

import argparse
import re
from decimal import Decimal, InvalidOperation

MAX = 2**63  # sizes and counts stay below this (the core's integers)

BYTE_UNITS: dict[str, int] = {
    "": 1,
    "b": 1,
    **{f"{p}ib": 1024 ** (i + 1) for i, p in enumerate("kmgtp")},
    **{f"{p}i": 1024 ** (i + 1) for i, p in enumerate("kmgtp")},
    **{f"{p}b": 1000 ** (i + 1) for i, p in enumerate("kmgtp")},
}
COUNT_SUFFIXES: dict[str, int] = {
    "": 1,
    **{p: 1000 ** (i + 1) for i, p in enumerate("kmg")},
    **{f"{p}i": 1024 ** (i + 1) for i, p in enumerate("kmg")},
}

BYTE_FORMS = (
    "a whole number of bytes, or a number with a unit: KiB, MiB, GiB, TiB, PiB (binary, "
    "1024^n bytes) or kB, MB, GB, TB, PB (SI, 1000^n bytes), e.g. 131072, 128KiB, 64GiB, "
    "512GB"
)
COUNT_FORMS = (
    "a whole number, or one with k, M, G (1000^n: 64k = 64000) or Ki, Mi, Gi (1024^n: 64Ki = 65536)"
)

_SPLIT = re.compile(r"^\s*([+-]?(?:\d[\d_]*)?(?:\.\d+)?)\s*([A-Za-z]*)\s*$")


def _split(text: str) -> tuple[Decimal, str] | None:
    m = _SPLIT.match(text)
    if m is None or not m.group(1) or m.group(1) in "+-":
        return None
    try:
        return Decimal(m.group(1).replace("_", "")), m.group(2).lower()
    except InvalidOperation:
        return None


def parse_bytes(text: str, *, minimum: int = 1) -> int:
    """A byte size (see the module docstring); ValueError names the problem and the forms."""
    parts = _split(text)
    if parts is None:
        raise ValueError(f"bad byte size {text!r}: give {BYTE_FORMS}")
    number, unit = parts
    if unit in ("k", "m", "g", "t", "p"):
        u = unit.upper()
        raise ValueError(
            f"byte size {text!r} is ambiguous: write {number}{u}iB for {number} x 1024^"
            f"{'kmgtp'.index(unit) + 1} bytes or {number}{'k' if u == 'K' else u}B for "
            f"{number} x 1000^{'kmgtp'.index(unit) + 1} bytes"
        )
    if unit not in BYTE_UNITS:
        raise ValueError(f"bad byte size {text!r}: unknown unit {unit!r}; give {BYTE_FORMS}")
    value = number * BYTE_UNITS[unit]
    if value != value.to_integral_value():
        raise ValueError(f"byte size {text!r} is not a whole number of bytes ({value})")
    n = int(value)
    if not minimum <= n < MAX:
        raise ValueError(f"a byte size must be in [{minimum}, 2**63), got {text!r}")
    return n


def parse_count(text: str) -> int:
    """A count (see the module docstring): negative values pass, for the option to refuse
    with its own bound; ValueError names the problem and the accepted forms."""
    parts = _split(text)
    if parts is None:
        raise ValueError(f"bad number {text!r}: give {COUNT_FORMS}")
    number, suffix = parts
    if suffix not in COUNT_SUFFIXES:
        raise ValueError(f"bad number {text!r}: unknown suffix {suffix!r}; give {COUNT_FORMS}")
    value = number * COUNT_SUFFIXES[suffix]
    if value != value.to_integral_value():
        raise ValueError(f"{text!r} is not a whole number ({value}); give {COUNT_FORMS}")
    n = int(value)
    if abs(n) >= MAX:
        raise ValueError(f"{text!r} is too large (at most 2**63 - 1)")
    return n


def byte_size(text: str) -> int:
    """`parse_bytes` for argparse, down to 0 (the option refuses what it cannot take)."""
    try:
        return parse_bytes(text, minimum=0)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def count(text: str) -> int:
    """`parse_count` for argparse."""
    try:
        return parse_count(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


__all__ = [
    "BYTE_FORMS",
    "BYTE_UNITS",
    "COUNT_FORMS",
    "COUNT_SUFFIXES",
    "byte_size",
    "count",
    "parse_bytes",
    "parse_count",
]
