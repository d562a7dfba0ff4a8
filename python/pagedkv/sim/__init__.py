"""The serving simulator behind `python -m pagedkv simulate`.

One idea per module:

- `requests`: the `Request` and `Workload` values and the deterministic "sampled" tokens;
- `workloads`: the built-in seeded workloads (shared system prompts, multi-turn chats,
  parallel sampling, beam search, long documents, Poisson arrivals);
- `trace`: real traces: the format detected or named, and the hit count an unlimited cache
  would reach; `trace_mooncake`, `trace_bailian`, `trace_counts` (Azure, BurstGPT): one
  reader per format; `trace_common`: what they share;
- `scheduler`: a small continuous-batching scheduler that drives any manager (chunked prefill
  under a per-step token budget, speculative decoding, aborts, preemption);
- `observer`: what the scheduler tells an observer of what it schedules;
- `record`: the scheduler's own record of the blocks it scheduled, behind `--check`;
- `calls`: the timed (and optionally recorded) manager calls, and recorded-trace replay;
- `report`: the figures of a run, the summary and sweep tables, the JSON file;
- `glossary`: every term the output prints, explained (the epilog of `simulate --help`);
- `plot`, `plot_mrc`: the figure (matplotlib, imported only when asked for);
- `progress`: a tiny progress bar, and progress lines of several runs for logs;
- `outputs`: `--json` and `--plot` checked before the run;
- `models`: built-in model shapes, vLLM's KV-cache groups for them, bytes per block;
- `kv_bytes`: what a block weighs, so that block counts print as GiB;
- `factory`: the one place a manager is built (Rust or reference, with or without groups);
- `model_run`, `model_report`: `--model`: the model's groups against all-full attention, per
  group, and how it prints; `saving`: the memory saved (at equal memory, at equal hits);
  `hit_limits`: which group cut the hybrid's prefix hits;
- `units`: the size syntax of the options (bytes in KiB or GB, counts with k or Ki);
- `block_keys`, `stack`, `mrc`: `--mrc`: content keys of blocks, exact LRU stack distances,
  the miss-ratio curve of a replay;
- `sizing`, `sizing_report`, `sizing_cli`: the smallest cache for a target hit rate, checked
  by full runs; its output; its options;
- `check_bound`: when a sizing check run can no longer pass (it stops there);
- `sizing_jobs`: `--mrc` from start to end, its runs in parallel processes, Ctrl-C and the
  JSON saved after every run;
- `option_names`: what the commands' options accept, apart from the runs behind them;
- `cli`: the `simulate` command's options and main loop.

Each command's runs are imported when it runs, so that `--mrc-only` on a trace of ids (the
pure cache replay, `sizing_blocks`) imports no scheduler, tier or worker pool.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pagedkv.sim.calls import bind_trace, replay_trace, same_result
    from pagedkv.sim.record import UnscheduledHitError
    from pagedkv.sim.requests import (
        TRACE_BLOCK_TOKENS,
        VOCAB_SIZE,
        Request,
        Workload,
        generated_token,
        generated_tokens,
    )
    from pagedkv.sim.scheduler import ManagerLike, SimResult, run_workload
    from pagedkv.sim.trace import expected_hit_tokens, read_trace
    from pagedkv.sim.workloads import WORKLOADS, build_workload, generate_workload

# The package's names, each imported from its module on first use: importing one `sim`
# module (`python -m pagedkv simulate --mrc-only` needs a few) does not import the
# scheduler, the recorder and the workloads that the others need.
_HOMES = {
    "bind_trace": "calls",
    "replay_trace": "calls",
    "same_result": "calls",
    "UnscheduledHitError": "record",
    "TRACE_BLOCK_TOKENS": "requests",
    "VOCAB_SIZE": "requests",
    "Request": "requests",
    "Workload": "requests",
    "generated_token": "requests",
    "generated_tokens": "requests",
    "ManagerLike": "scheduler",
    "SimResult": "scheduler",
    "run_workload": "scheduler",
    "expected_hit_tokens": "trace",
    "read_trace": "trace",
    "WORKLOADS": "workloads",
    "build_workload": "workloads",
    "generate_workload": "workloads",
}


def __getattr__(name: str) -> object:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'pagedkv.sim' has no attribute {name!r}")
    value = getattr(import_module(f"pagedkv.sim.{home}"), name)
    globals()[name] = value  # found once: later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(__all__)


__all__ = [
    "TRACE_BLOCK_TOKENS",
    "VOCAB_SIZE",
    "WORKLOADS",
    "ManagerLike",
    "Request",
    "SimResult",
    "UnscheduledHitError",
    "Workload",
    "bind_trace",
    "build_workload",
    "expected_hit_tokens",
    "generate_workload",
    "generated_token",
    "generated_tokens",
    "read_trace",
    "replay_trace",
    "run_workload",
    "same_result",
]
