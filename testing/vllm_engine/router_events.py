"""The real engine's KV event stream into `pagedkv.router.RouterIndex`, as JSON.

Run as `python -m vllm_engine.router_events --model DIR --out FILE` in a process of its own
(one CPU engine a process). Stock vLLM with its own ZMQ publisher turned on
(`kv_events_config`, integer hashes), the engine core in this process
(`VLLM_ENABLE_V1_MULTIPROCESSING=0`) so that its block pool can be read; the index follows
the publisher's endpoints (`RouterIndex.follow`) while the engine generates prompts with
shared prefixes in a pool small enough to evict. Recorded, after each round once the
follower has caught up: the engine's cached block hashes and the index's blocks; and for
probe prompts, the index's leading blocks for the prompt's hashes (vLLM's own hash function)
against the engine's `num_cached_tokens` when the prompt is then run.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import time
import traceback
from pathlib import Path
from typing import Any

from vllm_engine.offline import _llm, _scheduler
from vllm_engine.prompts import BLOCK, tokens

NUM_BLOCKS = 40  # a small pool: the rounds below store more blocks than it holds
ENGINE = "vllm"


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def engine_blocks(llm: Any) -> set[int]:
    """The engine's cached blocks: its block pool's hash map, as the events' integer hashes."""
    from vllm.v1.core.kv_cache_utils import get_block_hash, maybe_convert_block_hash

    pool = _scheduler(llm).kv_cache_manager.block_pool
    return {
        int(maybe_convert_block_hash(get_block_hash(k)))
        for k in pool.cached_block_hash_to_block._cache
    }


def prompt_hashes(llm: Any, prompt: list[int]) -> list[int]:
    """The prompt's full blocks' hashes with the engine's own function and settings."""
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import hash_block_tokens, maybe_convert_block_hash

    algo = llm.llm_engine.vllm_config.cache_config.prefix_caching_hash_algo
    fn = get_hash_fn_by_name(algo)
    out, parent = [], None
    for i in range(len(prompt) // BLOCK):
        parent = hash_block_tokens(fn, parent, prompt[i * BLOCK : (i + 1) * BLOCK], None)
        out.append(int(maybe_convert_block_hash(parent)))
    return out


def index_blocks(ix: Any) -> set[int]:
    return {h for m, g, _ in ix.holder_sizes(ENGINE) for h in ix.blocks(ENGINE, m, g)}


def caught_up(llm: Any, ix: Any, timeout: float = 10.0) -> bool:
    """Wait until the index holds the engine's blocks (the stream is asynchronous)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if index_blocks(ix) == engine_blocks(llm):
            return True
        time.sleep(0.05)
    return False


def run(model: Path) -> dict[str, Any]:
    from vllm.config import KVEventsConfig

    from pagedkv.router import RouterIndex
    from vllm import SamplingParams

    pub, replay = _port(), _port()
    cfg = KVEventsConfig(
        enable_kv_cache_events=True,
        publisher="zmq",
        endpoint=f"tcp://*:{pub}",  # a wildcard: vLLM's publisher binds it (else connects)
        replay_endpoint=f"tcp://127.0.0.1:{replay}",
    )
    llm = _llm(
        model,
        "stock",
        kv_events_config=cfg,
        num_gpu_blocks_override=NUM_BLOCKS,
        max_model_len=16 * BLOCK,
    )
    ix = RouterIndex(block_size=BLOCK)
    f = ix.follow(ENGINE, f"tcp://127.0.0.1:{pub}", f"tcp://127.0.0.1:{replay}")
    time.sleep(0.5)  # the subscription reaches the publisher before the first event
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    rng = random.Random(5)
    heads = [tokens(rng, 3 * BLOCK) for _ in range(4)]
    rounds: list[dict[str, Any]] = []
    probes: list[dict[str, Any]] = []
    evicted_seen = 0
    earlier: list[list[int]] = []
    for r in range(4):
        batch = [
            heads[(r + i) % 4] + tokens(rng, rng.randrange(BLOCK, 3 * BLOCK)) for i in range(6)
        ]
        before = engine_blocks(llm)
        llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
        synced = caught_up(llm, ix)
        now = engine_blocks(llm)
        evicted_seen += len(before - now)
        rounds.append(
            {
                "synced": synced,
                "engine": len(now),
                "index": len(index_blocks(ix)),
                "only_engine": len(now - index_blocks(ix)),
                "only_index": len(index_blocks(ix) - now),
            }
        )
        # Probes: a head with a new tail; a stranger; a prompt of this round and one of an
        # earlier round, each with a new token (their blocks cached, or some evicted).
        earlier.extend(batch)
        for p in (
            heads[r % 4] + tokens(rng, 2 * BLOCK + 5),
            tokens(rng, 2 * BLOCK + 3),
            [*batch[-1], *tokens(rng, 1)],
            [*earlier[0], *tokens(rng, 1)],
        ):
            hashes = prompt_hashes(llm, p)
            predicted = ix.scores(hashes).get(ENGINE, 0)
            out = llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)[0]
            probes.append(
                {
                    "predicted_blocks": predicted,
                    "cap_blocks": (len(p) - 1) // BLOCK,
                    "num_cached_tokens": out.num_cached_tokens,
                }
            )
            caught_up(llm, ix)
    stats = ix.stats()
    result = {
        "rounds": rounds,
        "probes": probes,
        "evicted": evicted_seen,
        "follower": {"batches": f.batches, "lost": f.lost, "bad_payloads": f.bad_payloads},
        "index": {"rejected_payloads": stats.rejected_payloads, "orphans": stats.orphans},
    }
    ix.close()
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, type=Path)
    parser.add_argument("--out", required=True, type=Path)
    ns = parser.parse_args(argv)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ["VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES"] = "1"
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        result: dict[str, Any] = run(ns.model)
    except Exception as exc:
        result = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
    import pagedkv

    result["pagedkv"] = pagedkv.__file__
    ns.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
