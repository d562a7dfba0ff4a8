"""Every table that prints a hit rate leads with the workload's own: hits over the workload's
prompt tokens, recomputed prompts (allocated again after a preemption, hitting the blocks
they had) on their own row. A small pool without swap space makes preemptions recompute, so
the two rates differ and a headline of all allocations would show."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from pagedkv.__main__ import main

# 40 requests on 300 blocks and no CPU blocks: dozens of recompute preemptions.
PREEMPTING = [
    "simulate",
    "--requests",
    "40",
    "--doc-tokens",
    "2048",
    "--num-cpu-blocks",
    "0",
    "--no-progress",
]


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    assert main(list(argv)) == 0
    return capsys.readouterr().out


def _row(out: str, name: str) -> str:
    match = re.search(rf"^{name} +(.*)$", out, re.MULTILINE)
    assert match, (name, out)
    return match.group(1)


def _rates(f: dict[str, Any]) -> tuple[float, float]:
    """The workload's hit rate and the recomputed prompts', from the token counts."""
    workload = (f["prefix_hit_tokens"] - f["recomputed_hit_tokens"]) / f["workload_prompt_tokens"]
    return workload, f["recomputed_hit_tokens"] / f["recomputed_tokens"]


def test_summary_leads_with_the_workloads_hit_rate(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    js = tmp_path / "f.json"
    out = _run(capsys, *PREEMPTING, "--num-blocks", "300", "--json", str(js))
    f = json.loads(js.read_text())
    assert f["preempted_recompute"] > 0 and f["recomputed_tokens"] > 0
    workload, recomputed = _rates(f)
    # The case this is about: recomputes hit their own blocks, so all allocations together
    # show a higher rate than the workload's.
    assert f["prefix_hit_rate"] > workload + 0.01
    assert f["workload_hit_rate"] == pytest.approx(workload)
    assert f["recomputed_hit_rate"] == pytest.approx(recomputed)
    hits = f["prefix_hit_tokens"] - f["recomputed_hit_tokens"]
    assert _row(out, "prefix hits").startswith(
        f"{workload:.2%} of the workload's prompt tokens ({hits} of {f['workload_prompt_tokens']})"
    )
    assert _row(out, "recomputed").startswith(
        f"{recomputed:.2%} of {f['recomputed_tokens']} prompt tokens allocated again"
    )
    assert f"every allocation together {f['prefix_hit_rate']:.2%}" in _row(out, "recomputed")


def test_summary_without_recomputes_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    out = _run(capsys, *PREEMPTING, "--num-blocks", "4096")
    assert _row(out, "recomputed").startswith("none")


def test_sweep_column_is_the_workloads(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    js = tmp_path / "f.json"
    out = _run(capsys, *PREEMPTING, "--num-blocks", "300,4096", "--json", str(js))
    runs = json.loads(js.read_text())["runs"]
    lines = out.splitlines()
    head = next(i for i, line in enumerate(lines) if line.split()[:2] == ["block", "blocks"])
    cols = re.split(r"  +", lines[head].strip())
    assert cols[3:5] == ["hit rate", "recomp hit"]
    rows = [line.split() for line in lines[head + 2 : head + 4]]
    small, large = runs
    assert small["recomputed_tokens"] > 0 and large["recomputed_tokens"] == 0
    assert rows[0][3] == f"{_rates(small)[0]:.2%}" != f"{small['prefix_hit_rate']:.2%}"
    assert rows[0][4] == f"{_rates(small)[1]:.2%}"
    assert rows[1][3] == f"{large['workload_hit_rate']:.2%}" and rows[1][4] == "-"


def test_model_table_leads_with_the_workloads_hit_rate(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    js = tmp_path / "m.json"
    out = _run(
        capsys, *PREEMPTING, "--num-blocks", "256", "--model", "gemma-3-12b", "--json", str(js)
    )
    doc = json.loads(js.read_text())
    model, full = doc["runs"]
    for f in (model, full):
        assert f["recomputed_tokens"] > 0
    assert model["prefix_hit_rate"] > _rates(model)[0] + 0.01
    hits, recomputed = _row(out, "hit rate"), _row(out, "recomputed")
    for f in (model, full):
        workload, again = _rates(f)
        assert f"{workload:.2%} ({f['prefix_hit_tokens'] - f['recomputed_hit_tokens']} of " in hits
        assert f"{again:.2%} of {f['recomputed_tokens']} " in recomputed
    assert f"{model['prefix_hit_rate']:.2%}" not in hits
    section = doc["model"]["model"]
    assert section["workload_hit_rate"] == pytest.approx(_rates(model)[0])


def test_plot_and_series_follow_the_workloads_hit_rate(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    from pagedkv.sim.plot import figure

    js = tmp_path / "f.json"
    _run(capsys, *PREEMPTING, "--num-blocks", "300", "--json", str(js))
    f = json.loads(js.read_text())
    assert f["steps"]["hit_rate"][-1] == pytest.approx(f["workload_hit_rate"])
    fig = figure([f])
    title = fig.get_suptitle()
    assert f"workload hit rate {f['workload_hit_rate']:.1%}" in title
    plt.close(fig)
