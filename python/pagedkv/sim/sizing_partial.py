"""Ctrl-C during a curve run of `simulate --mrc`: the curve of what it replayed so far.

A curve run interrupted midway has recorded every block touch of the requests it scheduled:
the curve of those touches is exact for that part of the workload (its first requests by
arrival), not for the whole. So it is kept and shown as such: printed with the count of
requests it covers, saved in `--json` (`sizing.partial_curves`), and never turned into a
recommendation (a size for the first N requests is no answer for the workload).

In this process (`--jobs 1`) the interrupt reaches the replay directly; a worker process
ignores Ctrl-C, so the parent sets a shared event that the worker's progress callback
checks (`stop_requested`), and the worker hands its partial curve back like a result.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pagedkv.sim.mrc_curve import MissRatioCurve
from pagedkv.sim.sizing_report import curve_json

PARTIAL_WAIT = 10.0  # seconds the parent waits for its workers' partial curves


@dataclass
class PartialCurve:
    """The curve of the requests a curve run replayed before it was stopped."""

    index: int  # the configured run
    block_size: int
    curve: MissRatioCurve
    requests_done: int  # requests ended when it stopped
    requests: int
    others: dict[int, MissRatioCurve] = field(default_factory=dict)  # shared replay's

    def describe(self) -> str:
        return (
            f"the B={self.block_size} curve run was interrupted after {self.requests_done} of "
            f"{self.requests} requests: the curve below is of those requests only (exact for "
            "them, no answer for the whole workload)"
        )

    def as_json(self) -> dict[str, Any]:
        return {
            "block_size": self.block_size,
            "requests_done": self.requests_done,
            "requests": self.requests,
            **curve_json(self.curve),
            "other_block_sizes": {str(bs): curve_json(c) for bs, c in sorted(self.others.items())},
        }


class CurveInterrupted(KeyboardInterrupt):
    """Ctrl-C inside a curve run, carrying the curve of what it replayed."""

    def __init__(self, partial: PartialCurve) -> None:
        super().__init__(partial.describe())
        self.partial = partial


__all__ = ["PARTIAL_WAIT", "CurveInterrupted", "PartialCurve"]
