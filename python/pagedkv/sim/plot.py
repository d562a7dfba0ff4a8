"""The figure of `--plot`: per-step usage, cached blocks, running sequences and running hit
rate, and with `--mrc` the miss-ratio curve below them (`plot_mrc`).

Readable for long runs and sweeps: a trace's runs are drawn over trace time in seconds (the
step clock otherwise); steps with a preemption are marked on the usage panel; series longer
than `SMOOTH_ABOVE` steps are drawn as a moving mean (the window is in the axis label); when
runs of different pool sizes are overlaid, cached blocks are drawn as a share of each pool.
matplotlib is imported here only, when a plot is asked for (`import pagedkv` needs numpy only).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

SMOOTH_ABOVE = 2000  # steps; beyond, series are drawn as a moving mean
SMOOTH_POINTS = 500  # about this many windows across the run


def run_label(f: dict[str, Any]) -> str:
    return f"B={f['block_size']} blocks={f['num_blocks']} {f['hash_algo']}"


def _clock(f: dict[str, Any]) -> tuple[npt.NDArray[np.float64], str]:
    """The x values of a run: trace seconds, or steps."""
    steps = np.asarray(f["steps"]["step"], dtype=np.float64)
    ms = f.get("ms_per_step")
    if ms:
        return steps * ms / 1000, "trace time (s)"
    return steps, "step"


def moving_mean(values: npt.ArrayLike, window: int) -> npt.NDArray[np.float64]:
    """The mean of the last `window` values at each point (fewer at the start)."""
    v = np.asarray(values, dtype=np.float64)
    if window <= 1 or not len(v):
        return v
    c = np.concatenate(([0.0], np.cumsum(v)))
    i = np.arange(1, len(v) + 1)
    lo = np.maximum(0, i - window)
    out: npt.NDArray[np.float64] = (c[i] - c[lo]) / (i - lo)
    return out


def plot_runs(
    path: str | Path,
    runs: Sequence[dict[str, Any]],
    title: str = "",
    sizing: dict[str, Any] | None = None,
) -> None:
    """Draw each run's series (as `report.figures` gives them), and its curve if it has one
    (`sizing`: the recommendations to mark on it), into `path`."""
    fig = figure(runs, title, sizing)
    fig.savefig(path, dpi=120)
    import matplotlib.pyplot as plt

    plt.close(fig)


def figure(
    runs: Sequence[dict[str, Any]], title: str = "", sizing: dict[str, Any] | None = None
) -> Any:
    """The matplotlib figure of `plot_runs` (close it with `plt.close`)."""
    try:
        import matplotlib
    except ImportError:
        raise RuntimeError(
            "--plot needs matplotlib: pip install matplotlib (from a checkout: pip install "
            "'.[plot]')"
        ) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from pagedkv.sim.plot_mrc import draw_mrc

    pools = {(f["block_size"], f["num_blocks"]) for f in runs}
    cached_share = len(pools) > 1
    panels = (
        ("usage", "held (% of pool)", 100.0),
        ("cached_blocks", "cached (% of pool)" if cached_share else "cached blocks", 1.0),
        ("running", "running sequences", 1.0),
        ("hit_rate", "workload hit rate so far (%)", 100.0),
    )
    with_mrc = any("mrc" in f for f in runs)
    fig = plt.figure(figsize=(10, 12 if with_mrc else 9))
    grid = fig.add_gridspec(
        len(panels) + with_mrc, 1, height_ratios=[1] * len(panels) + [1.4] * with_mrc
    )
    axes = [fig.add_subplot(grid[0])]
    axes += [fig.add_subplot(grid[i], sharex=axes[0]) for i in range(1, len(panels))]
    longest = max(len(f["steps"]["step"]) for f in runs)
    window = longest // SMOOTH_POINTS if longest > SMOOTH_ABOVE else 1
    xlabel = "step"
    for f in runs:
        s = f["steps"]
        x, xlabel = _clock(f)
        label = run_label(f) if len(runs) > 1 else None
        color = None
        for ax, (key, _, scale) in zip(axes, panels, strict=True):
            y = np.asarray(s[key], dtype=np.float64) * scale
            if key == "cached_blocks" and cached_share:
                y = y * 100.0 / f["num_blocks"]
            line = ax.plot(x, moving_mean(y, window), linewidth=0.8, label=label, color=color)
            color = line[0].get_color()
        marks = np.flatnonzero(np.asarray(s.get("preemptions", ()), dtype=np.int64))
        if len(marks):
            axes[0].plot(
                x[marks],
                np.full(len(marks), 103.0),
                "|",
                color=color,
                markersize=6,
                label=f"preemption ({len(marks)} steps)" if len(runs) == 1 else None,
            )
    for ax, (_, name, _) in zip(axes, panels, strict=True):
        ax.set_ylabel(name, fontsize=8)
        ax.grid(True, alpha=0.3)
        ax.tick_params(labelbottom=ax is axes[-1])
    axes[0].set_ylim(0, 106)
    axes[-1].set_ylim(0, 100)
    smooth = f"; each line a mean of {window} steps" if window > 1 else ""
    axes[-1].set_xlabel(xlabel + smooth)
    if len(runs) > 1 or axes[0].get_legend_handles_labels()[0]:
        axes[0].legend(fontsize=7, loc="lower right")
    if with_mrc:
        draw_mrc(fig.add_subplot(grid[len(panels)]), runs, sizing)
    if not title:
        f = runs[0]
        title = f"pagedkv simulate: {f['workload'].split(':')[0]}, {f['manager']} manager"
        if len(runs) == 1:
            title += f", {run_label(f)}, workload hit rate {f['workload_hit_rate']:.1%}"
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig


__all__ = ["SMOOTH_ABOVE", "figure", "moving_mean", "plot_runs", "run_label"]
