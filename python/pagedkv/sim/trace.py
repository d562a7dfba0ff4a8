"""Real request traces in the Mooncake format, and the hit count they imply.

One JSON object a line: `timestamp` (arrival, ms), `input_length`, `output_length`, `hash_ids`
(one id per 512-token block of the prompt, the last block possibly partial). Each id becomes
512 deterministic pseudo-tokens (`requests.hash_id_tokens`), so equal id prefixes are equal
token prefixes and hit the prefix cache exactly where the trace says they would.

A trace with no request is an error. Timestamps should not go backwards: a line that does
arrives in timestamp order anyway (the scheduler orders arrivals by step), not in file order,
so `read_trace` warns (`TraceOrderWarning`, naming the first such line).

`expected_hit_tokens` counts, from the hash ids alone and without any manager, the prompt
tokens a cache that never evicts would serve: the independent check of the simulator's hit rate.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from pagedkv.sim.requests import TRACE_BLOCK_TOKENS, Request, Workload


class TraceOrderWarning(UserWarning):
    """A trace's timestamps go backwards."""


def _field(obj: dict[str, object], key: str, where: str) -> int:
    v = obj.get(key)
    if not isinstance(v, int) or isinstance(v, bool) or v < 0:
        raise ValueError(f"{where}: {key!r} must be an integer >= 0, got {v!r}")
    return v


def read_trace(
    path: str | Path, *, limit: int | None = None, ms_per_step: float = 20.0
) -> Workload:
    """Read a Mooncake trace: the first `limit` requests, arrivals mapped to steps.

    A request arrives at step `timestamp // ms_per_step` (relative to the first request). A
    request with `output_length` 0 still decodes one token (its prefill produces one).
    """
    if ms_per_step <= 0:
        raise ValueError("ms_per_step must be > 0")
    if limit is not None and limit < 1:
        raise ValueError(f"limit must be >= 1 (the requests to replay), got {limit}")
    requests: list[Request] = []
    t0: int | None = None
    last_ts = -1
    backwards: list[tuple[int, int, int]] = []  # (line, timestamp, the previous line's)
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if limit is not None and len(requests) >= limit:
                break
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{where}: not JSON ({exc.msg})") from None
            if not isinstance(obj, dict):
                raise ValueError(f"{where}: expected a JSON object")
            ts = _field(obj, "timestamp", where)
            n = _field(obj, "input_length", where)
            out = _field(obj, "output_length", where)
            ids = obj.get("hash_ids")
            if not isinstance(ids, list) or not all(
                isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids
            ):
                raise ValueError(f"{where}: 'hash_ids' must be a list of integers >= 0")
            if n < 1 or not (len(ids) - 1) * TRACE_BLOCK_TOKENS < n <= len(ids) * (
                TRACE_BLOCK_TOKENS
            ):
                raise ValueError(
                    f"{where}: input_length {n} does not match {len(ids)} hash ids "
                    f"of {TRACE_BLOCK_TOKENS} tokens"
                )
            t0 = ts if t0 is None else t0
            if ts < last_ts:
                backwards.append((lineno, ts, last_ts))
            last_ts = ts
            requests.append(
                Request(
                    request_id=len(requests),
                    prompt_len=n,
                    max_new_tokens=max(1, out),
                    arrival_step=int(max(0, ts - t0) // ms_per_step),
                    kind="trace",
                    hash_ids=np.asarray(ids, dtype=np.int64),
                )
            )
    if not requests:
        raise ValueError(f"{path}: the trace has no requests")
    if backwards:
        first, ts, before = backwards[0]
        more = f" ({len(backwards)} lines in all)" if len(backwards) > 1 else ""
        warnings.warn(
            f"{path}:{first}: timestamp {ts} is earlier than the line before it ({before}){more}: "
            "requests are replayed in timestamp order, not in file order (any before the "
            "first line's at step 0)",
            TraceOrderWarning,
            stacklevel=2,
        )
    return Workload(tuple(requests), 0, name=f"trace {Path(path).name}", ms_per_step=ms_per_step)


def expected_hit_tokens(requests: Iterable[Request], block_size: int) -> tuple[int, int]:
    """(hit tokens, prompt tokens) of a never-evicting cache, from the hash ids alone.

    Block `k` (tokens `k*B .. (k+1)*B`) of a prompt has the same content as in another prompt
    exactly when both share the hash ids up to the one covering its last token. A prompt hits
    its longest run of full blocks seen before, capped below its length (at least one token is
    computed), then all its full blocks count as seen. Requests in the given (arrival) order.
    """
    trie: dict[tuple[int, int], int] = {}  # (parent node, hash id) -> node
    seen: set[tuple[int, int]] = set()  # (node of the id covering the block's end, block)
    hits = total = 0
    for r in requests:
        assert r.hash_ids is not None, "expected_hit_tokens needs trace requests"
        n = r.prompt_len
        nodes: list[int] = []
        node = 0
        for h in r.hash_ids.tolist():
            node = trie.setdefault((node, h), len(trie) + 1)
            nodes.append(node)
        keys = [
            (nodes[((k + 1) * block_size - 1) // TRACE_BLOCK_TOKENS], k)
            for k in range(n // block_size)
        ]
        h = 0
        cap = (n - 1) // block_size
        while h < cap and keys[h] in seen:
            h += 1
        seen.update(keys)
        hits += h * block_size
        total += n
    return hits, total


__all__ = ["TraceOrderWarning", "expected_hit_tokens", "read_trace"]
