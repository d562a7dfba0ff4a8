"""Eviction policies side by side (`simulate --eviction lru,s3fifo,...`): one workload, one
configuration, one run per policy.

Each policy's run is the plain run of `simulate` with only `eviction=` changed
(`BlockManagerConfig.eviction`, docs/eviction.md), and reports the plain run's figures
(`sim.report.figures`): the hit rate of every allocation, the workload's own hit rate (prefix
hits over the workload's prompt tokens, prompts recomputed after a preemption left out: what
the policy bought), evictions and preemptions. One run (LRU's, or the first policy's without
LRU) also records its stream of lookups and touches, and Belady's offline optimum under the
prefix constraint over it is the bound beside every policy (`policies_bound`). The manager
time is the ablations' measure (`sim.ablate_timing`): the run's calls recorded, replayed on a
fresh manager of the same configuration and timed in CPU time, best of `repeats`, so that the
policies compare on the manager's own work and not on a busy machine's wall clock.

Requests that carry a cache salt (a tenant: the salted requests of the built-in workloads) are
also counted per salt (`TenantTally`), with the same two measures restricted to each salt's
requests; unsalted requests are the tenant None. The per-salt counts add up to the run's.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, cast

import numpy as np
import numpy.typing as npt

from pagedkv.config import EVICTIONS, BlockManagerConfig, Eviction
from pagedkv.sim.ablate_timing import CallLog, replay_cpu
from pagedkv.sim.factory import make_manager
from pagedkv.sim.fan_out import FanOut
from pagedkv.sim.kv_bytes import KVBytes
from pagedkv.sim.mrc_fast import FastMRCRecorder
from pagedkv.sim.policies_bound import stream_bound
from pagedkv.sim.report import add_memory, figures
from pagedkv.sim.requests import Workload
from pagedkv.sim.scheduler import ManagerLike, run_workload


def parse_policies(text: str) -> list[Eviction]:
    """`lru,s3fifo` -> `["lru", "s3fifo"]`; raises ValueError naming an unknown, empty or
    repeated policy (and the accepted names)."""
    items = [t.strip() for t in text.split(",")]
    accepted = ", ".join(EVICTIONS)
    for t in items:
        if not t:
            raise ValueError(f"empty policy in {text!r}; accepted: {accepted}")
        if t not in EVICTIONS:
            raise ValueError(f"unknown eviction policy {t!r} in {text!r}; accepted: {accepted}")
    seen: set[str] = set()
    for t in items:
        if t in seen:
            raise ValueError(f"eviction policy {t!r} given twice in {text!r}")
        seen.add(t)
    return [cast(Eviction, t) for t in items]


@dataclass(slots=True)
class TenantCounts:
    """One salt's prompt tokens and hits, with the part of each that recomputes made."""

    prompt_tokens: int = 0
    hit_tokens: int = 0
    recomputed_tokens: int = 0
    recomputed_hit_tokens: int = 0

    def as_dict(self, tenant: str | None) -> dict[str, Any]:
        workload_tokens = self.prompt_tokens - self.recomputed_tokens
        workload_hits = self.hit_tokens - self.recomputed_hit_tokens
        return {
            "tenant": tenant,
            "prompt_tokens": self.prompt_tokens,
            "prefix_hit_tokens": self.hit_tokens,
            "prefix_hit_rate": self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0,
            "recomputed_tokens": self.recomputed_tokens,
            "recomputed_hit_tokens": self.recomputed_hit_tokens,
            "workload_prompt_tokens": workload_tokens,
            "workload_hit_tokens": workload_hits,
            "workload_hit_rate": workload_hits / workload_tokens if workload_tokens else 0.0,
        }


