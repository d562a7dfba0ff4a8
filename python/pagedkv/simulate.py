"""Compatibility module: the simulator now lives in the `pagedkv.sim` package.

`from pagedkv.simulate import generate_workload, run_workload, ...` keeps working; run the
simulator with `python -m pagedkv simulate`.
"""

from __future__ import annotations

from pagedkv.sim import (
    VOCAB_SIZE,
    ManagerLike,
    Request,
    SimResult,
    Workload,
    bind_trace,
    build_workload,
    generate_workload,
    generated_token,
    generated_tokens,
    read_trace,
    replay_trace,
    run_workload,
    same_result,
)

__all__ = [
    "VOCAB_SIZE",
    "ManagerLike",
    "Request",
    "SimResult",
    "Workload",
    "bind_trace",
    "build_workload",
    "generate_workload",
    "generated_token",
    "generated_tokens",
    "read_trace",
    "replay_trace",
    "run_workload",
    "same_result",
]
