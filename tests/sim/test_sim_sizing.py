"""`simulate --mrc`'s recommendation: the search (one-sided by default, two-sided with
`--bracket`), and the command end to end (the answer is checked again here by an independent
full run), GiB from --kv-bytes-per-token and --model."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pagedkv import BlockManager
from pagedkv.__main__ import main
from pagedkv.sim import build_workload, run_workload, sizing_cli, sizing_jobs
from pagedkv.sim.mrc_curve import MissRatioCurve
from pagedkv.sim.sizing import MAX_RUNS, PRECISION, STEP, Trial, recommend

SMALL = ["simulate", "--requests", "120", "--doc-tokens", "2048", "--no-progress"]
# A workload where the curve's estimate is close (8 sequences at most: no preemption near it),
# so that one step above it passes.
CALM = [*SMALL, "--max-batch", "8", "--block-size", "16,32", "--jobs", "1"]


def _linear_curve(blocks: int = 1000, block_size: int = 16) -> MissRatioCurve:
    """hit_rate(n) = n / blocks up to `blocks`: smallest_size(t) = ceil(t * blocks)."""
    return MissRatioCurve(
        block_size=block_size,
        sample_rate=1.0,
        thresholds=np.arange(1, blocks + 1, dtype=np.float64),
        prompt_tokens=blocks * block_size,
        lookups=1,
        touches=blocks,
        distinct_blocks=blocks,
    )


@pytest.mark.parametrize("needed", [300, 500, 520, 700, 2600])
def test_bracket_finds_the_smallest_passing_size(needed: int) -> None:
    """Two-sided: sizes pass from `needed` on; the curve proposes 500 (the target is 50%)."""
    curve = _linear_curve()
    calls: list[int] = []

    def run(n: int) -> Trial:
        calls.append(n)
        return Trial(n, 0.5 if n >= needed else 0.4, 0, 0, 0.5)

    rec = recommend(curve, 0.5, run, ceiling=10_000, bracket=True)
    assert rec.estimate == 500 and calls[:2] == [500, 525]  # the first round: E and STEP x E
    assert rec.two_sided and rec.ended in ("bracketed", "out of runs")
    assert len(calls) == len(set(calls)) <= MAX_RUNS
    assert rec.num_blocks is not None
    assert needed <= rec.num_blocks
    # Within the precision, unless the runs ran out first (an answer 5x off the curve's).
    assert rec.num_blocks <= needed * (1 + PRECISION) + 1 or len(calls) == MAX_RUNS
    fail = rec.largest_fail
    assert fail is not None and fail.num_blocks < needed  # bracketed from below
    assert [t.num_blocks for t in rec.trials] == sorted(calls)
    assert rec.lower_checked == (rec.ended == "bracketed")


@pytest.mark.parametrize("needed", [300, 500, 525, 526, 700, 2600])
def test_default_search_runs_once_when_a_step_above_the_estimate_passes(needed: int) -> None:
    """One-sided (the default): the first round is STEP x the estimate alone; if it passes,
    that is the answer, with nothing run below it; if not, the search goes up and brackets."""
    curve = _linear_curve()
    calls: list[int] = []

    def run(n: int) -> Trial:
        calls.append(n)
        return Trial(n, 0.5 if n >= needed else 0.4, 0, 0, 0.5)

    rec = recommend(curve, 0.5, run, ceiling=10_000)
    first = round(500 * STEP)
    assert rec.estimate == 500 and calls[0] == first == 525 and not rec.two_sided
    if needed <= first:
        assert calls == [first]  # one check run, no more
        assert rec.num_blocks == first and rec.ended == "one-sided" and not rec.lower_checked
        assert rec.largest_fail is None
    else:
        assert len(calls) == len(set(calls)) <= MAX_RUNS and min(calls) == first
        assert rec.num_blocks is not None and needed <= rec.num_blocks
        assert rec.num_blocks <= needed * (1 + PRECISION) + 1 or len(calls) == MAX_RUNS
        assert rec.ended in ("bracketed", "out of runs")
        assert rec.lower_checked == (rec.ended == "bracketed")


def test_default_search_stops_at_a_known_pass_below_its_first_size() -> None:
    """The curve's own run passed below STEP x the estimate: no check run at all."""
    known = (Trial(400, 0.6, 0, 0, 0.5, source="curve"),)
    rec = recommend(_linear_curve(), 0.5, lambda n: pytest.fail(f"ran {n}"), known=known)
    assert rec.num_blocks == 400 and rec.ended == "one-sided"


