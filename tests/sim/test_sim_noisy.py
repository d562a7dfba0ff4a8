"""`simulate --noisy-neighbour`: a loud tenant beside a quiet one, with and without quotas.

The goal (issue 35): with a reserve, the quiet tenant keeps at least 90% of its hit rate
alone. The small version here also shows the workload is noisy: with no quotas the quiet
tenant keeps far less, so the reserve is what holds the goal.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pagedkv.__main__ import main
from pagedkv.sim.noisy import LOUD, QUIET, NoisySetup, noisy_rows, noisy_workload

SMALL = NoisySetup(quiet_requests=20)


def test_the_loud_tenant_sends_ten_times_the_requests() -> None:
    wl = noisy_workload(SMALL)
    salts = [r.cache_salt for r in wl.requests]
    assert salts.count(QUIET) == 20 and salts.count(LOUD) == 200
    steps = [r.arrival_step for r in wl.requests]
    assert steps == sorted(steps)


@pytest.mark.parametrize("seed", [0, 3])
def test_a_reserve_keeps_the_quiet_tenants_hits(seed: int) -> None:
    setup = NoisySetup(quiet_requests=20, seed=seed)
    alone, shared, reserve, cap = noisy_rows(setup)
    assert alone.loud_rate is None and alone.quiet_rate > 0.7
    assert shared.quiet_rate < 0.6 * alone.quiet_rate  # the neighbour is noisy
    assert reserve.quiet_rate >= 0.9 * alone.quiet_rate  # the goal
    assert reserve.quotas == {QUIET: {"reserved": setup.reserve}}
    assert cap.quiet_rate > shared.quiet_rate  # a cap on the loud tenant helps too
    assert cap.loud_rate is not None and shared.loud_rate is not None
    assert cap.loud_rate < shared.loud_rate  # at the loud tenant's expense


def test_bad_sizes_are_refused() -> None:
    with pytest.raises(ValueError, match="quiet_requests and ratio"):
        noisy_workload(NoisySetup(quiet_requests=0))


def test_the_command_prints_the_table_and_json(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    path = tmp_path / "noisy.json"
    assert main(["simulate", "--noisy-neighbour", "--json", str(path)]) == 0
    text = capsys.readouterr().out
    assert "quiet tenant alone" in text and "quiet reserve" in text and "loud cap" in text
    doc = json.loads(path.read_text())
    rows = doc["rows"]
    assert [r["label"].split(",")[0] for r in rows] == ["quiet tenant alone", *["both"] * 3]
    assert rows[2]["quiet_of_alone"] >= 0.9
    assert doc["setup"]["ratio"] == 10


def test_options_it_would_ignore_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "--noisy-neighbour", "--workload", "chat"]) == 2
    assert "--noisy-neighbour builds its own" in capsys.readouterr().err
