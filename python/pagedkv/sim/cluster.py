"""Several serving nodes behind a router, over one tier they share (docs/cluster.md).

Each node has its own GPU cache (a block manager of the run's configuration) and its own
scheduler (`scheduler.SteppedScheduler`, the scheduler of a single run). The nodes advance
in lock-step on the workload's clock: at each step the requests that arrive are routed
(`sim.router`), one by one, then every node with work runs one step, in node order (so a
block node 0 demotes in a step is in the store when node 1 allocates in the same step). A
chat turn that waits on an earlier turn arrives `delay` steps after that turn ended, on
whichever node served it, and is routed afresh.

Below the GPUs (`tier`):

- ``shared``: one store for all nodes, which all put their evicted blocks into and all read
  from (`sim.cluster_tier.TieredNode`): a `HostTier` of `tier_blocks` blocks in this
  process, or with `remote` a `RemoteTier` on a Redis-protocol server, every node in the
  same namespace and with the same MAC secret (the run's own, so no other run's entry is
  ever read);
- ``per-node``: each node a store of its own (`tier_blocks // nodes` blocks each in this
  process: the same memory in all; with `remote`, a namespace per node on the server);
- ``off``: no tier; evicted blocks are gone.
"""

from __future__ import annotations

import heapq
import secrets
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, cast

import numpy as np
import numpy.typing as npt

from pagedkv.config import BlockManagerConfig
from pagedkv.sim.cluster_index import ClusterIndex, index_routing_available
from pagedkv.sim.cluster_tier import MAX_NODES, TieredNode, entry_bytes
from pagedkv.sim.factory import make_manager
from pagedkv.sim.option_names import REMOTE_TTL, TIER_MODES
from pagedkv.sim.requests import Request, Workload
from pagedkv.sim.router import ROUTINGS, Router, RouterStats
from pagedkv.sim.scheduler import ManagerLike, SimResult, SteppedScheduler
from pagedkv.tiers.base import TierStore

_NO_TOKENS: npt.NDArray[np.uint32] = np.zeros(0, dtype=np.uint32)


@dataclass(frozen=True, slots=True)
class ClusterOptions:
    """The cluster: nodes, routing and the tier below the GPUs (module docstring)."""

    nodes: int
    routing: str = "round-robin"
    tier: str = "shared"
    tier_blocks: int | None = None  # the in-process store(s), blocks in all
    remote: str | None = None
    prefix_balance: float = 0.0  # `sim.router`: 0 turns the guard off
    remote_timeout: float = 0.5  # seconds a Redis reply may take (`RemoteTier`'s `timeout`)
    remote_cleanup: bool = False  # delete the run's keys from the server at the end

    def __post_init__(self) -> None:
        if isinstance(self.nodes, bool) or not isinstance(self.nodes, int):
            raise TypeError(f"nodes must be an int, got {self.nodes!r}")
        if not 1 <= self.nodes <= MAX_NODES:
            raise ValueError(f"--nodes must be in [1, {MAX_NODES}], got {self.nodes}")
        if self.routing not in ROUTINGS:
            raise ValueError(
                f"unknown --routing {self.routing!r}: accepted values are {', '.join(ROUTINGS)}"
            )
        if self.tier not in TIER_MODES:
            raise ValueError(
                f"unknown --cluster-tier {self.tier!r}: accepted values are {', '.join(TIER_MODES)}"
            )
        if not self.remote_timeout > 0:
            raise ValueError(f"--remote-timeout must be > 0 seconds, got {self.remote_timeout}")
        if self.remote_cleanup and self.remote is None:
            raise ValueError("--remote-cleanup needs --remote")
        if self.prefix_balance < 0 or (self.prefix_balance and self.routing != "prefix"):
            raise ValueError("--prefix-balance is a number >= 0, for --routing prefix only")
        if self.tier == "off":
            if self.remote is not None:
                raise ValueError(
                    "--remote names the tier below the GPUs: not with --cluster-tier off"
                )
            return
        if self.remote is not None:
            if self.tier_blocks is not None:
                raise ValueError(
                    "--shared-tier-bytes sizes the in-process store; a --remote server's "
                    "memory is its own (maxmemory)"
                )
            return
        if self.tier_blocks is None:
            raise ValueError("an in-process tier needs its size (--shared-tier-bytes)")
        if self.tier_blocks < self.nodes:
            raise ValueError(
                f"the tier holds {self.tier_blocks} blocks: fewer than one per node "
                f"({self.nodes}); give a larger --shared-tier-bytes"
            )

    def describe(self) -> str:
        if self.tier == "off":
            below = "no tier below the GPUs"
        else:
            where = (
                f"Redis {self.remote}"
                if self.remote is not None
                else f"{self.tier_blocks} blocks in this process"
            )
            below = (
                f"one tier shared by all nodes ({where})"
                if self.tier == "shared"
                else f"a tier per node ({where}{', split evenly' if self.remote is None else ''})"
            )
        balance = f", balance guard {self.prefix_balance:g}" if self.prefix_balance else ""
        return f"{self.nodes} nodes, routing {self.routing}{balance}; {below}"


