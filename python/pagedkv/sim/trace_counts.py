"""Traces that log token counts but no content ids: Azure's LLM inference traces and BurstGPT.

- Azure (`Azure/AzurePublicDataset`, 2023 and 2024): CSV with a header, columns `TIMESTAMP`
  (a date and time, e.g. `2023-11-16 18:15:46.6805900`), `ContextTokens`, `GeneratedTokens`.
- BurstGPT (`HPMLL/BurstGPT`): CSV with a header, columns `Timestamp` (seconds), `Model`,
  `Request tokens`, `Response tokens`, `Total tokens`, `Log Type` (later releases add
  `Session ID` and `Elapsed time`). Rows with 0 request tokens (failed requests) are skipped.

Without ids nothing says which prompts share a prefix, so these traces can size a cache for
load and concurrency (blocks held at peak, preemptions, queueing at a given pool) but cannot
say what prefix caching would hit. `read_trace` refuses them unless the format is named
(`--trace-format azure|burstgpt`); then every prompt is replayed as unique content (fresh ids
for every block), which makes the hit rate 0 by construction, and a `TraceWarning` says so.
"""

from __future__ import annotations

import csv
import math
import warnings
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path

import numpy as np

from pagedkv.sim.requests import TRACE_BLOCK_TOKENS, Request, Workload
from pagedkv.sim.trace_common import TraceBuilder, TraceWarning

AZURE_FIELDS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
BURSTGPT_FIELDS = ("Timestamp", "Request tokens", "Response tokens")
CAN_AND_CANNOT = (
    "it logs token counts but no content ids, so which prompts share a prefix cannot be "
    "known: it can size a cache for load and concurrency (blocks held at peak, preemptions, "
    "queueing) but cannot estimate prefix-cache hit rates"
)


def _rows(path: str | Path, fields: tuple[str, ...]) -> Iterator[tuple[int, dict[str, str]]]:
    with open(path, encoding="utf-8-sig", newline="") as f:
        reader = csv.DictReader(f)
        missing = [k for k in fields if k not in (reader.fieldnames or ())]
        if missing:
            raise ValueError(f"{path}:1: the CSV header lacks {', '.join(missing)}")
        for row in reader:
            if any(v for v in row.values() if isinstance(v, str) and v.strip()):
                yield reader.line_num, row


def _count(row: dict[str, str], key: str, where: str) -> int:
    v = (row.get(key) or "").strip()
    try:
        x = float(v)
    except ValueError:
        raise ValueError(f"{where}: {key!r} must be a token count, got {v!r}") from None
    if not math.isfinite(x) or x < 0 or x != int(x):
        raise ValueError(f"{where}: {key!r} must be a token count, got {v!r}")
    return int(x)


def _azure_ms(row: dict[str, str], where: str) -> float:
    v = (row.get("TIMESTAMP") or "").strip()
    try:
        return datetime.fromisoformat(v).timestamp() * 1000.0
    except ValueError:
        raise ValueError(f"{where}: 'TIMESTAMP' must be a date and time, got {v!r}") from None


def _burstgpt_ms(row: dict[str, str], where: str) -> float:
    v = (row.get("Timestamp") or "").strip()
    try:
        x = float(v)
    except ValueError:
        x = math.nan
    if not math.isfinite(x) or x < 0:
        raise ValueError(f"{where}: 'Timestamp' must be seconds >= 0, got {v!r}")
    return x * 1000.0


def read_counts(path: str | Path, fmt: str, *, limit: int | None, ms_per_step: float) -> Workload:
    """The first `limit` requests of an Azure or BurstGPT trace, every prompt unique."""
    azure = fmt == "azure"
    fields = AZURE_FIELDS if azure else BURSTGPT_FIELDS
    prompt_key, out_key = fields[1], fields[2]
    b = TraceBuilder(path, ms_per_step, limit)
    next_id = 0
    skipped = 0
    for lineno, row in _rows(path, fields):
        if b.full:
            break
        where = f"{path}:{lineno}"
        ms = _azure_ms(row, where) if azure else _burstgpt_ms(row, where)
        n = _count(row, prompt_key, where)
        out = _count(row, out_key, where)
        if n == 0:  # nothing to prefill: a failed request's row
            skipped += 1
            continue
        blocks = -(-n // TRACE_BLOCK_TOKENS)
        b.requests.append(
            Request(
                request_id=len(b.requests),
                prompt_len=n,
                max_new_tokens=max(1, out),
                arrival_step=b.step_of(lineno, ms),
                kind="trace",
                hash_ids=np.arange(next_id, next_id + blocks, dtype=np.int64),
            )
        )
        next_id += blocks
    label = "Azure" if azure else "BurstGPT"
    what = "an Azure LLM inference trace" if azure else "a BurstGPT trace"
    workload = b.workload(f"trace {Path(path).name} ({label}, no content ids: every prompt unique)")
    skip = f"; rows with 0 prompt tokens skipped: {skipped}" if skipped else ""
    warnings.warn(
        f"{path}: {what}: {CAN_AND_CANNOT}. Every prompt is replayed as unique "
        f"content, so its hit rate is 0 by construction{skip}",
        TraceWarning,
        stacklevel=2,
    )
    return workload


__all__ = ["AZURE_FIELDS", "BURSTGPT_FIELDS", "CAN_AND_CANNOT", "read_counts"]
