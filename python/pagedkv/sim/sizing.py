"""The sizing answer: the smallest cache that reaches a target hit rate without preemption.

The miss-ratio curve (`sim.mrc`) says, from one replay, which size an LRU cache needs for a
hit rate. The manager is not quite that cache (running sequences pin their blocks, and a
smaller pool schedules differently), and the curve says nothing about preemption. So the
curve only proposes; full simulations decide. `recommend` runs the workload at the curve's
size, walks down in steps of `STEP` (or up, in steps that grow) until the answer changes,
then halves the gap until the bracket is within `PRECISION`, at most `MAX_RUNS` simulations
per block size (a bracket still wider then is what the printed runs show). A size
passes when the run's hit rate over the workload's prompts reaches the target, nothing was
preempted and no request was rejected. The answer is the smallest size that passed.

Hit rate and preemption are not strictly monotone in the size (a smaller pool can admit in
another order), so this is a search for "the smallest size found to pass, next to one found
to fail", not a proof that nothing smaller passes; the output lists every size it ran.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from pagedkv.sim.mrc_curve import MissRatioCurve

STEP = 1.1  # bracketing step from the curve's estimate
PRECISION = 0.02  # stop when the smallest pass is within 2% of the largest fail
MAX_RUNS = 12
MIN_BLOCKS = 2


@dataclass(frozen=True, slots=True)
class Trial:
    """One full simulation at `num_blocks`."""

    num_blocks: int
    hit_rate: float  # over the workload's prompts
    preemptions: int
    rejected: int
    target: float

    @property
    def passed(self) -> bool:
        return self.hit_rate >= self.target - 1e-12 and not self.preemptions and not self.rejected

    def why(self) -> str:
        if self.passed:
            return "passed"
        reasons = []
        if self.hit_rate < self.target - 1e-12:
            reasons.append(f"hit rate {self.hit_rate:.2%}")
        if self.preemptions:
            reasons.append(f"{self.preemptions} preemptions")
        if self.rejected:
            reasons.append(f"{self.rejected} requests rejected")
        return ", ".join(reasons)


@dataclass(frozen=True, slots=True)
class Recommendation:
    """The answer for one block size."""

    block_size: int
    target: float
    target_note: str  # how the target was chosen
    estimate: int | None  # the curve's smallest size for the target; None: never reached
    num_blocks: int | None  # the smallest size that passed; None: none did
    trials: tuple[Trial, ...]

    @property
    def passed(self) -> Trial | None:
        return next((t for t in self.trials if t.num_blocks == self.num_blocks), None)

    @property
    def largest_fail(self) -> Trial | None:
        below = [t for t in self.trials if not t.passed and (t.num_blocks < (self.num_blocks or 0))]
        return max(below, key=lambda t: t.num_blocks, default=None)


def recommend(
    curve: MissRatioCurve,
    target: float,
    run: Callable[[int], Trial],
    *,
    target_note: str = "",
    ceiling: int | None = None,
) -> Recommendation:
    """Search for the smallest passing size, starting where the curve reaches `target`.

    `run(num_blocks)` simulates the workload at that size. `ceiling`: the largest size tried
    (default: 4 x the curve's flat point, or `1 << 20` blocks when the curve is empty).
    """
    estimate = curve.smallest_size(target)
    top = ceiling or max(4 * curve.largest_useful_size, 1 << 20)
    trials: dict[int, Trial] = {}

    def passes(n: int) -> bool:
        if n not in trials:
            trials[n] = run(n)
        return trials[n].passed

    def answer(best: int | None) -> Recommendation:
        ordered = tuple(sorted(trials.values(), key=lambda t: t.num_blocks))
        return Recommendation(curve.block_size, target, target_note, estimate, best, ordered)

    if estimate is None:
        return answer(None)
    n = max(estimate, MIN_BLOCKS)
    lo: int | None = None  # largest size that failed
    hi: int | None = None  # smallest size that passed
    if passes(n):
        hi = n
        while lo is None and len(trials) < MAX_RUNS:
            down = max(MIN_BLOCKS, int(hi / STEP))
            if down >= hi:
                break
            if passes(down):
                hi = down
            else:
                lo = down
    else:
        lo = n
        grow = STEP  # squared after each failure: far-off answers are reached in a few runs
        while hi is None and len(trials) < MAX_RUNS:
            up = min(top, max(lo + 1, round(lo * grow)))
            if up <= lo:
                break
            if passes(up):
                hi = up
            else:
                lo, grow = up, grow * grow
    while hi is not None and lo is not None and hi > lo * (1 + PRECISION) + 1:
        if len(trials) >= MAX_RUNS:
            break
        # Halve the ratio while it is large (an answer far from the curve's), then the gap.
        mid = int((lo * hi) ** 0.5) if hi > 2 * lo else (lo + hi) // 2
        if passes(mid):
            hi = mid
        else:
            lo = mid
    return answer(hi)


__all__ = ["MAX_RUNS", "PRECISION", "STEP", "Recommendation", "Trial", "recommend"]
