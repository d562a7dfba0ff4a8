"""`allocate(retention=..., decode_retention=...)` for the reference manager, as the Rust
binding (`rust/python/src/retention.rs`) and core (`rust/core/src/retention.rs`) check and
apply it: token ranges of the prompt, each with (priority, duration_s), and one retention
for the blocks past the prompt. A block takes the range holding its first token."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from pagedkv.errors import InvalidArgumentError, InvalidArgumentTypeError

__all__ = ["MAX_PRIORITY", "Retention", "RetentionSpec", "int_arg", "retention_arg", "rust_f64"]

MAX_PRIORITY = 100
_I64_MAX = (1 << 63) - 1

Retention = tuple[int, float | None]
"""(priority, duration_s or None)."""


def rust_f64(x: float) -> str:
    """`x` as Rust's `Display` writes an f64 (the core's messages): no `.0` on whole
    numbers, `inf`, `NaN`."""
    if math.isnan(x):
        return "NaN"
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    if x == int(x) and abs(x) < 1e16:
        return str(int(x))
    return repr(x)


def int_arg(x: object, what: str, lo: int, hi: int) -> int:
    """The binding's `int_arg`: an int (not a bool) in `lo..=hi`."""
    if isinstance(x, bool) or not hasattr(x, "__index__"):
        raise InvalidArgumentTypeError(f"{what} must be an int, got {type(x).__name__}")
    v = x.__index__()
    if not lo <= v <= hi:
        raise InvalidArgumentError(f"{what} = {v} is out of range [{lo}, {hi}]")
    return int(v)


def _duration(x: object, what: str) -> float | None:
    if x is None:
        return None
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        raise InvalidArgumentTypeError(f"{what}: duration_s must be a number or None")
    d = float(x)
    if not (math.isfinite(d) and d >= 0):
        raise InvalidArgumentError(
            f"{what}: duration_s must be a finite number >= 0, got {rust_f64(d)}"
        )
    return d


def _retention(priority: object, dur: object, what: str) -> Retention:
    p = int_arg(priority, f"{what}: priority", 0, MAX_PRIORITY)
    return p, _duration(dur, what)


def _items(obj: object, n: int, what: str) -> list[object]:
    if not isinstance(obj, Sequence):
        raise InvalidArgumentTypeError(f"{what} must be a tuple")
    items = list(obj)
    if len(items) != n:
        raise InvalidArgumentError(f"{what} must have {n} items, got {len(items)}")
    return items


@dataclass(frozen=True)
class RetentionSpec:
    ranges: list[tuple[int, int | None, Retention]]  # sorted by start, checked
    decode: Retention | None

    def of_block(self, first: int, prompt: int) -> Retention | None:
        """The retention of the block whose first token is `first`, in a sequence whose
        prompt has `prompt` tokens; None where no range (or no decode retention) applies."""
        if first >= prompt:
            return self.decode
        before = [r for r in self.ranges if r[0] <= first]
        if not before:
            return None
        _, end, ret = before[-1]
        return ret if end is None or first < end else None


def retention_arg(ranges: object, decode: object) -> RetentionSpec | None:
    """The binding's conversion and the core's checks, in their order; None when neither
    is given."""
    if ranges is None and decode is None:
        return None
    out: list[tuple[int, int | None, Retention]] = []
    if ranges is not None:
        if not isinstance(ranges, Sequence) or isinstance(ranges, str):
            raise InvalidArgumentTypeError("retention must be a list of tuples")
        for i, r in enumerate(ranges):
            what = f"retention[{i}]"
            it = _items(r, 4, what)
            start = int_arg(it[0], f"{what}: start_token", 0, _I64_MAX)
            end = None if it[1] is None else int_arg(it[1], f"{what}: end_token", 0, _I64_MAX)
            out.append((start, end, _retention(it[2], it[3], what)))
    dec = None
    if decode is not None:
        it = _items(decode, 2, "decode_retention")
        dec = _retention(it[0], it[1], "decode_retention")
    out.sort(key=lambda r: r[0])
    for i, (start, end, _) in enumerate(out):
        what = f"retention range {i} [{start}, {'end' if end is None else end})"
        if end is not None and end <= start:
            raise InvalidArgumentError(f"{what} is empty")
        if i + 1 < len(out) and (end is None or end > out[i + 1][0]):
            raise InvalidArgumentError(f"{what} overlaps the range starting at {out[i + 1][0]}")
    return RetentionSpec(out, dec)