def test_search_reports_an_unreachable_target() -> None:
    curve = _linear_curve()
    rec = recommend(curve, 1.01, lambda n: Trial(n, 1.0, 0, 0, 1.01))
    assert rec.estimate is None and rec.num_blocks is None and not rec.trials
    never = recommend(curve, 0.5, lambda n: Trial(n, 0.5, 3, 0, 0.5), ceiling=2000)
    assert never.num_blocks is None and all(t.why() == "3 preemptions" for t in never.trials)


def _simulate(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def test_mrc_end_to_end(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    js = tmp_path / "mrc.json"
    rc, out, err = _simulate(
        capsys, *SMALL, "--mrc", "--bracket", "--kv-bytes-per-token", "131072", "--json", str(js)
    )
    assert rc == 0, out + err
    assert "miss-ratio curve, block size 16 (exact LRU stack distances" in out
    assert "GiB" in out and "sizing" in out
    doc = json.loads(js.read_text())
    mrc = doc["mrc"]
    assert all(isinstance(n, int) and 0.0 <= h <= 1.0 for n, h in mrc)
    assert [n for n, _ in mrc] == sorted(n for n, _ in mrc)
    assert doc["mrc_info"]["method"] == "exact"
    assert doc["pool_gib"] == pytest.approx(doc["num_blocks"] * 16 * 131072 / 2**30)
    (rec,) = doc["sizing"]["recommendations"]
    target, n = rec["target_hit_rate"], rec["num_blocks"]
    assert target == pytest.approx(0.95 * doc["mrc_info"]["unbounded_hit_rate"])
    assert rec["search"] == "bracket" and rec["lower_side_checked"]
    assert n is not None and rec["gib"] == pytest.approx(n * 16 * 131072 / 2**30)
    assert f"{n} blocks ({n * 16} tokens = {rec['gib']:.2f} GiB)" in out
    # Independently: the same workload at the recommended size reaches the target with no
    # preemption, and the largest size the search saw fail below it does not pass.
    w = build_workload("mixed", 120, seed=0, doc_tokens=2048)

    def full(num_blocks: int) -> Any:
        return run_workload(
            BlockManager(num_blocks, 16, num_cpu_blocks=512), w, max_num_batched_tokens=2048
        )

    at = full(n)
    assert at.workload_hit_rate >= target and at.preemptions == 0 and at.rejected_requests == 0
    below = [r for r in rec["runs"] if not r["passed"] and r["num_blocks"] < n]
    assert below, "the search brackets its answer from below"
    worse = full(max(r["num_blocks"] for r in below))
    assert worse.workload_hit_rate < target or worse.preemptions > 0


def test_sweep_gives_one_curve_and_answer_per_block_size(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    js = tmp_path / "sweep.json"
    rc, out, _ = _simulate(
        capsys,
        *SMALL,
        "--block-size",
        "16,32",
        "--cache-tokens",
        "65536",
        "--target-hit-rate",
        "50%",
        "--model",
        "llama-3-8b",
        "--json",
        str(js),
    )
    assert rc == 0, out
    assert "131072 bytes of KV per token (llama-3-8b)" in out
    assert "block size 16" in out and "block size 32" in out
    doc = json.loads(js.read_text())
    recs = doc["sizing"]["recommendations"]
    assert [r["block_size"] for r in recs] == [16, 32]
    assert all(r["target_hit_rate"] == 0.5 and r["hit_rate"] >= 0.5 for r in recs)
    assert {r["block_size"]: "mrc" in r for r in doc["runs"]} == {16: True, 32: True}
    # Sizes given: each block size ran, and recorded, on its own.
    assert doc["sizing"]["curve_replays"] == 2 and doc["sizing"]["not_run"] == []
    assert doc["sizing"]["shared_replay"] is None


def _count_checks(monkeypatch: pytest.MonkeyPatch) -> dict[int, list[int]]:
    """Block size -> the sizes of its check runs, as the command runs them (--jobs 1)."""
    perform = sizing_jobs.perform
    checks: dict[int, list[int]] = {}

    def counting(task: Any, ctx: Any, report: Any) -> Any:
        if task.kind == "check":
            checks.setdefault(task.config.block_size, []).append(task.config.num_blocks)
        return perform(task, ctx, report)

    monkeypatch.setattr(sizing_jobs, "perform", counting)
    return checks


def test_default_runs_one_check_per_block_size(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    checks = _count_checks(monkeypatch)
    js = tmp_path / "one.json"
    rc, out, _ = _simulate(capsys, *CALM, "--mrc", "--json", str(js))
    assert rc == 0, out
    recs = json.loads(js.read_text())["sizing"]["recommendations"]
    assert [r["block_size"] for r in recs] == [16, 32]
    for r in recs:
        first = max(round(r["curve_estimate_blocks"] * STEP), r["curve_estimate_blocks"] + 1)
        assert checks[r["block_size"]] == [first]  # one check run, a step above the estimate
        assert r["num_blocks"] == first and r["search"] == "one-sided"
        assert r["search_ended"] == "one-sided" and r["lower_side_checked"] is False
        assert [x["num_blocks"] for x in r["runs"] if x["source"] == "check"] == [first]
        e = r["curve_estimate_blocks"]
        assert (
            f"passed a full run; the curve's estimate {e}, 5% below, was not run "
            "(add --bracket to check it)" in out
        )


def test_bracket_checks_the_estimate_and_below(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    checks = _count_checks(monkeypatch)
    js = tmp_path / "two.json"
    rc, out, _ = _simulate(capsys, *CALM, "--bracket", "--json", str(js))  # implies --mrc
    assert rc == 0, out
    doc = json.loads(js.read_text())
    assert doc["sizing"]["search"] == "bracket"
    for r in doc["sizing"]["recommendations"]:
        e, n = r["curve_estimate_blocks"], r["num_blocks"]
        assert checks[r["block_size"]][:2] == [e, round(e * STEP)]  # the first round
        assert r["search"] == "bracket" and r["lower_side_checked"] is True
        fail = r["largest_fail_below_blocks"]
        assert fail is not None and fail < n <= fail * (1 + PRECISION) + 1
        assert not next(x for x in r["runs"] if x["num_blocks"] == fail)["passed"]
    assert "add --bracket" not in out


def test_large_workloads_are_sampled(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sizing_cli, "EXACT_TOUCHES", 1000)
    rc, out, _ = _simulate(capsys, *SMALL, "--mrc", "--target-hit-rate", "0.3")
    assert rc == 0
    assert "SHARDS sampling of 1 block key in" in out and "an estimate" in out
    rc, out, _ = _simulate(capsys, *SMALL, "--mrc-sample", "1", "--target-hit-rate", "0.3")
    assert "exact LRU stack distances" in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--mrc", "--model", "gemma-3-27b"], "KV-cache groups"),
        (["--mrc", "--model", "llama-3-8b", "--kv-bytes-per-token", "8"], "either --model"),
        (["--model", "llama-3-8b", "--kv-bytes-per-token", "8"], "either --model"),
        (["--kv-bytes-per-token", "0"], "--kv-bytes-per-token must be >= 1"),
    ],
)
def test_sizing_errors(capsys: pytest.CaptureFixture[str], argv: list[str], message: str) -> None:
    rc, out, err = _simulate(capsys, *SMALL, *argv)
    assert rc == 2 and message in err and "GPU blocks" not in out


def test_target_must_be_a_rate(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main([*SMALL, "--target-hit-rate", "1.5"])
    assert "expected a rate" in capsys.readouterr().err
