"""Alibaba's Bailian traces (Qwen usage traces, `alibaba-edu/qwen-bailian-usagetraces-anon`).

One JSON object a line: `chat_id` (unique), `parent_chat_id` (the turn before, -1 for a first
turn), `timestamp` (arrival, seconds from the trace's start, fractional), `input_length`,
`output_length`, `type` (text, search, image, file, thinking, ...), `turn` (1, 2, ...) and
`hash_ids`: one id per 16-token block of the prompt, the last block possibly partial. A
follow-up's prompt is the whole request as served (the history kept plus the new text), so its
ids repeat the earlier turns' where the content is the same.

Each Bailian id hashes its 16 tokens *alone*: the same id at two places means the same 16
tokens, not the same prefix. A prefix cache keys a block by everything before it too, so the
reader chains the ids before replay: block `i`'s id becomes a 64-bit chain of ids `0..i`
(`block_keys.chain`, kept to 59 bits so `id * 16 + j` stays below 2^63). Equal id prefixes
give equal chained ids, hence equal pseudo-tokens and prefix hits; an equal block after a
different prefix gets a different id. (Two different prefixes share a chained id with
probability about 2^-59 per pair.)

Dependencies: a follow-up whose parent is an earlier line of the file waits for that request
(`Request.after`), with `delay` 0 and `arrival_step` its own timestamp; the scheduler lets it
arrive at its timestamp, or just after its parent finished if the parent ends later. So the
trace's timing holds as long as the simulated service keeps up, and a follow-up is never sent
before the answer it continues exists. A parent not seen earlier (cut off, or later in the
file) leaves the turn arriving at its timestamp alone (`TraceWarning`, counted).
"""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import numpy.typing as npt

from pagedkv.sim.block_keys import chain
from pagedkv.sim.requests import Request, Workload
from pagedkv.sim.trace_common import (
    TraceBuilder,
    TraceWarning,
    id_list,
    int_field,
    json_lines,
    number_field,
    salt_field,
)

BAILIAN_BLOCK_TOKENS = 16
FIELDS = (
    "chat_id",
    "parent_chat_id",
    "timestamp",
    "input_length",
    "output_length",
    "type",
    "turn",
    "hash_ids",
)
_ROOT = 0x42A11A7  # the chain's start: any fixed value does
_KEEP = np.uint64(64 - 59)  # drop 5 bits: 59-bit ids times 16 plus 15 stay below 2^63


def chain_ids(ids: list[int] | npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
    """Chained ids of a prompt's per-block ids: element `i` stands for ids `0..i` together."""
    a = np.asarray(ids, dtype=np.int64).astype(np.uint64)
    # Spread each id over 64 bits (splitmix64's finaliser) before it enters the chain.
    c = a + np.uint64(0x9E3779B97F4A7C15)
    c = (c ^ (c >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    c = (c ^ (c >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    c = c ^ (c >> np.uint64(31))
    keys, _ = chain(_ROOT, c)
    return (keys >> _KEEP).astype(np.int64)


def read_bailian(path: str | Path, *, limit: int | None, ms_per_step: float) -> Workload:
    """The first `limit` requests of a Bailian trace, ids chained, follow-ups linked."""
    b = TraceBuilder(path, ms_per_step, limit)
    by_chat: dict[int, int] = {}  # chat id -> request id
    orphans: list[int] = []  # lines whose parent is not an earlier line
    for lineno, obj in json_lines(path):
        if b.full:
            break
        where = f"{path}:{lineno}"
        chat = int_field(obj, "chat_id", where)
        parent = int_field(obj, "parent_chat_id", where, low=-1)
        ts = number_field(obj, "timestamp", where)
        n = int_field(obj, "input_length", where)
        out = int_field(obj, "output_length", where)
        kind = obj.get("type", "text")
        if not isinstance(kind, str) or not kind:
            raise ValueError(f"{where}: 'type' must be a non-empty string, got {kind!r}")
        if "turn" in obj:
            int_field(obj, "turn", where, low=1)
        ids = id_list(obj, where, n, BAILIAN_BLOCK_TOKENS)
        if chat in by_chat:
            raise ValueError(f"{where}: chat_id {chat} appears twice (each line is one request)")
        after = by_chat.get(parent) if parent >= 0 else None
        if parent >= 0 and after is None:
            orphans.append(lineno)
        rid = len(b.requests)
        by_chat[chat] = rid
        b.requests.append(
            Request(
                request_id=rid,
                prompt_len=n,
                max_new_tokens=max(1, out),  # the prefill yields one token even for 0
                arrival_step=b.step_of(lineno, ts * 1000.0),
                after=after,
                kind=kind,
                hash_ids=chain_ids(ids),
                hash_block_tokens=BAILIAN_BLOCK_TOKENS,
                cache_salt=salt_field(obj, where),
            )
        )
    workload = b.workload(f"trace {Path(path).name} (Bailian)", unit=" s", scale=1e-3)
    if orphans:
        more = f" and {len(orphans) - 1} more" if len(orphans) > 1 else ""
        warnings.warn(
            f"{path}:{orphans[0]}{more}: the parent_chat_id is not an earlier line of the "
            "file (cut off by --limit, or later in the file), so the turn arrives at its "
            "timestamp without waiting for its parent",
            TraceWarning,
            stacklevel=2,
        )
    return workload


__all__ = ["BAILIAN_BLOCK_TOKENS", "FIELDS", "chain_ids", "read_bailian"]
