"""Generated tokens per second of vLLM's CPU engine, stock against pagedkv's scheduler
(`PAGEDKV_VLLM_SCHEDULER=1`), at several numbers of concurrent sequences, side by side.

    python benches/engine_throughput.py --seqs 64 256 1024 --rounds 3 --out results.json

Needs vLLM's CPU build (docs/vllm.md, "On a machine without a GPU"). Each measurement is a
fresh process (one engine per process; vLLM loads its plugins once per process) running the
engine core in-process with one OpenMP thread, so both kinds get the same machine; kinds
alternate, the first of a round alternating too (stock, pagedkv, pagedkv, stock, ...), and
each process times `LLM.generate` of all sequences at once
(max_num_seqs = the sequence count, prompts of 72 to 159 tokens with a 64-token shared prefix
among groups of 8, 64 generated tokens each, greedy), after a warm-up generate: three timed
passes over an emptied prefix cache, the fastest kept; the median over rounds is reported,
per wall-clock second and per second of the process's CPU time (the engine runs in the
process with one OpenMP thread: on a shared machine the wall clock also counts the time other
jobs held the CPU, the CPU clock does not), and the scheduler's own thread CPU time per
generated token (`schedule` and `update_from_output`, which hold the KV-cache manager: the
only code that differs between the two engines).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GEN_TOKENS = 64
REPEATS = 3


def _time_scheduler(scheduler: object) -> list[float]:
    """Wrap the scheduler's two per-step calls to add their thread CPU time to the returned
    cell (one clock read before and after each call, two calls a step)."""
    spent = [0.0]
    for name in ("schedule", "update_from_output"):
        fn = getattr(scheduler, name)

        def timed(*args: object, _fn: object = fn, **kwargs: object) -> object:
            t = time.thread_time()
            try:
                return _fn(*args, **kwargs)  # type: ignore[operator]
            finally:
                spent[0] += time.thread_time() - t

        setattr(scheduler, name, timed)
    return spent


def _child(model: str, seqs: int) -> None:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from vllm import LLM, SamplingParams
    from vllm_engine import prompts

    llm = LLM(
        model=model,
        skip_tokenizer_init=True,
        block_size=32,
        enable_prefix_caching=True,
        dtype="float32",
        max_model_len=512,
        seed=0,
        enforce_eager=True,
        max_num_seqs=seqs,
        max_num_batched_tokens=max(8192, 2 * seqs),
    )
    batch = prompts.shared_prefixes(seed=seqs, groups=seqs // 8, per_group=8, prefix=64)
    params = SamplingParams(max_tokens=GEN_TOKENS, temperature=0.0, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p} for p in batch[:8]], params, use_tqdm=False)
    # Several timed passes, the fastest kept: on a shared machine one pass of a few seconds
    # swung 3x between two runs of the same kind. The cache is reset before each pass so
    # that every pass does the same work.
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    sched_cpu = _time_scheduler(scheduler)
    rates, cpu_rates, sched_per_token = [], [], []
    for _ in range(REPEATS):
        llm.reset_prefix_cache()
        sched_cpu[0] = 0.0
        start, cpu_start = time.perf_counter(), time.process_time()
        out = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
        elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu_start
        generated = sum(len(o.outputs[0].token_ids) for o in out)
        rates.append(generated / elapsed)
        cpu_rates.append(generated / cpu)
        sched_per_token.append(sched_cpu[0] / generated)
    sched = type(scheduler).__module__
    print(
        json.dumps(
            {
                "tokens_per_s": max(rates),
                # Per second of this process's CPU time (the engine runs in it, one OpenMP
                # thread): what the engine does with the CPU it gets, which other jobs on a
                # shared machine move far less than the wall clock.
                "tokens_per_cpu_s": max(cpu_rates),
                # The only code that differs between the two engines: the scheduler with its
                # KV-cache manager (`schedule` and `update_from_output`), thread CPU time per
                # generated token, least of the passes.
                "scheduler_cpu_us_per_token": min(sched_per_token) * 1e6,
                "generated": generated,
                "scheduler_module": sched,
            }
        )
    )


def _measure(model: str, seqs: int, kind: str) -> dict[str, float]:
    env = dict(os.environ)
    env.pop("PAGEDKV_VLLM_SCHEDULER", None)
    if kind == "pagedkv":
        env["PAGEDKV_VLLM_SCHEDULER"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(ROOT / "testing"), env.get("PYTHONPATH", "")) if p
    )
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    proc = subprocess.run(
        [sys.executable, __file__, "--child", model, str(seqs)],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{kind} at {seqs}: {proc.stderr[-3000:]}")
    result: dict[str, float] = json.loads(proc.stdout.strip().splitlines()[-1])
    expected = "pagedkv.vllm.scheduler" if kind == "pagedkv" else "vllm.v1.core.sched.scheduler"
    assert result["scheduler_module"] == expected, result
    return result


def main() -> int:
    if len(sys.argv) == 4 and sys.argv[1] == "--child":
        _child(sys.argv[2], int(sys.argv[3]))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", type=int, nargs="+", default=[64, 256, 1024])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path)
    ns = parser.parse_args()
    sys.path.insert(0, str(ROOT / "testing"))
    from vllm_engine import model

    table = {}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(model.write(Path(tmp) / "m"))
        for seqs in ns.seqs:
            runs: dict[str, list[float]] = {"stock": [], "pagedkv": []}
            cpu_runs: dict[str, list[float]] = {"stock": [], "pagedkv": []}
            sched_runs: dict[str, list[float]] = {"stock": [], "pagedkv": []}
            for r in range(ns.rounds):
                # Which kind goes first alternates (stock, pagedkv, pagedkv, stock, ...): a
                # machine whose load drifts over the minutes then favours neither.
                for kind in ("stock", "pagedkv") if r % 2 == 0 else ("pagedkv", "stock"):
                    got = _measure(model_dir, seqs, kind)
                    runs[kind].append(got["tokens_per_s"])
                    cpu_runs[kind].append(got["tokens_per_cpu_s"])
                    sched_runs[kind].append(got["scheduler_cpu_us_per_token"])
            med = {k: statistics.median(v) for k, v in runs.items()}
            cpu_med = {k: statistics.median(v) for k, v in cpu_runs.items()}
            sched_med = {k: statistics.median(v) for k, v in sched_runs.items()}
            table[seqs] = {
                "runs": runs,
                "median": med,
                "ratio": med["pagedkv"] / med["stock"],
                "cpu_runs": cpu_runs,
                "cpu_median": cpu_med,
                "cpu_ratio": cpu_med["pagedkv"] / cpu_med["stock"],
                "scheduler_cpu_us_per_token": sched_runs,
                "scheduler_median": sched_med,
            }
            print(
                f"{seqs:5d} seqs: stock {med['stock']:8.1f} tok/s, pagedkv "
                f"{med['pagedkv']:8.1f} tok/s, pagedkv/stock {table[seqs]['ratio']:.3f}; "
                f"per CPU-second stock {cpu_med['stock']:8.1f}, pagedkv "
                f"{cpu_med['pagedkv']:8.1f}, pagedkv/stock {table[seqs]['cpu_ratio']:.3f}"
                f"; scheduler CPU per token stock {sched_med['stock']:.1f} us, pagedkv "
                f"{sched_med['pagedkv']:.1f} us (runs: {runs}; CPU: {cpu_runs}; scheduler: "
                f"{sched_runs})",
                flush=True,
            )
    if ns.out:
        ns.out.write_text(json.dumps(table, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
