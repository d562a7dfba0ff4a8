"""Where fidelity matters, show it: the scheduled replay's curve beside a pure cache replay's.

`simulate --mrc` records its curves from replays through the scheduler and the manager
(running sequences pin their blocks, prompts are chunked, requests overlap, a small pool
preempts). The other sizing tools replay a pure cache: each request's blocks looked up and put
in, one request after another. On a trace of hash ids both can be had (`mrc_blocks`: the pure
cache replay costs milliseconds to about a second), so the output compares them at the printed
curve's sizes and says so when they differ by `LARGE` or more at some size; `--json` keeps the
comparison either way (`sizing.fidelity`).
"""

from __future__ import annotations

from typing import Any

from pagedkv.sim.mrc_blocks import block_curve, unfit_reason
from pagedkv.sim.mrc_curve import MissRatioCurve
from pagedkv.sim.requests import Workload

LARGE = 0.01  # a point of hit rate


def compare(curve: MissRatioCurve, workload: Workload, sizes: list[int]) -> dict[str, Any] | None:
    """Both curves at `sizes` and where they differ most; None when the workload has no
    pure cache replay at this block size."""
    bs = curve.block_size
    if unfit_reason(workload, bs) is not None or not sizes:
        return None
    cache = block_curve(workload, bs)
    rows = [[n, curve.hit_rate(n), cache.hit_rate(n)] for n in sizes]
    worst = max(rows, key=lambda r: abs(r[1] - r[2]))
    return {
        "block_size": bs,
        "sizes": rows,  # [num_blocks, scheduled replay's hit rate, pure cache replay's]
        "largest_difference": worst[2] - worst[1],
        "at_num_blocks": worst[0],
        "large": abs(worst[2] - worst[1]) >= LARGE,
    }


def fidelity_line(f: dict[str, Any]) -> str:
    """The output's line: the largest difference, and whether it is large."""
    n, sched, cache = next(r for r in f["sizes"] if r[0] == f["at_num_blocks"])
    diff = (cache - sched) * 100
    head = f"fidelity    B={f['block_size']}: "
    if not f["large"]:
        return head + (
            f"a pure cache replay (no scheduler) agrees with this scheduled replay within "
            f"{abs(diff):.2f} points at every size above"
        )
    return head + (
        f"a pure cache replay (no scheduler: nothing pinned or preempted, one request at a "
        f"time), as other sizing tools compute, differs by up to {diff:+.2f} points: "
        f"{cache:.2%} against this scheduled replay's {sched:.2%} at {n} blocks"
    )


__all__ = ["LARGE", "compare", "fidelity_line"]
