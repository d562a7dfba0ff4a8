"""`simulate --nodes N`: the router's policies on nodes in known states, prefix routing
keeping a shared prefix on one node, cross-node hits that only a shared tier gives,
per-node figures adding up to the totals, a one-node cluster equal to a plain run, and the
errors (`sim.cluster`, `sim.router`, `sim.cluster_tier`; docs/cluster.md). Every node is a
real block manager and scheduler; every tier a real `HostTier` (the Redis tests are in
test_sim_cluster_remote.py).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pagedkv.__main__ import main
from pagedkv.config import BlockManagerConfig
from pagedkv.sim.cluster import ClusterNode, ClusterOptions, build_stores, run_cluster
from pagedkv.sim.cluster_report import cluster_figures
from pagedkv.sim.report import figures
from pagedkv.sim.requests import Request, Workload
from pagedkv.sim.router import ROUTINGS, Router
from pagedkv.sim.scheduler import SteppedScheduler, run_workload
from pagedkv.sim.workloads import build_workload

SCHEDULE: dict[str, Any] = {"max_batch": 64, "max_num_batched_tokens": 2048}
SMALL = ["simulate", "--no-progress", "--requests", "60", "--doc-tokens", "2048"]


def _tokens(seed: int, n: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 30_000, n, dtype=np.uint32)


def _req(rid: int, prompt: np.ndarray, *, at: int = 0, out: int = 2) -> Request:
    return Request(
        request_id=rid,
        prompt_len=len(prompt),
        max_new_tokens=out,
        arrival_step=at,
        kind="test",
        prompt_tokens=prompt,
    )


def _nodes(n: int, num_blocks: int = 256) -> list[ClusterNode]:
    cfg = BlockManagerConfig(num_blocks=num_blocks, block_size=16, num_cpu_blocks=0)
    return [ClusterNode(i, cfg, None, SCHEDULE) for i in range(n)]


def _cache(node: ClusterNode, prompt: np.ndarray) -> None:
    """Leave `prompt`'s full blocks in the node's prefix cache (computed, then freed)."""
    seq = 10_000 + node.index
    assert node.manager.allocate(seq, prompt) == 0
    node.manager.free(seq)


# ---- the router, on nodes in known states ----------------------------------------------


def test_round_robin_ignores_load_and_cache() -> None:
    nodes = _nodes(3)
    p = _tokens(1, 64)
    _cache(nodes[2], p)
    nodes[0].submit(_req(0, _tokens(2, 500)))  # node 0 is loaded
    router = Router("round-robin", 3)
    assert [router.route(nodes, p) for _ in range(7)] == [0, 1, 2, 0, 1, 2, 0]
    assert router.stats.routed == [3, 2, 2]


def test_least_loaded_counts_tokens_then_requests_then_index() -> None:
    nodes = _nodes(3)
    nodes[0].submit(_req(0, _tokens(0, 300)))
    nodes[1].submit(_req(1, _tokens(1, 200)))
    nodes[2].submit(_req(2, _tokens(2, 250)))
    router = Router("least-loaded", 3)
    p = _tokens(9, 40)
    _cache(nodes[0], p)  # a cached prefix does not matter to this policy
    assert router.route(nodes, p) == 1  # 200 tokens
    # Equal tokens: fewer requests wins. Node 1: 200 + 100 + 100 (3 requests); node 2: 250
    # + 150 (2 requests); node 0: 300 + 100 (2 requests): node 0 and 2 tie on tokens and
    # requests, the lower index wins.
    nodes[1].submit(_req(3, _tokens(3, 100)))
    nodes[1].submit(_req(4, _tokens(4, 100)))
    nodes[2].submit(_req(5, _tokens(5, 150)))
    nodes[0].submit(_req(6, _tokens(6, 100)))
    assert [n.load() for n in nodes] == [(400, 2), (400, 3), (400, 2)]
    assert router.route(nodes, p) == 0
    nodes[0].submit(_req(7, _tokens(7, 1)))
    assert router.route(nodes, p) == 2


def test_prefix_picks_the_longest_cached_prefix_then_the_least_loaded() -> None:
    nodes = _nodes(3)
    system = _tokens(1, 128)
    prompt = np.concatenate([system, _tokens(2, 64)])
    _cache(nodes[0], system[:32])  # two blocks of the prompt
    _cache(nodes[1], system)  # eight blocks
    _cache(nodes[2], system[:32])
    nodes[1].submit(_req(0, _tokens(3, 900)))  # the longest prefix sits on the busiest node
    router = Router("prefix", 3)
    assert router.route(nodes, prompt) == 1
    assert router.stats.prefix_routed == 1 and router.stats.prefix_tokens == 128
    # Nodes 0 and 2 hold the same two blocks of this one: the less loaded of them.
    other = np.concatenate([system[:32], _tokens(4, 64)])
    nodes[0].submit(_req(1, _tokens(5, 100)))
    assert router.route(nodes, other) == 2
    # Nobody holds any of it: the least loaded node.
    nodes[2].submit(_req(2, _tokens(6, 50)))
    assert router.route(nodes, _tokens(7, 100)) == 2
    nodes[2].submit(_req(3, _tokens(8, 100)))
    assert router.route(nodes, _tokens(9, 100)) == 0
    # A salt keeps a tenant's prompts apart: the same tokens under a salt hit nothing.
    assert nodes[1].cached_prefix(prompt, "tenant") == 0
    assert nodes[1].cached_prefix(prompt, None) == 128


def test_the_balance_guard_passes_over_an_overloaded_node() -> None:
    nodes = _nodes(2, num_blocks=512)
    system = _tokens(1, 64)
    _cache(nodes[0], system)
    nodes[0].submit(_req(0, _tokens(2, 4000)))
    prompt = np.concatenate([system, _tokens(3, 32)])
    assert Router("prefix", 2).route(nodes, prompt) == 0
    guarded = Router("prefix", 2, balance=1.0)
    # Mean load 2000: node 0 (4000) is over 1.0 x 2000 + 96, so node 1 takes it.
    assert guarded.route(nodes, prompt) == 1
    assert guarded.stats.balanced == 1
    assert Router("prefix", 2, balance=3.0).route(nodes, prompt) == 0


# ---- whole cluster runs -----------------------------------------------------------------


def _shared_prefix_workload() -> Workload:
    """Two system prompts, A (ids 0, 2, 4, ...) and B (odd ids), each followed by a question
    of its own; one arrival every three steps, so that the first of each is computed before
    the next arrives."""
    a, b = _tokens(100, 256), _tokens(200, 256)
    reqs = [
        _req(i, np.concatenate([a if i % 2 == 0 else b, _tokens(1000 + i, 48)]), at=3 * i)
        for i in range(24)
    ]
    return Workload(tuple(reqs), 0, name="two system prompts")


def test_prefix_routing_keeps_a_shared_prefix_on_one_node() -> None:
    w = _shared_prefix_workload()
    cfg = BlockManagerConfig(num_blocks=256, block_size=16, num_cpu_blocks=0)
    doc = {}
    for routing in ("round-robin", "prefix"):
        run = run_cluster(w, cfg, ClusterOptions(4, routing, "off"), SCHEDULE)
        doc[routing] = cluster_figures(run)
        homes: dict[int, set[int]] = {0: set(), 1: set()}
        for i, ids in enumerate(run.routed_ids):
            for rid in ids:
                homes[rid % 2].add(i)
        if routing == "prefix":
            assert all(len(h) == 1 for h in homes.values()), homes
        else:
            assert homes == {0: {0, 2}, 1: {1, 3}}
    rr, px = doc["round-robin"]["total"], doc["prefix"]["total"]
    # One miss per system prompt under prefix routing; one per prompt and node otherwise.
    assert px["workload_hit_tokens"] == 22 * 256
    assert rr["workload_hit_tokens"] == 20 * 256
    assert doc["prefix"]["router"]["prefix_routed"] == 22
    # Each system prompt lives on one node only: every one of those was a routing success.
    assert doc["prefix"]["router"]["prefix_won"] == 22
    assert doc["prefix"]["router"]["prefix_everywhere"] == 0


def _cross_node_workload() -> Workload:
    """Node 0 computes a 512-token prefix P, then two long prompts of its own evict P from its
    64-block GPU; later node 1 (round-robin) gets P again: only a shared tier has it."""
    p = _tokens(7, 512)
    reqs = [
        _req(0, np.concatenate([p, _tokens(8, 32)]), at=0, out=1),  # node 0
        _req(1, _tokens(9, 100), at=0, out=1),  # node 1
        _req(2, _tokens(10, 960), at=10, out=1),  # node 0: evicts most of P
        _req(3, _tokens(11, 100), at=10, out=1),  # node 1
        _req(4, _tokens(12, 960), at=15, out=1),  # node 0: evicts the rest
        _req(5, np.concatenate([p, _tokens(13, 32)]), at=25, out=1),  # node 1
    ]
    return Workload(tuple(reqs), 0, name="cross-node")


@pytest.mark.parametrize("tier", ["shared", "per-node", "off"])
def test_only_a_shared_tier_gives_node_b_the_prefix_node_a_computed(tier: str) -> None:
    w = _cross_node_workload()
    cfg = BlockManagerConfig(num_blocks=64, block_size=16, num_cpu_blocks=0)
    blocks = None if tier == "off" else 2000
    run = run_cluster(w, cfg, ClusterOptions(2, "round-robin", tier, blocks), SCHEDULE)
    doc = cluster_figures(run)
    n0, n1 = doc["nodes"]
    assert run.routed_ids == [{0, 2, 4}, {1, 3, 5}]
    assert n0["evictions"] >= 34  # P (and its question) left node 0's GPU
    if tier == "shared":
        assert n1["tier_tokens"] == n1["tier_tokens_cross"] == 512
        assert n1["tier_tokens_by_origin"] == {"0": 512}
        assert n1["workload_hit_tokens"] == 512
        assert doc["total"]["cross_node_hit_rate"] == 512 / w.prompt_tokens
        assert doc["stores"][0]["hits"] == 32
    else:
        assert n1["tier_tokens"] == 0 and n1["workload_hit_tokens"] == 0
        assert doc["total"]["workload_hit_tokens"] == 0
    if tier == "per-node":
        assert len(doc["stores"]) == 2 and doc["stores"][0]["puts"] >= 32


def test_per_node_figures_add_up_to_the_totals() -> None:
    w = build_workload("mixed", 80, seed=3, arrival_rate=2.0, doc_tokens=2048)
    cfg = BlockManagerConfig(num_blocks=160, block_size=16, num_cpu_blocks=16)
    run = run_cluster(
        w, cfg, ClusterOptions(3, "least-loaded", "shared", 300), SCHEDULE, check=True
    )
    doc = cluster_figures(run)
    nodes, total = doc["nodes"], doc["total"]
    for key, value in total.items():
        if not key.endswith("_rate"):
            assert value == pytest.approx(sum(n[key] for n in nodes)), key
    assert total["requests"] == len(w.requests)
    assert total["prompt_tokens"] == w.prompt_tokens
    assert total["finished_requests"] == len(w.requests)
    assert (
        total["workload_hit_rate"] == total["workload_hit_tokens"] / total["workload_prompt_tokens"]
    )
    # The eviction-heavy setting exercised everything being added up.
    assert total["tier_tokens_cross"] > 0 and total["preemptions"] > 0
    for n in nodes:
        assert sum(n["tier_tokens_by_origin"].values()) == n["tier_tokens"]
        assert n["tier_tokens"] + n["recomputed_tier_tokens"] == n["blocks_promoted"] * 16
        assert n["gpu_hit_tokens"] + n["tier_tokens"] == n["workload_hit_tokens"]
    (store,) = doc["stores"]
    assert store["hits"] == total["blocks_promoted"]
    assert store["puts"] == total["blocks_demoted"]


def test_one_node_without_a_tier_is_the_plain_run() -> None:
    w = build_workload("mixed", 60, seed=1, arrival_rate=2.0, doc_tokens=2048)
    cfg = BlockManagerConfig(num_blocks=200, block_size=16, num_cpu_blocks=32)
    from pagedkv.sim.factory import make_manager

    plain = figures(
        run_workload(make_manager(cfg), w, **SCHEDULE), cfg, manager="rust", workload=""
    )
    run = run_cluster(w, cfg, ClusterOptions(1, "round-robin", "off"), SCHEDULE)
    one = figures(run.results[0], cfg, manager="rust", workload="")
    for key in (
        "prefix_hit_tokens",
        "workload_hit_rate",
        "preemptions",
        "evictions",
        "num_steps",
        "clock_steps",
        "forks",
        "generated_tokens",
    ):
        assert one[key] == plain[key], key
    assert plain["preemptions"] > 0


def test_a_stepped_node_rejects_bad_calls() -> None:
    (node,) = _nodes(1)
    r = _req(5, _tokens(1, 40))
    node.submit(r)
    with pytest.raises(ValueError, match="submitted before"):
        node.sched.submit(r)
    with pytest.raises(ValueError, match=r"2\*\*40"):
        node.sched.submit(_req(SteppedScheduler.FORK_IDS, _tokens(1, 8)))
    node.sched.step(3)
    with pytest.raises(ValueError, match="not after"):
        node.sched.step(3)


# ---- the command and its errors ---------------------------------------------------------


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def test_the_command_prints_every_node_and_writes_json(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    js = tmp_path / "c.json"
    rc, out, err = _run(
        capsys,
        *SMALL,
        "--num-blocks",
        "128",
        "--nodes",
        "3",
        "--routing",
        "prefix",
        "--shared-tier-bytes",
        "1GiB",
        "--check",
        "--json",
        str(js),
    )
    assert rc == 0, err
    for needle in ("node 2", "total", "put by another node", "balance", "router ", "store "):
        assert needle in out, out
    assert "512 blocks of 16 tokens" in out  # 1 GiB of llama-3-8b KV: 2 MiB per block
    doc = json.loads(js.read_text())
    assert doc["cluster"]["routing"] == "prefix" and doc["cluster"]["tier_blocks"] == 512
    assert len(doc["nodes"]) == 3 and doc["total"]["requests"] == 60


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--nodes", "0"], "--nodes must be in [1, 65536], got 0"),
        (["--routing", "prefix"], "--routing needs --nodes"),
        (["--nodes", "2", "--mrc"], "does not take --mrc"),
        (["--nodes", "2", "--host-tier-bytes", "1GiB"], "does not take --host-tier-bytes"),
        (["--nodes", "2", "--cluster-tier", "off", "--shared-tier-bytes", "1GiB"], "in-process"),
        (["--nodes", "2", "--cluster-tier", "off", "--remote", "redis://x"], "not with"),
        (["--nodes", "2", "--prefix-balance", "2"], "for --routing prefix only"),
        (
            ["--nodes", "2", "--remote-cleanup"],
            "--remote-timeout and --remote-cleanup need --remote",
        ),
        (["--nodes", "2", "--remote-timeout", "1"], "need --remote"),
        (["--remote-cleanup"], "--remote-cleanup needs --nodes"),
        (
            ["--nodes", "2", "--remote", "redis://127.0.0.1:1", "--remote-timeout", "0"],
            "--remote-timeout must be > 0 seconds, got 0.0",
        ),
        (["--nodes", "4", "--shared-tier-bytes", "4MiB"], "fewer than one per node"),
        (["--nodes", "2", "--block-size", "16,32"], "one configuration"),
        (["--nodes", "2", "--cluster-tier", "off", "--model", "gemma-3-27b"], "KV-cache groups"),
    ],
)
def test_bad_options_are_refused_with_the_reason(
    capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    rc, _, err = _run(capsys, *SMALL, *argv)
    assert rc == 2
    assert message in err, err


@pytest.mark.parametrize(
    ("flag", "accepted"),
    [("--routing", "round-robin, least-loaded, prefix"), ("--cluster-tier", "shared")],
)
def test_unknown_choices_list_the_accepted_values(
    capsys: pytest.CaptureFixture[str], flag: str, accepted: str
) -> None:
    with pytest.raises(SystemExit) as e:
        main([*SMALL, "--nodes", "2", flag, "random"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "invalid choice: 'random'" in err
    assert all(a in err for a in accepted.split(", ")), err


def test_the_library_refuses_bad_values_listing_accepted_ones() -> None:
    with pytest.raises(ValueError, match="accepted values are round-robin, least-loaded, prefix"):
        Router("random", 2)
    with pytest.raises(ValueError, match="accepted values are round-robin, least-loaded"):
        ClusterOptions(2, "random")
    with pytest.raises(ValueError, match="accepted values are shared, per-node, off"):
        ClusterOptions(2, "prefix", "everywhere", 100)
    with pytest.raises(ValueError, match="at least one node"):
        Router("prefix", 0)
    with pytest.raises(ValueError, match=r"--nodes must be in \[1, 65536\], got 0"):
        ClusterOptions(0)
    with pytest.raises(ValueError, match="needs its size"):
        ClusterOptions(2)
    assert ROUTINGS == ("round-robin", "least-loaded", "prefix")
    assert build_stores(ClusterOptions(2, tier="off"), 16) == []


# ---- one node over a store --------------------------------------------------------------


def _tiered(store: Any, node: int, num_blocks: int = 64) -> Any:
    from pagedkv.manager import BlockManager
    from pagedkv.sim.cluster_tier import TieredNode

    m = BlockManager(num_blocks, 16, record_evictions=True)
    return TieredNode(m, store, node=node, hash_algo="sha256")


def _host_store(blocks: int) -> Any:
    (store,) = build_stores(ClusterOptions(1, tier="shared", tier_blocks=blocks), 16)[:1]
    return store


def test_a_node_reads_what_another_put_and_stops_at_a_bad_entry() -> None:
    from pagedkv import hash_blocks
    from pagedkv.tiers.base import TierKey

    store = _host_store(1000)
    a, b = _tiered(store, 0), _tiered(store, 1)
    p = _tokens(3, 512)
    assert a.allocate(1, p) == 0
    a.free(1)
    # A prompt of 64 blocks (the whole GPU) evicts all 32 of p's: they go to the store.
    assert a.allocate(2, _tokens(4, 1023)) == 0
    assert a.blocks_demoted == 32
    prompt = np.concatenate([p, _tokens(5, 40)])
    # Node 1 holds nothing of it on its GPU; can_allocate counts the 32 blocks it will load.
    assert b.m.lookup(prompt) == 0
    assert b.allocate(7, prompt, num_new_tokens=16) == 512
    assert b.m.num_scheduled_tokens(7) == 512 + 16
    assert b.tier_tokens_by_origin == {0: 512}
    assert b.figures()["tier_tokens_cross"] == 512
    # Allocated again (a recomputation after a preemption): counted apart.
    b.free(7)
    b.m.evict_blocks(list(range(64)))  # out of node 1's GPU, so the store serves it again
    assert b.allocate(7, prompt) == 512
    assert b.recomputed_tier_tokens == 512 and b.tier_tokens_by_origin == {0: 512}
    # A damaged entry (not a node index) ends the run: the blocks from it on are computed.
    digests = hash_blocks(prompt, 16)
    store.put(TierKey(0, digests[10]), b"bad")
    c = _tiered(store, 2)
    assert c.allocate(9, prompt) == 10 * 16
    assert c.failed_loads == 1 and c.tier_tokens_by_origin == {0: 160}
    assert c.m.num_scheduled_tokens(9) == len(prompt)


def test_a_nodes_can_allocate_counts_the_blocks_the_store_gives() -> None:
    from pagedkv.alloc_status import AllocStatus

    store = _host_store(1000)
    a, b = _tiered(store, 0), _tiered(store, 1, num_blocks=40)
    p = _tokens(3, 512)
    assert a.allocate(1, p) == 0
    a.free(1)
    a.allocate(2, _tokens(4, 1023))  # p's 32 blocks go to the store
    prompt = np.concatenate([p, _tokens(5, 300)])
    assert b.allocate(3, _tokens(6, 16 * 10)) == 0  # node 1: 30 of 40 blocks left
    # The plain manager sees 1 new block for a 16-token chunk; the node needs 32 more for
    # the blocks it will load: they do not fit next to the running sequence.
    assert b.m.can_allocate(prompt, num_new_tokens=16) == AllocStatus.OK
    assert b.can_allocate(prompt, num_new_tokens=16) != AllocStatus.OK
    assert b.can_allocate(len(prompt)) == b.m.can_allocate(len(prompt))


def test_the_cluster_needs_neither_torch_nor_lz4() -> None:
    """It counts blocks and moves no KV: a shared-tier run with both imports made to fail."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "sys.modules['torch'] = None\n"
        "sys.modules['lz4'] = None\n"
        "from pagedkv.__main__ import main\n"
        "sys.exit(main(['simulate', '--no-progress', '--requests', '30', '--doc-tokens', "
        "'2048', '--num-blocks', '128', '--nodes', '2', '--shared-tier-bytes', '1GiB']))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False
    )
    assert proc.returncode == 0, proc.stderr
    assert "put by another node" in proc.stdout and "store       host (CPU)" in proc.stdout


def test_the_node_index_fits_its_two_byte_origin_at_the_limit_and_not_past_it(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from pagedkv.sim.cluster_tier import MAX_NODES

    store = _host_store(1000)
    last = _tiered(store, MAX_NODES - 1)
    p = _tokens(8, 512)
    assert last.allocate(1, p) == 0
    last.free(1)
    assert last.allocate(2, _tokens(9, 1023)) == 0  # evicts p's 32 blocks into the store
    reader = _tiered(store, 0)
    assert reader.allocate(3, np.concatenate([p, _tokens(10, 8)])) == 512
    assert reader.tier_tokens_by_origin == {MAX_NODES - 1: 512}  # the index read back whole
    with pytest.raises(ValueError, match=r"node index must be in \[0, 65536\), got 65536"):
        _tiered(store, MAX_NODES)
    rc, _, err = _run(capsys, *SMALL, "--nodes", str(MAX_NODES + 1))
    assert rc == 2 and "--nodes must be in [1, 65536], got 65537" in err
