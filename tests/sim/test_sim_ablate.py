"""`simulate --ablate` and `--ablate-claims` (`sim.ablate*`): each mechanism switched off
changes what it should, on real (small) runs; the table's columns; the claims' verdicts
follow from the measured figures."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from pagedkv.__main__ import main
from pagedkv.config import BlockManagerConfig
from pagedkv.sim.ablate import Variant, run_ablation, run_variant, variants
from pagedkv.sim.ablate_claims import (
    ClaimRunner,
    benefit_holds,
    cost_holds,
    delayed_reclaim,
    fork_sharing,
    prefix_sharing,
    u_shape,
)
from pagedkv.sim.ablate_report import COLUMNS, ablation_table
from pagedkv.sim.claim_workloads import CLAIM_WORKLOADS, build_claim_workload
from pagedkv.sim.workloads import build_workload

SCHEDULE: dict[str, Any] = {"max_num_batched_tokens": 2048}


def _config(num_blocks: int, cpu: int = 64, block_size: int = 16) -> BlockManagerConfig:
    return BlockManagerConfig(num_blocks=num_blocks, block_size=block_size, num_cpu_blocks=cpu)


def _run(variant: Variant, workload: Any, check: bool = True) -> dict[str, Any]:
    return run_variant(workload, variant, SCHEDULE, check=check)


def test_prefix_caching_off_has_no_hits() -> None:
    w = build_claim_workload("repetitive", 30)
    cfg = _config(8192)
    on = _run(Variant("on", "full", cfg), w)
    off = _run(
        Variant(
            "off",
            "prefix caching",
            BlockManagerConfig(num_blocks=8192, enable_prefix_caching=False, num_cpu_blocks=64),
        ),
        w,
    )
    assert on["prefix_hit_tokens"] > 0 and on["workload_hit_rate"] > 0.5
    assert off["prefix_hit_tokens"] == 0 and off["workload_hit_rate"] == 0.0
    # Each of the 30 requests holds its own copy of a 1,024-token prompt: more memory.
    assert off["mean_used_tokens"] > 2 * on["mean_used_tokens"]
    assert on["tokens_per_slot"] > 1.0 >= off["tokens_per_slot"]


def test_forks_that_copy_hold_more_blocks_on_beam_search() -> None:
    w = build_workload("beam", 20, arrival_rate=1.0)
    cfg = _config(16384)
    share = _run(Variant("share", "full", cfg), w)
    copy = _run(Variant("copy", "fork sharing", cfg, fork_copies=True), w)
    assert share["copied_forks"] == 0 and copy["copied_forks"] == copy["forks"] > 0
    assert copy["copied_fork_tokens"] > copy["copied_forks"]
    assert share["preemptions"] == copy["preemptions"] == 0
    assert copy["mean_used_tokens"] > 1.2 * share["mean_used_tokens"]
    assert copy["peak_used_blocks"] > share["peak_used_blocks"]
    # Copies share nothing, so they never need copy-on-write; shared beams do.
    assert share["cow_copies"] > 0 and copy["cow_copies"] == 0
    # The workload itself is unchanged: the same tokens generated, the same hits.
    assert copy["generated_tokens"] == share["generated_tokens"]
    assert copy["workload_hit_rate"] == share["workload_hit_rate"]


def test_a_copy_that_does_not_fit_waits_and_the_workload_still_finishes() -> None:
    w = build_workload("beam", 12, arrival_rate=0.0)
    f = _run(Variant("copy", "fork sharing", _config(96, cpu=0), fork_copies=True), w)
    assert f["finished_requests"] == 12 and f["rejected_requests"] == 0
    # Some copies waited in the queue (allocated later, as recomputes), the rest copied.
    assert f["copied_forks"] < f["forks"]
    assert f["recomputed_tokens"] > 0


def test_reclaim_at_once_keeps_fewer_cached_blocks_and_a_long_window_changes_nothing() -> None:
    w = build_claim_workload("short", 80)
    cfg = _config(1024)
    full = _run(Variant("kept", "full", cfg), w)
    once = _run(Variant("once", "delayed reclaim", cfg, window=0), w)
    some = _run(Variant("20", "delayed reclaim", cfg, window=20), w)
    never = _run(Variant("never", "delayed reclaim", cfg, window=10**9), w)
    assert once["reclaimed_blocks"] > 0
    assert once["mean_cached_blocks"] < some["mean_cached_blocks"] < full["mean_cached_blocks"]
    assert once["workload_hit_rate"] < full["workload_hit_rate"]
    assert once["pool_in_use"] < full["pool_in_use"]
    # A window no block outlives reclaims nothing: the same run as the full system.
    assert never["reclaimed_blocks"] == 0
    assert never["steps"]["cached_blocks"] == full["steps"]["cached_blocks"]
    assert never["prefix_hit_tokens"] == full["prefix_hit_tokens"]


def test_recompute_instead_of_swap_has_no_swaps() -> None:
    w = build_workload("mixed", 60, doc_tokens=2048)
    swap = _run(Variant("swap", "full", _config(256, cpu=512)), w)
    recompute = _run(Variant("recompute", "swap", _config(256, cpu=0)), w)
    assert swap["preempted_swap"] > 0 and swap["swap_ins"] > 0
    assert recompute["preempted_swap"] == recompute["swap_ins"] == 0
    assert recompute["preempted_recompute"] > 0 and recompute["recomputed_tokens"] > 0


def test_the_variants_cover_every_mechanism_and_the_block_sizes_keep_the_cache_tokens() -> None:
    vs = variants(_config(4096), windows=(0, 50), tiers_skipped="no torch")
    sections = [v.section for v in vs]
    for s in ("full", "prefix caching", "fork sharing", "delayed reclaim", "swap"):
        assert s in sections
    assert [v.window for v in vs if v.section == "delayed reclaim"] == [0, 50]
    assert [v.skipped for v in vs if v.section == "compression"] == ["no torch", "no torch"]
    sizes = [v.config for v in vs if v.section == "block size"]
    assert [c.block_size for c in sizes] == [8, 16, 32, 64, 128, 256]
    assert {c.block_size * c.num_blocks for c in sizes} == {4096 * 16}
    # A configuration without CPU blocks gets a row that turns swapping on.
    (swap,) = [v for v in variants(_config(64, cpu=0)) if v.section == "swap"]
    assert swap.config.num_cpu_blocks > 0


def test_the_table_has_its_columns_and_says_why_a_row_did_not_run() -> None:
    w = build_workload("mixed", 20, doc_tokens=1024)
    vs = variants(_config(512), tiers_skipped="torch is not installed", block_sizes=(16, 64))
    runs = run_ablation(w, vs, SCHEDULE)
    table = ablation_table(runs)
    lines = table.splitlines()
    for c in COLUMNS:
        assert c in lines[0]
    names = [r["variant"] for r in runs]
    for n in names:
        assert any(line.startswith(n) for line in lines)
    assert "host tier, lz4" in table and "not run: torch is not installed" in table
    # No tier row ran: every manager time is the replayed CPU time, and says so.
    assert all(f"{r['ablation_manager_seconds']:.3f} cpu" in table for r in runs if "timing" in r)
    assert " wall" not in table and "mgr s cpu   CPU time of the calls replayed" in table
    # The block-size row of the full system's size is the full system's run.
    b16 = next(r for r in runs if r["variant"] == "block size 16")
    assert b16["prefix_hit_tokens"] == runs[0]["prefix_hit_tokens"]
    full_row = next(line for line in lines if line.startswith("full system"))
    assert full_row.rstrip().endswith("+0.0%")


def test_the_rules_decide_from_the_figures() -> None:
    assert benefit_holds(0.20, 0.40) and not benefit_holds(0.19, 0.40)
    assert not benefit_holds(-0.1, 0.15)
    assert cost_holds(0.10, 0.05) and not cost_holds(0.11, 0.05)
    assert u_shape([8, 16, 32, 64], [10.0, 5.0, 6.0, 9.0]) == (True, 16)
    assert u_shape([8, 16, 32, 64], [10.0, 8.0, 6.0, 5.0]) == (False, 64)
    # A minimum inside but an end within 10% of it is no U.
    assert u_shape([8, 16, 32], [5.4, 5.0, 9.0]) == (False, 16)


def test_each_claim_verdict_is_its_rule_applied_to_its_measurement() -> None:
    r = ClaimRunner(requests=24, seed=1, schedule=SCHEDULE, repeats=1)
    fork = fork_sharing(r)
    assert fork.figures is not None
    assert fork.held == benefit_holds(fork.figures["mean_cut"], 0.40)
    assert f"{fork.figures['mean_cut']:.1%}" in fork.measured
    reclaim = delayed_reclaim(r)
    assert reclaim.figures is not None
    assert reclaim.held == benefit_holds(reclaim.figures["utilisation_gain"], 0.15)
    prefix = prefix_sharing(r)
    assert prefix.figures is not None
    assert prefix.held == (
        benefit_holds(prefix.figures["memory_cut"], 0.40)
        and benefit_holds(prefix.figures["utilisation_gain"], 0.30)
    )


def test_claim_workloads_are_seeded_and_of_their_kind() -> None:
    for kind in CLAIM_WORKLOADS:
        a, b = build_claim_workload(kind, 20, seed=3), build_claim_workload(kind, 20, seed=3)
        assert len(a.requests) == 20 and a.describe() == b.describe()
    chat = build_claim_workload("long-chat", 30)
    later = [r for r in chat.requests if r.after is not None]
    assert later and all(r.prompt_len > chat.requests[r.after].prompt_len for r in later)
    with pytest.raises(ValueError, match="unknown claim workload 'x'; choose one of short"):
        build_claim_workload("x", 3)


def test_the_command_prints_the_table_and_the_claims(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    js = tmp_path / "a.json"
    argv = ["simulate", "--no-progress", "--requests", "20", "--doc-tokens", "1024"]
    rc = main(
        [
            *argv,
            "--ablate",
            "--ablate-tier-bytes",
            "0",
            "--ablate-block-sizes",
            "16,64",
            "--ablate-repeats",
            "1",
            "--ablate-claims",
            "fork,prefix",
            "--json",
            str(js),
        ]
    )
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert "full system" in out and "prefix caching off" in out and "block size 64" in out
    assert "not run: left out (--ablate-tier-bytes 0)" in out
    verdicts = [line.split("  ")[0].strip() for line in out.splitlines() if "~40%" in line]
    assert len(verdicts) == 2 and all(v in ("HELD", "DID NOT HOLD") for v in verdicts)
    doc = json.loads(js.read_text())
    assert [c["claim"][:12] for c in doc["claims"]] == ["fork sharing", "prefix shari"]
    assert all(isinstance(c["held"], bool) for c in doc["claims"])
    assert doc["ablation"][0]["variant"] == "full system"


def test_bad_ablation_options_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["simulate", "--ablate-claims", "fork,nope"])
    assert "unknown claim 'nope'; accepted: fork, reclaim" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["simulate", "--ablate", "--reclaim-window", "-1"])
    assert "expected numbers >= 0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["simulate", "--ablate", "--ablate-block-sizes", "16,0"])
    assert "expected numbers >= 1, got '16,0'" in capsys.readouterr().err
    assert main(["simulate", "--ablate", "--block-size", "16,32", "--requests", "5"]) == 2
    assert "--ablate compares against one configuration" in capsys.readouterr().err


def test_the_timed_replay_makes_the_runs_calls_again_to_the_same_end() -> None:
    from pagedkv.sim.ablate_reclaim import WindowReclaim
    from pagedkv.sim.ablate_timing import CallLog, replay_cpu
    from pagedkv.sim.calls import bind_trace, replay_trace
    from pagedkv.sim.factory import make_manager
    from pagedkv.sim.scheduler import run_workload

    cfg = _config(256)
    w = build_workload("mixed", 30, doc_tokens=1024)
    manager = make_manager(cfg)
    log = CallLog(manager)
    run_workload(log, w, **SCHEDULE, fork_copies=True, after_step=WindowReclaim(log, 5))  # type: ignore[arg-type]
    names = {name for name, _, _ in log.calls}
    assert {"allocate", "append_batch", "evict_blocks", "free_batch"} <= names
    assert "block_tables" not in names  # the window's bookkeeping is not the manager's work
    again = make_manager(cfg)
    replay_trace(bind_trace(again, log.calls))
    assert again.stats() == manager.stats()
    t = replay_cpu(cfg, log.calls, 2)
    assert t.allocate_calls == sum(1 for n, _, _ in log.calls if n == "allocate") > 0
    assert 0 < t.allocate_seconds < t.seconds
    assert t.allocate_mean_seconds == t.allocate_seconds / t.allocate_calls
