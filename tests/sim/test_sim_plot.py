"""`--plot`: trace time in seconds, preemptions marked, long runs smoothed, cached blocks as a
share of the pool when pools differ, and the miss-ratio curve panel with `--mrc`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pagedkv.__main__ import main
from pagedkv.sim.plot import SMOOTH_ABOVE, figure, moving_mean

plt = pytest.importorskip("matplotlib.pyplot")  # the [plot] extra; [test] installs it


def _fake_run(
    steps: int, num_blocks: int = 100, ms_per_step: float | None = None
) -> dict[str, Any]:
    rng = np.random.default_rng(steps + num_blocks)
    preempted = np.zeros(steps, dtype=int)
    preempted[steps // 3] = 2
    return {
        "block_size": 16,
        "num_blocks": num_blocks,
        "hash_algo": "sha256",
        "workload": "fake: test",
        "manager": "rust",
        "prefix_hit_rate": 0.5,
        "workload_hit_rate": 0.4,
        "ms_per_step": ms_per_step,
        "steps": {
            "step": list(range(steps)),
            "usage": rng.random(steps).tolist(),
            "cached_blocks": rng.integers(0, num_blocks, steps).tolist(),
            "running": rng.integers(0, 9, steps).tolist(),
            "hit_rate": rng.random(steps).tolist(),
            "preemptions": preempted.tolist(),
        },
    }


def test_moving_mean() -> None:
    assert moving_mean([1, 2, 3, 4], 2).tolist() == [1.0, 1.5, 2.5, 3.5]
    assert moving_mean([5, 7], 1).tolist() == [5.0, 7.0]


def test_trace_seconds_preemptions_and_smoothing() -> None:
    fig = figure([_fake_run(3 * SMOOTH_ABOVE, ms_per_step=20.0)])
    usage, cached, _, hits = fig.axes
    assert hits.get_xlabel().startswith("trace time (s)")
    # 6000 steps of 20 ms: the axis ends near 120 s.
    assert usage.lines[0].get_xdata()[-1] == pytest.approx((3 * SMOOTH_ABOVE - 1) * 0.02)
    assert "each line a mean of 12 steps" in hits.get_xlabel()
    marks = [ln for ln in usage.lines if ln.get_marker() == "|"]
    assert len(marks) == 1 and len(marks[0].get_xdata()) == 1
    assert "preemption (1 steps)" in usage.get_legend_handles_labels()[1]
    assert cached.get_ylabel().startswith("cached blocks")
    plt.close(fig)


def test_short_runs_are_not_smoothed_and_overlays_share_the_pool() -> None:
    fig = figure([_fake_run(50, num_blocks=100), _fake_run(50, num_blocks=400)])
    usage, cached, _, hits = fig.axes
    assert hits.get_xlabel() == "step" and usage.get_ylabel() == "held (% of pool)"
    assert cached.get_ylabel() == "cached (% of pool)"
    # The 400-block run caches up to 399 blocks: drawn as a share, it stays within 100%.
    assert (
        max(cached.lines[1].get_ydata())
        <= 100.0
        < max(_fake_run(50, 400)["steps"]["cached_blocks"])
    )
    plt.close(fig)


def test_mrc_panel_end_to_end(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    js, png = tmp_path / "r.json", tmp_path / "r.png"
    argv = ["simulate", "--requests", "60", "--doc-tokens", "2048", "--no-progress", "--mrc"]
    argv += ["--kv-bytes-per-token", "4096", "--json", str(js), "--plot", str(png)]
    assert main(argv) == 0, capsys.readouterr()
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    doc = json.loads(js.read_text())
    fig = figure([doc], sizing=doc["sizing"])
    mrc = fig.axes[-1]
    assert mrc.get_xlabel() == "cache size (GiB)" and mrc.get_xscale() == "log"
    labels = mrc.get_legend_handles_labels()[1]
    assert "block 16 (exact)" in labels and any("smallest for" in x for x in labels)
    plt.close(fig)


def test_mrc_panel_draws_a_curve_from_another_block_sizes_replay(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """One replay for both block sizes: B=32's curve, kept in `sizing.curves`, is drawn too
    (without a pool line: it had no run of its own)."""
    js = tmp_path / "r.json"
    argv = ["simulate", "--requests", "60", "--doc-tokens", "2048", "--no-progress", "--mrc"]
    argv += ["--block-size", "16,32", "--kv-bytes-per-token", "4096", "--json", str(js)]
    assert main([*argv, "--mrc-only", "--jobs", "1"]) == 0, capsys.readouterr()
    doc = json.loads(js.read_text())
    fig = figure(doc["runs"], sizing=doc["sizing"])
    labels = fig.axes[-1].get_legend_handles_labels()[1]
    assert "block 32 (exact, from the B=16 replay)" in labels
    assert "block 16: the run's pool" in labels and "block 32: the run's pool" not in labels
    plt.close(fig)
