"""The miss-ratio curve panel of `--plot`: hit rate against cache size, one curve per block
size, on a log axis of GiB (when the bytes per token are known) or tokens, so that block sizes
compare at equal memory. The configured pool of each curve's run is a dashed line (none for a
block size whose curve came from another's replay: `sizing.curves`); the recommended size
(`--mrc`'s sizing) a dot."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def draw_mrc(ax: Any, runs: Sequence[dict[str, Any]], sizing: dict[str, Any] | None) -> None:
    """Draw the curve of each block size (the run with the most blocks, as the table does)."""
    best: dict[int, dict[str, Any]] = {}
    for f in runs:
        if "mrc" in f:
            have = best.get(f["block_size"])
            if have is None or f["num_blocks"] > have["num_blocks"]:
                best[f["block_size"]] = f
    for c in (sizing or {}).get("curves", ()):  # recorded in another block size's replay
        best.setdefault(c["block_size"], c)
    gib = all(f.get("bytes_per_block") for f in best.values())
    recs = {r["block_size"]: r for r in (sizing or {}).get("recommendations", ())}
    left = float("inf")
    for bs, f in sorted(best.items()):
        scale = f["bytes_per_block"] / (1 << 30) if gib else bs  # per block: GiB or tokens
        xs = [n * scale for n, _ in f["mrc"]]
        ys = [h * 100 for _, h in f["mrc"]]
        # Start where the curve leaves the floor: 1% of its top, halved for a margin.
        rising = [x for x, y in zip(xs, ys, strict=True) if y >= 0.01 * max(ys, default=0)]
        left = min(left, rising[0] / 2 if rising and max(ys) > 0 else xs[0])
        how = "exact" if f["mrc_info"]["method"] == "exact" else "sampled"
        if "from_replay_block_size" in f:
            how += f", from the B={f['from_replay_block_size']} replay"
        line = ax.plot(xs, ys, linewidth=1.0, label=f"block {bs} ({how})")[0]
        if "num_blocks" in f:  # a run of its own
            ax.axvline(
                f["num_blocks"] * scale,
                color=line.get_color(),
                linestyle="--",
                linewidth=0.6,
                label=f"block {bs}: the run's pool",
            )
        rec = recs.get(bs)
        if rec and rec["num_blocks"] is not None:
            ax.plot(
                [rec["num_blocks"] * scale],
                [rec["hit_rate"] * 100],
                "o",
                color=line.get_color(),
                markersize=5,
                label=f"block {bs}: smallest for {rec['target_hit_rate']:.1%}",
            )
    ax.set_xscale("log")
    if left < float("inf"):
        ax.set_xlim(left=left)
    ax.set_xlabel("cache size (GiB)" if gib else "cache size (tokens)")
    ax.set_ylabel("hit rate (%)\nmiss-ratio curve", fontsize=8)
    ax.set_ylim(0, 100)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7, loc="upper left")


__all__ = ["draw_mrc"]
