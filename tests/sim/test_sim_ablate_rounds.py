"""`--ablate-claims` on a busy machine: a timed claim runs in rounds, must clear its rule by a
margin, and is INCONCLUSIVE when its rounds disagree (a fake measurement that moves between
rounds stands in for the noisy timer)."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from pagedkv.__main__ import main
from pagedkv.sim import ablate_claims
from pagedkv.sim.ablate_claims import (
    MARGIN,
    ClaimResult,
    ClaimRunner,
    benefit_holds,
    check_claims,
    claims_table,
    judged,
)

RUNNER = ClaimRunner(requests=1, seed=0, schedule={}, repeats=1)


def _timed_claim(cuts: list[float]) -> Callable[[ClaimRunner], ClaimResult]:
    """A claim of a 30% cut (held at 15% or more) whose measured cut is the next of `cuts`
    at each call, as a noisy timer would give."""
    measured: Iterator[float] = iter(cuts)

    def claim(r: ClaimRunner) -> ClaimResult:
        del r
        cut = next(measured)
        return ClaimResult(
            "a 30% cut",
            "fake",
            f"{cut:.1%} less",
            why="held if >= 15%",
            figures={"cut": cut},
            **judged(lambda s: benefit_holds(cut, 0.30, s)),
        )

    return claim


def _one(cuts: list[float], rounds: int = 3) -> ClaimResult:
    (c,) = check_claims(RUNNER, ["t"], rounds=rounds, claims={"t": _timed_claim(cuts)}, timed=["t"])
    return c


def test_rounds_that_agree_clear_of_the_margin_give_a_verdict() -> None:
    held = _one([0.30, 0.28, 0.31])
    assert held.verdict == "held" and held.held is True
    assert held.rounds == ("held", "held", "held")
    failed = _one([0.02, 0.05, 0.01])
    assert failed.verdict == "did not hold" and failed.held is False


def test_rounds_that_disagree_are_inconclusive() -> None:
    # The hot-blocks figure of the issue: 2.0% in one run, far above the rule in another.
    c = _one([0.02, 0.25, 0.02])
    assert c.verdict == "inconclusive" and c.held is None
    assert c.rounds == ("did not hold", "held", "did not hold")
    text = claims_table([c])
    assert text.startswith("INCONCLUSIVE")
    assert "rounds      did not hold; held; did not hold" in text
    assert c.as_dict()["held"] is None and c.as_dict()["verdict"] == "inconclusive"


def test_a_verdict_within_the_margin_is_inconclusive_even_when_rounds_agree() -> None:
    # 14.1% against a 15% rule: under it every round, but within 20% of the threshold.
    assert 0.15 * (1 - MARGIN) < 0.141 < 0.15
    c = _one([0.141, 0.142, 0.140])
    assert c.verdict == "inconclusive"
    assert c.rounds == ("did not hold, narrowly",) * 3
    one = _one([0.16], rounds=1)  # a single round, narrow: still too close to call
    assert one.narrow and one.verdict == "inconclusive"
    assert "margin      the verdict changes" in claims_table([one])


def test_the_counted_claims_run_once_and_are_judged_as_stated() -> None:
    calls = []

    def counted(r: ClaimRunner) -> ClaimResult:
        calls.append(1)
        return _timed_claim([0.16])(r)  # narrow, but a count does not move between runs

    (c,) = check_claims(RUNNER, ["c"], rounds=3, claims={"c": counted}, timed=[])
    assert len(calls) == 1 and c.verdict == "held" and not c.rounds


def test_bad_rounds_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ValueError, match="--claim-rounds must be >= 1, got 0"):
        check_claims(RUNNER, [], rounds=0)
    assert main(["simulate", "--ablate-claims", "fork", "--claim-rounds", "0"]) == 2
    assert "--claim-rounds must be >= 1, got 0" in capsys.readouterr().err


def test_the_command_runs_a_timed_claim_in_rounds(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """The real hot-blocks claim through the command: its rounds are printed and saved."""
    js = tmp_path / "c.json"
    rc = main(
        [
            "simulate",
            "--no-progress",
            "--requests",
            "30",
            "--ablate-claims",
            "hot",
            "--claim-rounds",
            "2",
            "--ablate-repeats",
            "1",
            "--json",
            str(js),
        ]
    )
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert "timed claims in 2 rounds, a 20% margin" in out
    (c,) = json.loads(js.read_text())["claims"]
    assert len(c["rounds"]) == 2 and c["verdict"] in ("held", "did not hold", "inconclusive")
    assert f"rounds      {'; '.join(c['rounds'])}" in out
    assert "hot" in ablate_claims.TIMED
