"""Mooncake's trace format (the FAST'25 release: conversation, tool-agent and synthetic traces,
and the earlier arXiv trace, all alike).

One JSON object a line: `timestamp` (arrival, ms from the trace's start), `input_length`,
`output_length`, `hash_ids` (one id per 512-token block of the prompt, the last block possibly
partial). Mooncake's ids already name a block *with its prefix* (the release calls them
"remapped prefix block hashes"): equal ids at the same place mean equal prefixes, so they are
used as they are. Other keys on a line are ignored.
"""

from __future__ import annotations

from pathlib import Path

from pagedkv.sim.requests import TRACE_BLOCK_TOKENS, Request, Workload
from pagedkv.sim.trace_common import TraceBuilder, id_list, int_field, json_lines, salt_field

FIELDS = ("timestamp", "input_length", "output_length", "hash_ids")


def read_mooncake(path: str | Path, *, limit: int | None, ms_per_step: float) -> Workload:
    """The first `limit` requests of a Mooncake trace."""
    b = TraceBuilder(path, ms_per_step, limit)
    for lineno, obj in json_lines(path):
        if b.full:
            break
        where = f"{path}:{lineno}"
        ts = int_field(obj, "timestamp", where)
        n = int_field(obj, "input_length", where)
        out = int_field(obj, "output_length", where)
        ids = id_list(obj, where, n, TRACE_BLOCK_TOKENS)
        b.requests.append(
            Request(
                request_id=len(b.requests),
                prompt_len=n,
                max_new_tokens=max(1, out),  # the prefill yields one token even for 0
                arrival_step=b.step_of(lineno, ts),
                kind="trace",
                hash_ids=ids,
                cache_salt=salt_field(obj, where),
            )
        )
    return b.workload(f"trace {Path(path).name}")


__all__ = ["FIELDS", "read_mooncake"]
