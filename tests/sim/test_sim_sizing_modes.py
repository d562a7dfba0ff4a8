"""`simulate --mrc`'s quick answer and its curve table: `--mrc-only` (the curve's estimate,
marked as such, no check runs), `--mrc-points` and rows dense around the target, and the wall
and CPU time line."""

from __future__ import annotations

import itertools
import json
import re
from pathlib import Path

import pytest

from pagedkv.__main__ import main
from pagedkv.sim.sizing_report import BAND

SMALL = ["simulate", "--requests", "120", "--doc-tokens", "2048", "--no-progress", "--jobs", "1"]


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def _rows(out: str, block_size: int = 16) -> list[tuple[int, str]]:
    """(blocks, the rest of the line) of the printed curve of one block size."""
    head = out.index(f"miss-ratio curve, block size {block_size} ")
    lines = out[head:].splitlines()[3:]
    rows = []
    for line in lines:
        m = re.match(r"\s+(\d+)\s+\d+\s+.*%", line)
        if not m:
            break
        rows.append((int(m.group(1)), line))
    return rows


@pytest.mark.parametrize("flag", ["--mrc-only", "--no-check"])
def test_curve_only_gives_the_estimate_without_check_runs(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, flag: str
) -> None:
    js = tmp_path / "only.json"
    rc, out, _ = _run(capsys, *SMALL, flag, "--kv-bytes-per-token", "131072", "--json", str(js))
    assert rc == 0, out
    doc = json.loads(js.read_text())
    sizing = doc["sizing"]
    assert sizing["status"] == "complete" and sizing["checked"] is False
    (rec,) = sizing["recommendations"]
    assert rec["checked"] is False
    # The only run is the curve's own: nothing was checked.
    assert [r["source"] for r in rec["runs"]] == ["curve"]
    e = rec["curve_estimate_blocks"]
    assert e is not None and rec["curve_estimate_gib"] == pytest.approx(e * 16 * 131072 / 2**30)
    assert (
        f"{e} blocks ({e * 16} tokens = {rec['curve_estimate_gib']:.2f} GiB): the curve's "
        "estimate, not checked by full runs (--mrc-only)" in out
    )
    assert "check run" not in out


def test_checked_answer_lists_its_runs(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    js = tmp_path / "checked.json"
    rc, out, _ = _run(capsys, *SMALL, "--mrc", "--json", str(js))
    assert rc == 0
    (rec,) = json.loads(js.read_text())["sizing"]["recommendations"]
    assert rec["checked"] and rec["complete"]
    checks = [r for r in rec["runs"] if r["source"] == "check"]
    assert checks and rec["num_blocks"] in [r["num_blocks"] for r in rec["runs"] if r["passed"]]
    assert re.search(r"time {8}wall [\d.]+ s \(\d+s\), CPU [\d.]+ s", out)


def test_rows_are_dense_around_the_target(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = _run(capsys, *SMALL, "--mrc-only")
    assert rc == 0
    rows = _rows(out)
    at = [i for i, (_, line) in enumerate(rows) if "<- reaches the target" in line]
    assert len(at) == 1
    i = at[0]
    sizes = [n for n, _ in rows]
    # Rows at most BAND apart on either side of the target's row (one may be the curve's end).
    assert sizes[i] / sizes[i - 1] <= BAND * 1.01
    if i + 1 < len(sizes):
        assert sizes[i + 1] / sizes[i] <= BAND * 1.01
    # Where the curve climbs, rows come in small steps of hit rate.
    rates = [float(re.findall(r"([\d.]+)%", line)[0]) for _, line in rows]
    assert max(b - a for a, b in itertools.pairwise(rates)) <= 0.15 * rates[-1]


def test_mrc_points_sets_the_rows(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    js = tmp_path / "p.json"
    _, few, _ = _run(capsys, *SMALL, "--mrc-only", "--mrc-points", "8")
    _, many, _ = _run(capsys, *SMALL, "--mrc-only", "--mrc-points", "48", "--json", str(js))
    assert len(_rows(few)) < len(_rows(many))
    assert len(_rows(many)) > 24
    assert len(_rows(few)) <= 10
    # The JSON curve holds every printed size.
    points = {n for n, _ in json.loads(js.read_text())["mrc"]}
    assert {n for n, _ in _rows(many)} <= points


def test_mrc_points_must_be_a_few(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main([*SMALL, "--mrc", "--mrc-points", "2"])
    assert "expected at least 4 rows" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([*SMALL, "--mrc", "--jobs", "0"])
    assert "number of processes >= 1" in capsys.readouterr().err
