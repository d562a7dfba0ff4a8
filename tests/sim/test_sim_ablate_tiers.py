"""The compression rows of `simulate --ablate`: a host tier raw and lz4-compressed at the same
bytes, run for real (the tier run keeps real KV bytes in a numpy pool), and the claim's
verdict computed from them."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("lz4")

from pagedkv.__main__ import main
from pagedkv.config import BlockManagerConfig
from pagedkv.sim.ablate import run_ablation, variants
from pagedkv.sim.ablate_claims import ClaimRunner, benefit_holds, compression, cost_holds
from pagedkv.sim.ablate_report import ablation_table, compression_effect
from pagedkv.sim.kv_bytes import from_model
from pagedkv.sim.tier_run import TierOptions
from pagedkv.sim.workloads import build_workload

pytestmark = pytest.mark.slow  # tier runs move real bytes: tens of seconds

SCHEDULE: dict[str, Any] = {"max_num_batched_tokens": 2048}


def test_the_compression_rows_run_a_raw_and_an_lz4_tier_of_the_same_bytes() -> None:
    w = build_workload("mixed", 20, doc_tokens=1024)
    cfg = BlockManagerConfig(num_blocks=128, num_cpu_blocks=0)
    kv = from_model("llama-3-8b")
    host = TierOptions(kv=kv, host_bytes=64 * kv.per_block(16), data="real")
    vs = [v for v in variants(cfg, tiers=host) if v.section in ("full", "compression")]
    runs = run_ablation(w, vs, SCHEDULE)
    raw, lz4 = runs[1], runs[2]
    assert raw["compress"] is None and lz4["compress"] == "lz4"
    assert raw["blocks_demoted"] > 0 and lz4["blocks_demoted"] > 0
    # Raw entries store their header too: a little under 1.
    assert 0.95 < raw["compression_ratio"] <= 1.0
    e = compression_effect(runs)
    assert e is not None
    assert e["capacity"] == lz4["compression_ratio"] / raw["compression_ratio"] - 1.0
    table = ablation_table(runs)
    assert "compression   lz4 at the raw tier's bytes" in table
    # The manager seconds mix two measures: each row says which, and the legend what it is.
    rows = {line.split("  ")[0]: line for line in table.splitlines()}
    assert f"{runs[0]['ablation_manager_seconds']:.3f} cpu" in rows[runs[0]["variant"]]
    assert f"{lz4['ablation_manager_seconds']:.3f} wall" in rows[lz4["variant"]]
    assert "mgr s cpu   CPU time of the calls replayed, best of 1" in table
    assert "mgr s wall  wall time inside the run's calls, tier work included, one run" in table


def test_the_compression_claim_is_decided_by_capacity_and_time() -> None:
    r = ClaimRunner(requests=12, seed=0, schedule=SCHEDULE, repeats=1)
    c = compression(r)
    assert c.figures is not None and c.held is not None
    f = c.figures
    assert c.held == (benefit_holds(f["capacity"], 0.15) and cost_holds(f["latency"], 0.05))
    assert "shuffle+lz4" in c.measured


def test_the_command_prints_the_compression_rows(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(
        [
            "simulate",
            "--no-progress",
            "--requests",
            "15",
            "--doc-tokens",
            "1024",
            "--num-blocks",
            "128",
            "--ablate",
            "--ablate-tier-bytes",
            "8MiB",
            "--ablate-block-sizes",
            "16",
            "--ablate-repeats",
            "1",
        ]
    )
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert "host tier, raw" in out and "host tier, lz4" in out and "not run" not in out
    assert "compression   lz4 at the raw tier's bytes" in out
