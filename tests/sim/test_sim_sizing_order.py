"""The sizing output reads from the top: the answer first, then the curves, then the curve
run's own figures at its own configured size (its hit rate is not the answer)."""

from __future__ import annotations

import pytest

from pagedkv.__main__ import main


@pytest.mark.parametrize("mode", ["--mrc", "--mrc-only"])
def test_the_answer_comes_before_the_curve_runs_summary(
    mode: str, capsys: pytest.CaptureFixture[str]
) -> None:
    rc = main(["simulate", "--requests", "40", mode, "--no-progress", "--jobs", "1"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    answer = out.index("sizing      the smallest cache")
    curve = out.index("miss-ratio curve, block size 16")
    run = out.index("curve run   the replay that recorded the curve, at its own configured size")
    summary = out.index("prefix hits    ")  # the curve run's own hit rate
    assert answer < curve < run < summary
    assert out.count("prefix hits    ") == 1
