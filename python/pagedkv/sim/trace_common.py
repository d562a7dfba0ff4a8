"""What every trace reader shares: the warnings and errors, field checks, and the list of
requests a reader builds (arrival steps from timestamps, the out-of-order warning)."""

from __future__ import annotations

import json
import math
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import numpy.typing as npt

from pagedkv.sim.requests import Request, Workload


class TraceWarning(UserWarning):
    """A trace was read, with a caveat the user should see."""


class TraceOrderWarning(TraceWarning):
    """A trace's timestamps go backwards."""


class TraceFormatError(ValueError):
    """A trace's format is unknown, not the one named, or cannot answer what was asked."""


def int_field(obj: dict[str, object], key: str, where: str, *, low: int = 0) -> int:
    """`obj[key]` as an integer >= `low` (bool refused)."""
    v = obj.get(key)
    if not isinstance(v, int) or isinstance(v, bool) or v < low:
        raise ValueError(f"{where}: {key!r} must be an integer >= {low}, got {v!r}")
    return v


def salt_field(obj: dict[str, object], where: str) -> str | None:
    """The optional `cache_salt` of a trace line (a tenant, docs/eviction.md): a non-empty
    string, or absent / null for none."""
    v = obj.get("cache_salt")
    if v is None:
        return None
    if not isinstance(v, str) or not v:
        raise ValueError(f"{where}: 'cache_salt' must be a non-empty string or null, got {v!r}")
    return v


def number_field(obj: dict[str, object], key: str, where: str) -> float:
    """`obj[key]` as a finite number >= 0, integer or not (bool refused)."""
    v = obj.get(key)
    if not isinstance(v, int | float) or isinstance(v, bool) or not math.isfinite(v) or v < 0:
        raise ValueError(f"{where}: {key!r} must be a number >= 0, got {v!r}")
    return float(v)


def id_list(obj: dict[str, object], where: str, n: int, block_tokens: int) -> npt.NDArray[np.int64]:
    """`obj["hash_ids"]`: integers >= 0, one per `block_tokens` of an `n`-token prompt (the
    last block possibly partial)."""
    ids = obj.get("hash_ids")
    if ids is None:
        raise ValueError(
            f"{where}: no 'hash_ids': without content ids no prefix sharing can be known"
        )
    # Types checked in C (`map(type, ...)`): a trace holds tens of millions of ids.
    bad = f"{where}: 'hash_ids' must be a list of integers >= 0 and < 2^63"
    if not isinstance(ids, list) or not set(map(type, ids)) <= {int}:
        raise ValueError(bad)
    # the sign checked on the list: a C loop without numpy's per-call cost (a trace holds
    # thousands of short lists)
    if ids and min(ids) < 0:
        raise ValueError(bad)
    try:
        a = np.asarray(ids, dtype=np.int64)
    except OverflowError:
        raise ValueError(bad) from None
    if n < 1 or not (len(a) - 1) * block_tokens < n <= len(a) * block_tokens:
        raise ValueError(
            f"{where}: input_length {n} does not match {len(a)} hash ids of {block_tokens} tokens"
        )
    return a


def json_lines(path: str | Path) -> Iterator[tuple[int, dict[str, object]]]:
    """(line number, object) of each non-blank line of a JSON-lines file."""
    with open(path, encoding="utf-8-sig") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{lineno}: not JSON ({exc.msg})") from None
            if not isinstance(obj, dict):
                raise ValueError(f"{path}:{lineno}: expected a JSON object")
            yield lineno, obj


def _num(x: float) -> str:
    """A timestamp as the trace wrote it: no exponent, no trailing zeros."""
    return f"{x:.6f}".rstrip("0").rstrip(".")


@dataclass
class TraceBuilder:
    """Collects a trace's requests in file order, arrivals relative to the first one."""

    path: str | Path
    ms_per_step: float
    limit: int | None
    requests: list[Request] = field(default_factory=list)
    t0: float | None = None
    last_ms: float = -math.inf
    backwards: list[tuple[int, float, float]] = field(default_factory=list)

    @property
    def full(self) -> bool:
        return self.limit is not None and len(self.requests) >= self.limit

    def step_of(self, lineno: int, ms: float) -> int:
        """The arrival step of a request logged at `ms` (milliseconds), noting disorder."""
        self.t0 = ms if self.t0 is None else self.t0
        if ms < self.last_ms:
            self.backwards.append((lineno, ms, self.last_ms))
        self.last_ms = ms
        return int(max(0.0, ms - self.t0) // self.ms_per_step)

    def workload(self, name: str, unit: str = "", scale: float = 1.0) -> Workload:
        """The workload, after warning once about timestamps that go backwards (printed in
        the trace's own unit: `scale` per millisecond, `unit` after the number)."""
        if not self.requests:
            raise ValueError(f"{self.path}: the trace has no requests")
        if self.backwards:
            first, ts, before = self.backwards[0]
            more = f" ({len(self.backwards)} lines in all)" if len(self.backwards) > 1 else ""
            warnings.warn(
                f"{self.path}:{first}: timestamp {_num(ts * scale)}{unit} is earlier than the "
                f"line before it ({_num(before * scale)}{unit}){more}: requests are replayed "
                "in timestamp order, not in file order (any before the first line's at step 0)",
                TraceOrderWarning,
                stacklevel=3,
            )
        return Workload(tuple(self.requests), 0, name=name, ms_per_step=self.ms_per_step)


__all__ = [
    "TraceBuilder",
    "TraceFormatError",
    "TraceOrderWarning",
    "TraceWarning",
    "id_list",
    "int_field",
    "json_lines",
    "number_field",
]
