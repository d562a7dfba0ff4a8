"""Real request traces: which format a file is, reading it, and the hit count it implies.

Formats (one module each):

- `mooncake` (`trace_mooncake`): JSON lines of `timestamp` (ms), `input_length`,
  `output_length`, `hash_ids` of 512-token blocks, each id naming a block with its prefix.
  Mooncake's conversation, tool-agent and synthetic traces all have this form. A line may
  carry a `cache_salt` (a tenant, as in Bailian lines): requests of two salts never share.
- `bailian` (`trace_bailian`): Alibaba's Qwen usage traces, JSON lines of `chat_id`,
  `parent_chat_id`, `timestamp` (s), `input_length`, `output_length`, `type`, `turn`,
  `hash_ids` of 16-token blocks each hashing its block alone (chained here before replay).
- `azure`, `burstgpt` (`trace_counts`): CSV logs of token counts with no content ids. They
  cannot say anything about prefix sharing, so they are refused unless named explicitly, and
  then replayed with every prompt unique (hit rate 0 by construction; load and concurrency
  only).

`detect_trace_format` tells them apart by the first non-blank line (the JSON keys, or the CSV
header); `read_trace(..., trace_format="auto")` reads whatever it finds, and a named format
that is not what the file holds is an error (`TraceFormatError`, naming both).

Each hash id becomes `hash_block_tokens` deterministic pseudo-tokens
(`requests.hash_id_tokens`), so equal id prefixes are equal token prefixes and hit the prefix
cache exactly where the trace says they would. A trace with no request is an error. Timestamps
should not go backwards: a line that does arrives in timestamp order anyway (the scheduler
orders arrivals by step), not in file order, so `read_trace` warns (`TraceOrderWarning`, naming
the first such line); other caveats are `TraceWarning`s.

`expected_hit_tokens` counts, from the hash ids alone and without any manager, the prompt
tokens a cache that never evicts would serve: the independent check of the simulator's hit rate.
"""

from __future__ import annotations

import csv
import json
from collections.abc import Iterable
from pathlib import Path

from pagedkv.sim.requests import Request, Workload
from pagedkv.sim.trace_bailian import read_bailian
from pagedkv.sim.trace_common import TraceFormatError, TraceOrderWarning, TraceWarning
from pagedkv.sim.trace_counts import AZURE_FIELDS, BURSTGPT_FIELDS, CAN_AND_CANNOT, read_counts
from pagedkv.sim.trace_mooncake import read_mooncake

TRACE_FORMATS = ("auto", "mooncake", "bailian", "azure", "burstgpt")
FORMAT_FIELDS = {
    "mooncake": "JSON lines of timestamp (ms), input_length, output_length, hash_ids "
    "(512-token blocks)",
    "bailian": "JSON lines of chat_id, parent_chat_id, timestamp (s), input_length, "
    "output_length, type, turn, hash_ids (16-token blocks)",
    "azure": "CSV with the header TIMESTAMP,ContextTokens,GeneratedTokens",
    "burstgpt": "CSV with the header Timestamp,Model,Request tokens,Response tokens,Total "
    "tokens,Log Type",
}
_NAMES = {"mooncake": "Mooncake", "bailian": "Bailian", "azure": "Azure", "burstgpt": "BurstGPT"}
_WHAT = {"azure": "an Azure LLM inference trace", "burstgpt": "a BurstGPT trace"}


def _formats() -> str:
    return "; ".join(f"{k}: {v}" for k, v in FORMAT_FIELDS.items())


def detect_trace_format(path: str | Path) -> str | None:
    """The format of a trace file from its first non-blank line, or None when unknown.

    Bailian lines have `chat_id` or `parent_chat_id`; Mooncake lines (without those) one of
    `hash_ids`, `input_length`, `output_length`; an Azure header `TIMESTAMP`,
    `ContextTokens`, `GeneratedTokens`; a BurstGPT header `Timestamp`, `Request tokens`,
    `Response tokens`. Raises ValueError for a file with no line at all (a trace with no
    requests) or a first line that starts as JSON and is not.
    """
    # utf-8-sig: a byte-order mark (spreadsheet exports have one) is not part of the header.
    with open(path, encoding="utf-8-sig") as f:
        first = next(((n, line) for n, line in enumerate(f, 1) if line.strip()), None)
    if first is None:
        raise ValueError(f"{path}: the trace has no requests")
    lineno, text = first[0], first[1].strip()
    if text.startswith("{"):
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{lineno}: not JSON ({exc.msg})") from None
        if not isinstance(obj, dict):
            return None
        # Any one telling key decides, so that a line missing a field is read, and the
        # reader names the field, instead of the format going unrecognised.
        if "chat_id" in obj or "parent_chat_id" in obj:
            return "bailian"
        if {"hash_ids", "input_length", "output_length"} & obj.keys():
            return "mooncake"
        return None
    header = {c.strip() for c in next(csv.reader([text]), [])}
    if header >= set(AZURE_FIELDS):
        return "azure"
    if header >= set(BURSTGPT_FIELDS):
        return "burstgpt"
    return None