class TenantTally:
    """A scheduler observer (`sim.observer.ScheduleObserver`) that counts the admissions'
    prompt tokens and hits per cache salt.

    It counts what the scheduler counts in `SimResult`: every admission's tokens and hit, and
    as recomputed those of a sequence admitted before (preempted and recomputed) or made by a
    fork (its tokens were its parent's admission). Only plain runs: a fork made by copying
    (the ablation's `fork_copies`) would be counted here and not there."""

    def __init__(self) -> None:
        self.counts: dict[str | None, TenantCounts] = {}
        self._admitted: set[int] = set()

    def allocate(
        self,
        seq_id: int,
        token_ids: npt.NDArray[np.uint32],
        hit_tokens: int,
        scheduled: int,
        *,
        cache_salt: str | bytes | None = None,
        lora_id: int | None = None,
    ) -> None:
        del scheduled, lora_id
        key = cache_salt.decode() if isinstance(cache_salt, bytes) else cache_salt
        c = self.counts.setdefault(key, TenantCounts())
        n = len(token_ids)
        c.prompt_tokens += n
        c.hit_tokens += hit_tokens
        if seq_id in self._admitted:
            c.recomputed_tokens += n
            c.recomputed_hit_tokens += hit_tokens
        self._admitted.add(seq_id)

    def fork(self, parent_id: int, child_id: int) -> None:
        del parent_id
        self._admitted.add(child_id)

    def extend(self, seq_id: int, num_new_tokens: int) -> None:
        pass

    def append(self, seq_id: int, token_ids: npt.NDArray[np.uint32]) -> None:
        pass

    def decode(self, seq_ids: list[int], token_ids: npt.NDArray[np.uint32]) -> None:
        pass

    def swap_out(self, seq_id: int) -> None:
        pass

    def swap_in(self, seq_id: int) -> None:
        pass

    def free(self, seq_id: int) -> None:
        pass

    def rows(self) -> list[dict[str, Any]]:
        """One dict per salt (`TenantCounts.as_dict`), unsalted first, then by name."""
        keys = sorted(self.counts, key=lambda k: (k is not None, k or ""))
        return [self.counts[k].as_dict(k) for k in keys]


def run_policy(
    workload: Workload,
    config: BlockManagerConfig,
    policy: Eviction,
    schedule: dict[str, Any],
    *,
    kv: KVBytes | None = None,
    check: bool = False,
    repeats: int = 1,
    bound: bool = False,
    progress: Callable[[int, int], None] | None = None,
) -> dict[str, Any]:
    """One run of `workload` with `config` under eviction `policy`: the run's figures
    (`sim.report.figures`), `eviction`, `tenants` (per salt, `TenantTally.rows`) and the
    manager time of its calls replayed (`policy_manager_seconds`, `allocate_mean_seconds`);
    with `bound`, also `bound` (`policies_bound.stream_bound` over this run's stream).
    `progress(ended requests, requests)` after each step of the replay."""
    config = replace(config, eviction=policy)
    manager = make_manager(config)
    log = CallLog(manager)
    tally = TenantTally()
    recorder = FastMRCRecorder(config.block_size) if bound else None
    watch = FanOut([tally, recorder]) if recorder is not None else tally
    result = run_workload(
        cast(ManagerLike, log), workload, **schedule, check=check, watch=watch, progress=progress
    )
    if check:
        manager.check_invariants()
    f = figures(
        result,
        config,
        manager="rust",
        workload=workload.describe(),
        ms_per_step=workload.ms_per_step,
    )
    add_memory(f, kv)
    t = replay_cpu(config, log.calls, repeats)
    f["eviction"] = policy
    f["tenants"] = tally.rows()
    f["timing"] = f"CPU time of the calls replayed, best of {max(1, repeats)}"
    f["policy_manager_seconds"] = t.seconds
    f["allocate_calls"] = t.allocate_calls
    f["allocate_mean_seconds"] = t.allocate_mean_seconds
    if recorder is not None:
        f["bound"] = stream_bound(recorder, config.num_blocks, policy)
    return f


def run_policies(
    workload: Workload,
    config: BlockManagerConfig,
    policies: Sequence[Eviction],
    schedule: dict[str, Any],
    *,
    kv: KVBytes | None = None,
    check: bool = False,
    repeats: int = 1,
    progress: Callable[[str], None] | None = None,
    done: list[dict[str, Any]] | None = None,
    steps: Callable[[str, int, int], None] | None = None,
) -> list[dict[str, Any]]:
    """`run_policy` for each of `policies`, in order, the bound recorded in LRU's run (the
    first policy's without LRU): `progress(policy)` before each, `steps(policy, ended
    requests, requests)` after each step of its replay. Each finished run is appended to
    `done` (a fresh list if None) as soon as it ends, so that a caller interrupted midway
    (Ctrl-C) still has the runs that finished; returns it."""
    runs = [] if done is None else done
    source = "lru" if "lru" in policies else policies[0] if policies else None
    for policy in policies:
        if progress is not None:
            progress(policy)
        step = None if steps is None else functools.partial(steps, policy)
        runs.append(
            run_policy(
                workload,
                config,
                policy,
                schedule,
                kv=kv,
                check=check,
                repeats=repeats,
                bound=policy == source,
                progress=step,
            )
        )
    return runs


__all__ = [
    "TenantCounts",
    "TenantTally",
    "parse_policies",
    "run_policies",
    "run_policy",
]