def build_stores(options: ClusterOptions, block_size: int) -> list[TierStore]:
    """The store of each node (the same object for every node when shared); [] when off."""
    if options.tier == "off":
        return []
    from pagedkv.tiers.entry import Namespace

    run = uuid.uuid4().hex
    secret = secrets.token_bytes(32)  # the run's: every node has it, no other run does

    def namespace(tenant: str) -> Namespace:
        return Namespace("pagedkv-sim-cluster", "origin-node", "uint16", block_size, tenant)

    def store(tenant: str, blocks: int | None) -> TierStore:
        from pagedkv.tiers.factory import StoreSpec, build_stores

        if options.remote is not None:
            spec = StoreSpec(
                redis_url=options.remote,
                secret=secret,
                ttl=REMOTE_TTL,
                timeout=options.remote_timeout,
            )
        else:
            assert blocks is not None
            spec = StoreSpec(host_bytes=blocks * entry_bytes(), host_secret=secret)
        (one,) = build_stores(spec, namespace(tenant))
        return one

    if options.tier == "shared":
        one = store(f"cluster-{run}", options.tier_blocks)
        return [one] * options.nodes
    per = None if options.tier_blocks is None else options.tier_blocks // options.nodes
    return [store(f"cluster-{run}-node-{i}", per) for i in range(options.nodes)]


class ClusterNode:
    """One serving node: its manager, what its scheduler calls, its scheduler, what it was
    routed (`sim.router.NodeView`)."""

    def __init__(
        self,
        index: int,
        config: BlockManagerConfig,
        store: TierStore | None,
        schedule: dict[str, Any],
        *,
        seed: int = 0,
        check: bool = False,
    ) -> None:
        if store is not None:
            config = replace(config, record_evictions=True)
        self.index = index
        self.manager: Any = make_manager(config)
        self.tiered = (
            None
            if store is None
            else TieredNode(self.manager, store, node=index, hash_algo=config.hash_algo)
        )
        view = self.manager if self.tiered is None else cast(ManagerLike, self.tiered)
        self.sched = SteppedScheduler(view, seed=seed, check=check, **schedule)
        self.requests = 0
        self.prompt_tokens = 0
        self.routed_ids: set[int] = set()

    def load(self) -> tuple[int, int]:
        return self.sched.load()

    def cached_prefix(self, tokens: npt.NDArray[np.uint32], cache_salt: str | None) -> int:
        hit: int = self.manager.lookup(tokens, cache_salt=cache_salt)
        return hit

    def submit(self, r: Request) -> None:
        self.requests += 1
        self.prompt_tokens += r.prompt_len
        self.routed_ids.add(r.request_id)
        self.sched.submit(r)


@dataclass
class ClusterRun:
    """What a cluster run produced: per node its scheduler's result and the figures of its
    tier (None without one) and what it was routed; the router's decisions; each store's
    stats (one when shared)."""

    options: ClusterOptions
    config: BlockManagerConfig
    results: list[SimResult]
    tiers: list[dict[str, Any] | None]
    routed_requests: list[int]
    routed_prompt_tokens: list[int]
    router: RouterStats
    routed_ids: list[set[int]] = field(default_factory=list)
    stores: list[dict[str, Any]] = field(default_factory=list)
    clock_steps: int = 0
    index: dict[str, Any] | None = None  # the router index's figures (`--routing prefix`)