def read_trace(
    path: str | Path,
    *,
    limit: int | None = None,
    ms_per_step: float = 20.0,
    trace_format: str = "auto",
) -> Workload:
    """Read a trace: the first `limit` requests, arrivals mapped to steps.

    A request arrives at step `(timestamp in ms) // ms_per_step` (relative to the first
    request). A request with `output_length` 0 still decodes one token (its prefill produces
    one). `trace_format` names the format (`TRACE_FORMATS`); "auto" detects it. Traces
    without content ids (Azure, BurstGPT) are refused under "auto" and replayed with every
    prompt unique when named.
    """
    if trace_format not in TRACE_FORMATS:
        raise ValueError(
            f"trace_format must be one of {', '.join(TRACE_FORMATS)}, got {trace_format!r}"
        )
    if ms_per_step <= 0:
        raise ValueError("ms_per_step must be > 0")
    if limit is not None and limit < 1:
        raise ValueError(f"limit must be >= 1 (the requests to replay), got {limit}")
    found = detect_trace_format(path)
    if trace_format == "auto":
        if found is None:
            raise TraceFormatError(
                f"{path}: cannot tell the trace's format from its first line; expected "
                f"{_formats()}. Name the format with --trace-format (trace_format=) to see "
                "what a line lacks"
            )
        if found in ("azure", "burstgpt"):
            raise TraceFormatError(
                f"{path}: this is {_WHAT[found]} "
                f"({FORMAT_FIELDS[found]}): {CAN_AND_CANNOT}. Refused by default; to replay it "
                "for load and concurrency with every prompt unique (hit rate 0 by "
                f"construction), name the format: --trace-format {found}"
            )
        fmt = found
    else:
        if found is not None and found != trace_format:
            raise TraceFormatError(
                f"{path}: --trace-format {trace_format} expects {FORMAT_FIELDS[trace_format]}, "
                f"but the first line is {_NAMES[found]}'s ({FORMAT_FIELDS[found]}); "
                f"use --trace-format {found} or auto"
            )
        fmt = trace_format
    if fmt == "mooncake":
        return read_mooncake(path, limit=limit, ms_per_step=ms_per_step)
    if fmt == "bailian":
        return read_bailian(path, limit=limit, ms_per_step=ms_per_step)
    return read_counts(path, fmt, limit=limit, ms_per_step=ms_per_step)


def expected_hit_tokens(requests: Iterable[Request], block_size: int) -> tuple[int, int]:
    """(hit tokens, prompt tokens) of a never-evicting cache, from the hash ids alone.

    Block `k` (tokens `k*B .. (k+1)*B`) of a prompt has the same content as in another prompt
    exactly when both share the hash ids up to the one covering its last token. A prompt hits
    its longest run of full blocks seen before, capped below its length (at least one token is
    computed), then all its full blocks count as seen. Requests in the given (arrival) order.
    """
    trie: dict[tuple[int, int], int] = {}  # (parent node, hash id) -> node
    roots: dict[str | None, int] = {None: 0}  # a salt's own root: tenants never share
    seen: set[tuple[int, int]] = set()  # (node of the id covering the block's end, block)
    hits = total = 0
    for r in requests:
        assert r.hash_ids is not None, "expected_hit_tokens needs trace requests"
        n = r.prompt_len
        per_id = r.hash_block_tokens
        nodes: list[int] = []
        node = roots.setdefault(r.cache_salt, -len(roots))
        for h in r.hash_ids.tolist():
            node = trie.setdefault((node, h), len(trie) + 1)
            nodes.append(node)
        keys = [(nodes[((k + 1) * block_size - 1) // per_id], k) for k in range(n // block_size)]
        h = 0
        cap = (n - 1) // block_size
        while h < cap and keys[h] in seen:
            h += 1
        seen.update(keys)
        hits += h * block_size
        total += n
    return hits, total


__all__ = [
    "FORMAT_FIELDS",
    "TRACE_FORMATS",
    "TraceFormatError",
    "TraceOrderWarning",
    "TraceWarning",
    "detect_trace_format",
    "expected_hit_tokens",
    "read_trace",
]
