"""`simulate --eviction lru,s3fifo,...` (`sim.policies*`): one row per policy on the same
workload, LRU's figures equal to a plain run's, bad names refused, the per-tenant rows adding
up to the totals, Ctrl-C keeping the policies that finished."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

import pagedkv.sim.policies as policies_mod
from pagedkv.__main__ import main
from pagedkv.config import BlockManagerConfig
from pagedkv.sim.factory import make_manager
from pagedkv.sim.policies import TenantTally, parse_policies, run_policies, run_policy
from pagedkv.sim.policies_report import COLUMNS, policy_table, tenant_table
from pagedkv.sim.scan_workload import build_scan_workload
from pagedkv.sim.scheduler import run_workload
from pagedkv.sim.workloads import build_workload

SMALL = ["simulate", "--requests", "60", "--num-blocks", "512", "--doc-tokens", "2048"]
SCHEDULE: dict[str, Any] = {"max_num_batched_tokens": 2048}
# Figures of a run that depend on the clock, not on what the manager did.
TIMED = {
    "manager_seconds",
    "manager_step_mean_seconds",
    "manager_step_p99_seconds",
    "manager_ns_per_token",
    "wall_seconds",
    "wall_step_mean_seconds",
}


def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def _rows(out: str) -> list[list[str]]:
    """The policy table's rows (header, rule, the bound's row and its notes left out), split
    on runs of spaces."""
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.split()[:3] == ["policy", "hit", "rate"])
    rows = []
    for line in lines[start + 2 :]:
        if not line.strip() or line.startswith(("optimal", "gap closed")):
            break
        rows.append(line.split())
    return rows


def test_parse_policies_accepts_each_policy_and_refuses_bad_names() -> None:
    assert parse_policies("lru") == ["lru"]
    assert parse_policies("lru, s3fifo,arc,lfu,slru") == ["lru", "s3fifo", "arc", "lfu", "slru"]
    with pytest.raises(ValueError, match=r"unknown eviction policy 'fifo'.*accepted: lru, s3fifo"):
        parse_policies("lru,fifo")
    with pytest.raises(ValueError, match="empty policy"):
        parse_policies("lru,,arc")
    with pytest.raises(ValueError, match="'lru' given twice"):
        parse_policies("lru,arc,lru")


def test_cli_names_the_bad_policy(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main([*SMALL, "--eviction", "lru,LRU"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--eviction: unknown eviction policy 'LRU'" in err, err
    assert "accepted: lru, s3fifo, arc, lfu, slru" in err


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        (["--mrc"], "--mrc"),
        (["--ablate"], "--ablate"),
        (["--host-tier-bytes", "1GiB"], "tiers"),
        (["--reference"], "--reference"),
        (["--nodes", "2"], "cluster options"),
        (["--block-size", "16,32"], "one configuration"),
    ],
)
def test_eviction_refuses_the_other_multi_run_modes(
    capsys: pytest.CaptureFixture[str], extra: list[str], named: str
) -> None:
    rc, _, err = _cli(capsys, *SMALL, "--eviction", "lru", *extra)
    assert rc != 0
    assert named in err, err


def test_lru_row_equals_a_plain_run(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    plain_json, policy_json = tmp_path / "plain.json", tmp_path / "lru.json"
    assert _cli(capsys, *SMALL, "--no-progress", "--json", str(plain_json))[0] == 0
    rc, out, _ = _cli(
        capsys, *SMALL, "--no-progress", "--eviction", "lru", "--json", str(policy_json)
    )
    assert rc == 0, out
    plain = json.loads(plain_json.read_text())
    doc = json.loads(policy_json.read_text())
    assert doc["eviction"] == {
        "policies": ["lru"],
        "finished": ["lru"],
        "status": "complete",
        "repeats": 3,
    }
    (run,) = doc["runs"]
    assert run["eviction"] == "lru"
    compared = [k for k in plain if k not in TIMED and k != "steps"]
    assert {k: run[k] for k in compared} == {k: plain[k] for k in compared}
    for series, values in plain["steps"].items():
        if series != "manager_ns":
            assert run["steps"][series] == values, series
    # The printed row says the same: one row, the plain run's hit rates and evictions.
    (row,) = _rows(out)
    assert row[0] == "lru"
    assert row[1] == f"{plain['prefix_hit_rate']:.2%}"
    assert row[2] == f"{plain['workload_hit_rate']:.2%}"
    assert row[3] == "0%"  # LRU closes none of its own gap to the bound
    assert row[4] == str(plain["evictions"])
    assert row[5] == f"{plain['preempted_swap']}/{plain['preempted_recompute']}"
    assert float(row[6]) == pytest.approx(run["policy_manager_seconds"], abs=1e-3)
    assert row[8] == "1.00x"  # LRU against itself


def test_one_row_per_policy_in_the_order_given(capsys: pytest.CaptureFixture[str]) -> None:
    order = ["slru", "lru", "arc", "lfu", "s3fifo"]
    rc, out, _ = _cli(capsys, *SMALL, "--no-progress", "--eviction", ",".join(order))
    assert rc == 0, out
    rows = _rows(out)
    assert [r[0] for r in rows] == order
    assert all(len(r) == len(COLUMNS) for r in rows)
    assert "eviction policies" in out and "the same for every policy" in out


def test_scan_resistant_policies_keep_the_hot_set_lru_flushes() -> None:
    # 8 hot prompts of 16 blocks asked twice a round, then a scan of 6 x 64 blocks: the
    # scan and the other hot prompts exceed the 320 blocks, so LRU has flushed a hot prompt
    # by the next round and hits only each round's second pass.
    w = build_scan_workload(rounds=8, hot=8, hot_tokens=256, passes=2, scan=6, scan_tokens=1024)
    config = BlockManagerConfig(num_blocks=320, num_cpu_blocks=0)
    runs = {
        f["eviction"]: f
        for f in run_policies(w, config, ["lru", "s3fifo", "arc"], SCHEDULE, repeats=1)
    }
    hot = [r for r in w.requests if r.kind == "hot"]
    per_hit = 255 // 16 * 16  # a whole-prompt hit leaves the last token to compute
    second_passes = len(hot) // 2 * per_hit
    assert all(f["preemptions"] == 0 for f in runs.values())
    assert runs["lru"]["prefix_hit_tokens"] == second_passes
    for name in ("s3fifo", "arc"):
        assert runs[name]["workload_hit_rate"] > runs["lru"]["workload_hit_rate"] + 0.1, name
        assert runs[name]["evictions"] < runs["lru"]["evictions"], name
    # ARC keeps the hot set from the second round on: every hot request after the first
    # round's first pass hits.
    assert runs["arc"]["prefix_hit_tokens"] == (len(hot) - 8) * per_hit
    table = policy_table(list(runs.values()))
    names = [line.split()[0] for line in table.splitlines()[2:]]
    assert names == ["lru", "s3fifo", "arc", "optimal", "optimal", "gap"]
    # The bound: recorded in LRU's run, above LRU on the same stream, and the share of the gap
    # each policy closes is its gain over LRU over the optimum's (the column says so).
    bound = runs["lru"]["bound"]
    assert all("bound" not in runs[name] for name in ("s3fifo", "arc"))
    assert bound["source_policy"] == "lru" and bound["num_blocks"] == 320
    gap = bound["optimal_hit_rate"] - bound["stream_lru_hit_rate"]
    assert gap > 0.1  # the scan pushes the hot set out of LRU; the optimum keeps it
    arc_gain = runs["arc"]["workload_hit_rate"] - runs["lru"]["workload_hit_rate"]
    arc_row = table.splitlines()[4].split()
    assert arc_row[3] == f"{arc_gain / gap:.0%}"
    assert table.splitlines()[5].split()[4] == "100%"  # "optimal (bound)": two words


def _tenant_run(num_cpu_blocks: int) -> dict[str, Any]:
    """The mixed workload (a tenth of its requests salted, two tenants) in a pool small
    enough to evict and preempt."""
    w = build_workload("mixed", 150, doc_tokens=2048, seed=3)
    config = BlockManagerConfig(num_blocks=384, num_cpu_blocks=num_cpu_blocks)
    return run_policy(w, config, "lru", SCHEDULE, repeats=1)


@pytest.mark.parametrize("num_cpu_blocks", [0, 64])
def test_tenant_rows_add_up_to_the_totals(num_cpu_blocks: int) -> None:
    f = _tenant_run(num_cpu_blocks)
    tenants = {t["tenant"]: t for t in f["tenants"]}
    assert set(tenants) == {None, "tenant-0", "tenant-1"}
    assert f["preemptions"] > 0
    if num_cpu_blocks == 0:
        assert f["recomputed_tokens"] > 0  # recomputes exist, and are split by salt
    for key, total in (
        ("prompt_tokens", "prompt_tokens"),
        ("prefix_hit_tokens", "prefix_hit_tokens"),
        ("recomputed_tokens", "recomputed_tokens"),
        ("recomputed_hit_tokens", "recomputed_hit_tokens"),
        ("workload_prompt_tokens", "workload_prompt_tokens"),
    ):
        assert sum(t[key] for t in tenants.values()) == f[total], key
    hits = f["prefix_hit_tokens"] - f["recomputed_hit_tokens"]
    assert sum(t["workload_hit_tokens"] for t in tenants.values()) == hits
    for t in tenants.values():
        assert t["workload_hit_rate"] == pytest.approx(
            t["workload_hit_tokens"] / t["workload_prompt_tokens"]
        )
        assert t["prefix_hit_rate"] == pytest.approx(t["prefix_hit_tokens"] / t["prompt_tokens"])
    # Salts keep tenants apart: a salted prompt never hits the unsalted copies of its system
    # prompt, so the tenants' rates sit well below the unsalted requests'.
    assert tenants[None]["workload_hit_rate"] > tenants["tenant-0"]["workload_hit_rate"]
    table = tenant_table([f])
    for label in ("(no salt)", "tenant-0", "tenant-1"):
        assert label in table


def test_tally_counts_what_the_scheduler_counts_for_forks_recomputed() -> None:
    # Parallel sampling in a pool that preempts by recompute: forked children come back
    # through allocate as recomputes (their tokens were their parent's admission).
    w = build_workload("sampling", 60, seed=1)
    tally = TenantTally()
    manager = make_manager(BlockManagerConfig(num_blocks=96, num_cpu_blocks=0))
    res = run_workload(manager, w, **SCHEDULE, watch=tally)
    assert res.preempted_recompute > 0 and res.forks > 0
    (row,) = tally.rows()
    assert row["tenant"] is None
    assert row["prompt_tokens"] == res.prompt_tokens
    assert row["recomputed_tokens"] == res.recomputed_tokens > 0
    assert row["recomputed_hit_tokens"] == res.recomputed_hit_tokens
    assert row["workload_hit_rate"] == res.workload_hit_rate


def test_cli_prints_tenant_rows_only_for_salted_requests(
    capsys: pytest.CaptureFixture[str],
) -> None:
    rc, out, _ = _cli(capsys, *SMALL, "--no-progress", "--eviction", "lru")
    assert rc == 0
    assert "per tenant (cache salt)" in out and "tenant-0" in out
    rc, out, _ = _cli(
        capsys, "simulate", "--workload", "chat", "--requests", "20", "--no-progress",
        "--eviction", "lru",
    )  # fmt: skip
    assert rc == 0
    assert "per tenant" not in out


def test_ctrl_c_keeps_the_policies_that_finished(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = policies_mod.run_policy
    calls: list[str] = []

    def stop_on_second(*args: Any, **kwargs: Any) -> dict[str, Any]:
        calls.append(args[2])
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(policies_mod, "run_policy", stop_on_second)
    js = tmp_path / "partial.json"
    rc, out, _ = _cli(
        capsys, *SMALL, "--no-progress", "--eviction", "lru,s3fifo,arc", "--json", str(js)
    )
    assert rc == 130
    assert calls == ["lru", "s3fifo"]
    assert "interrupted (Ctrl-C)" in out and "(lru of lru, s3fifo, arc)" in out
    assert [r[0] for r in _rows(out)] == ["lru"]
    doc = json.loads(js.read_text())
    assert doc["eviction"]["status"] == "interrupted"
    assert doc["eviction"]["finished"] == ["lru"]
    assert [r["eviction"] for r in doc["runs"]] == ["lru"]


@pytest.mark.parametrize("policy", ["lru", "s3fifo", "arc", "lfu", "slru"])
def test_the_timed_replay_meets_the_runs_states(policy: str) -> None:
    # The manager time replays the run's calls on a fresh manager; that times the run's own
    # work only if every policy is deterministic: the replay ends where the run ended.
    from pagedkv.sim.ablate_timing import CallLog
    from pagedkv.sim.calls import bind_trace, replay_trace

    config = BlockManagerConfig(num_blocks=384, num_cpu_blocks=32, eviction=policy)  # type: ignore[arg-type]
    run = make_manager(config)
    log = CallLog(run)
    run_workload(log, build_workload("mixed", 80, doc_tokens=2048), **SCHEDULE)  # type: ignore[arg-type]
    again = make_manager(config)
    replay_trace(bind_trace(again, log.calls))
    a, b = run.stats(), again.stats()
    assert a.evictions > 0 and a.prefix_hits > 0
    assert a == b  # every count: blocks, hits, evictions, swaps, copies


def test_a_trace_with_salts_gets_tenant_rows(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """Mooncake lines may carry `cache_salt`: two tenants asking the same hash ids never
    share blocks, the never-evicting estimate keys them apart too, and the table gets a row
    per tenant."""
    from dataclasses import replace

    from pagedkv.sim.trace import expected_hit_tokens, read_trace

    lines = []
    for i in range(24):
        line: dict[str, object] = {
            "timestamp": 10 * i,
            "input_length": 1100,
            "output_length": 4,
            "hash_ids": [i % 3, 100 + i % 2, 1000 + i],
        }
        if i % 2:
            line["cache_salt"] = "tenant-x"
        lines.append(json.dumps(line))
    path = tmp_path / "salted.jsonl"
    path.write_text("\n".join(lines) + "\n")
    wl = read_trace(path)
    assert {r.cache_salt for r in wl.requests} == {None, "tenant-x"}
    salted_hits, _ = expected_hit_tokens(wl.requests, 16)
    shared_hits, _ = expected_hit_tokens([replace(r, cache_salt=None) for r in wl.requests], 16)
    assert salted_hits < shared_hits, "two tenants must not share an estimate"
    rc, out, _ = _cli(
        capsys, "simulate", "--trace", str(path), "--num-blocks", "512", "--no-progress",
        "--eviction", "lru,arc",
    )  # fmt: skip
    assert rc == 0, out
    assert "per tenant (cache salt)" in out and "tenant-x" in out
    bad = tmp_path / "bad.jsonl"
    bad.write_text(lines[0].replace('"timestamp"', '"cache_salt": 5, "timestamp"') + "\n")
    with pytest.raises(ValueError, match="cache_salt"):
        read_trace(bad)