def run_cluster(
    workload: Workload,
    config: BlockManagerConfig,
    options: ClusterOptions,
    schedule: dict[str, Any],
    *,
    check: bool = False,
    progress: Callable[[int, int], None] | None = None,
) -> ClusterRun:
    """Replay `workload` on the cluster (module docstring). `schedule`: `run_workload`'s
    scheduler options, the same for every node; `check`: `check_invariants()` on every
    node after each of its steps; `progress(ended requests, requests)` after each step."""
    if config.num_cpu_blocks < 0:
        raise ValueError("num_cpu_blocks must be >= 0")
    stores = build_stores(options, config.block_size)
    unique = {id(s): s for s in stores}  # a shared store once
    cleaned: dict[int, int] = {}  # --remote-cleanup: store -> keys deleted
    index = None
    node_config = config
    if options.routing == "prefix" and index_routing_available(config):
        # The router reads the nodes' KV events (sim.cluster_index); recording them changes
        # nothing else a manager does.
        node_config = replace(config, enable_kv_events=True)
        index = ClusterIndex(config, options.nodes)
    try:
        nodes = [
            ClusterNode(
                i,
                node_config,
                stores[i] if stores else None,
                schedule,
                seed=workload.seed,
                check=check,
            )
            for i in range(options.nodes)
        ]
        if check and stores:
            _share_records(nodes)
        router = Router(
            options.routing,
            options.nodes,
            options.prefix_balance,
            prefix_hits=None if index is None else index.hits,
        )
        clock = _replay(workload, config, nodes, router, progress, index)
        store_stats = []
        for s in unique.values():
            st = s.stats()
            remote = s.medium == "REMOTE"
            store_stats.append(
                {
                    "name": st.name,
                    "medium": s.medium,
                    "key_prefix": getattr(s, "key_prefix", None),
                    "ttl_s": REMOTE_TTL if remote else None,
                    "timeout_s": options.remote_timeout if remote else None,
                    "deleted_keys": None,  # set below when --remote-cleanup ran
                    "entries": st.entries,
                    "puts": st.puts,
                    "dropped_puts": st.dropped_puts,
                    "evictions": st.evictions,
                    "gets": st.gets,
                    "hits": st.hits,
                    "misses": st.misses,
                    "corrupt": st.corrupt,
                    "errors": st.errors,
                }
            )
    finally:
        try:
            # Also after a failed or interrupted run: its keys are as much left behind.
            for k, s in unique.items() if options.remote_cleanup else ():
                clear = getattr(s, "clear", None)
                if clear is not None:
                    cleaned[k] = clear()
        finally:
            for s in unique.values():
                closer = getattr(s, "close", None)
                if closer is not None:
                    closer()
    for k, doc in zip(unique, store_stats, strict=True):
        doc["deleted_keys"] = cleaned.get(k)
    return ClusterRun(
        options=options,
        config=config,
        results=[n.sched.result() for n in nodes],
        tiers=[None if n.tiered is None else n.tiered.figures() for n in nodes],
        routed_requests=[n.requests for n in nodes],
        routed_prompt_tokens=[n.prompt_tokens for n in nodes],
        router=router.stats,
        routed_ids=[n.routed_ids for n in nodes],
        stores=store_stats,
        clock_steps=clock,
        index=None if index is None else index.figures(),
    )


class _ClusterMarks(set[bytes]):
    """One node's scheduled block contents (`record.ScheduleRecord.marked`) for `check`: a
    content counts as computed when any node computed it, since a tier hit serves KV that
    another node computed. Each node adds and retracts only its own. (With aborts, a node
    that computed a content some other node computed first and later retracted would be
    told its own hit was never computed: --check with --abort-rate can misfire here.)"""

    def __init__(self, everyone: list[set[bytes]]) -> None:
        super().__init__()
        self.everyone = everyone

    def __contains__(self, key: object) -> bool:
        return any(set.__contains__(s, key) for s in self.everyone)


def _share_records(nodes: list[ClusterNode]) -> None:
    everyone: list[set[bytes]] = []
    for n in nodes:
        record = n.sched.record
        assert record is not None
        record.marked = _ClusterMarks(everyone)
        everyone.append(record.marked)


def _replay(
    workload: Workload,
    config: BlockManagerConfig,
    nodes: list[ClusterNode],
    router: Router,
    progress: Callable[[int, int], None] | None,
    index: ClusterIndex | None = None,
) -> int:
    """The lock-step loop; returns the clock after the last step. With `index`, each
    node's KV events go to the router index after each of its steps."""
    by_id = {r.request_id: r for r in workload.requests}
    arrivals: list[tuple[int, int]] = []
    dependents: dict[int, list[Request]] = {}
    for r in workload.requests:
        if r.after is not None and r.after in by_id:
            dependents.setdefault(r.after, []).append(r)
        else:
            arrivals.append((r.arrival_step, r.request_id))
    heapq.heapify(arrivals)
    prefix = router.policy == "prefix"
    total, ended, clock = len(by_id), 0, 0
    while arrivals or any(n.sched.busy for n in nodes):
        if arrivals and not any(n.sched.busy for n in nodes):
            clock = max(clock, arrivals[0][0])  # skip the idle stretch
        while arrivals and arrivals[0][0] <= clock:
            r = by_id[heapq.heappop(arrivals)[1]]
            # Only prefix routing reads the prompt (a trace's is built from its hash ids).
            tokens = r.prompt if prefix else _NO_TOKENS
            nodes[router.route(nodes, tokens, r.cache_salt)].submit(r)
        for n in nodes:
            if n.sched.busy:
                n.sched.step(clock)
                if index is not None:
                    index.feed(n.index, n.manager)
        for n in nodes:
            for rid in n.sched.take_ended():
                ended += 1
                for d in dependents.pop(rid, ()):
                    heapq.heappush(arrivals, (clock + 1 + d.delay, d.request_id))
        if progress is not None:
            progress(ended, total)
        clock += 1
    return clock


__all__ = [
    "TIER_MODES",
    "ClusterNode",
    "ClusterOptions",
    "ClusterRun",
    "build_stores",
    "run_cluster",
]
