"""The request trace the simulator tests replay: the shared Mooncake trace when it is there
(`../shared/traces/`, beside the checkout, as on the project's machines and CI), else a
trace of the same format and shape written by the test run itself.

The shared trace is read by path and never committed. A checkout without it still runs
every test that reads a trace, on a synthetic one: conversations that grow turn by turn
(each turn's `hash_ids` continue its previous turn's, 512-token blocks), interleaved, with
a few long single-shot prompts, so that prefix hits, eviction and aborts happen as they do
on the real trace.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

SHARED_TRACE = (
    Path(__file__).resolve().parents[3] / "shared" / "traces" / "mooncake_synthetic_trace.jsonl"
)
BLOCK = 512  # tokens per hash id in the Mooncake format


def write_synthetic_trace(path: Path, requests: int = 400, seed: int = 0) -> Path:
    """A Mooncake-format trace (timestamp ms, input_length, output_length, hash_ids)."""
    rng = random.Random(seed)
    next_id = 0
    conversations: list[list[int]] = []
    lines = []
    t = 0
    for _ in range(requests):
        t += rng.randint(0, 400)
        if conversations and rng.random() < 0.7:
            ids = rng.choice(conversations)
        else:
            ids = []
            conversations.append(ids)
        grow = rng.randint(1, 6) if ids else rng.randint(2, 30)
        ids.extend(range(next_id, next_id + grow))
        next_id += grow
        length = len(ids) * BLOCK - rng.randint(0, BLOCK - 1)
        out = rng.randint(1, 40)
        lines.append(
            json.dumps(
                {"timestamp": t, "input_length": length, "output_length": out, "hash_ids": ids}
            )
        )
    path.write_text("\n".join(lines) + "\n")
    return path


def trace_path(tmp_dir: Path) -> Path:
    """The shared trace if present (or the file `PAGEDKV_MOONCAKE_TRACE` names: a checkout
    elsewhere than beside `shared/`), else a synthetic one written into `tmp_dir`."""
    named = os.environ.get("PAGEDKV_MOONCAKE_TRACE")
    if named:
        return Path(named)
    if SHARED_TRACE.exists():
        return SHARED_TRACE
    return write_synthetic_trace(tmp_dir / "synthetic_mooncake_trace.jsonl")
