"""The per-step figure of `--plot`: usage, cached blocks, running sequences, running hit rate.

matplotlib is imported here only, when a plot is asked for (`import pagedkv` needs numpy only).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any


def run_label(f: dict[str, Any]) -> str:
    return f"B={f['block_size']} blocks={f['num_blocks']} {f['hash_algo']}"


def plot_runs(path: str | Path, runs: Sequence[dict[str, Any]], title: str = "") -> None:
    """Draw each run's series (as `report.figures` gives them) over the step clock."""
    try:
        import matplotlib
    except ImportError:
        raise RuntimeError(
            "--plot needs matplotlib: pip install matplotlib (or pip install 'pagedkv[plot]')"
        ) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = (
        ("usage", "GPU block usage", 100.0, "%"),
        ("cached_blocks", "cached blocks", 1.0, ""),
        ("running", "running sequences", 1.0, ""),
        ("hit_rate", "prefix hit rate so far", 100.0, "%"),
    )
    fig, axes = plt.subplots(len(panels), 1, figsize=(10, 9), sharex=True)
    for f in runs:
        s = f["steps"]
        label = run_label(f) if len(runs) > 1 else None
        for ax, (key, _, scale, _) in zip(axes, panels, strict=True):
            ax.plot(s["step"], [v * scale for v in s[key]], linewidth=0.8, label=label)
    for ax, (_, name, _, unit) in zip(axes, panels, strict=True):
        ax.set_ylabel(f"{name} ({unit})" if unit else name, fontsize=9)
        ax.grid(True, alpha=0.3)
    axes[0].set_ylim(0, 105)
    axes[-1].set_ylim(0, 100)
    axes[-1].set_xlabel("step")
    if len(runs) > 1:
        axes[0].legend(fontsize=8, loc="lower right")
    if not title:
        f = runs[0]
        title = f"pagedkv simulate: {f['workload'].split(':')[0]}, {f['manager']} manager"
        if len(runs) == 1:
            title += f", {run_label(f)}, hit rate {f['prefix_hit_rate']:.1%}"
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


__all__ = ["plot_runs", "run_label"]
