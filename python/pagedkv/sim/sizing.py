"""The sizing answer: the smallest cache that reaches a target hit rate without preemption.

The miss-ratio curve (`sim.mrc`) says, from one replay, which size an LRU cache needs for a hit
rate. The manager is not quite that cache (running sequences pin their blocks, and a smaller
pool schedules differently), and the curve says nothing about preemption. So the curve only
proposes; full simulations decide. A `Search` runs in rounds of at most `ROUND` sizes, run side
by side (in parallel processes: `sim.sizing_jobs`).

By default the search is one-sided: the manager tends to hit a little less than the LRU cache
the curve models (on a 12,031-request conversation trace the curve's size fell 0.04 points
short and one `STEP` above it passed, at both block sizes), so the first round checks only
`STEP` x the curve's estimate. If that passes, the search is over after one run: the answer
passed a full run, and the curve's estimate below it was not run. If it fails, the search goes
on as the two-sided one does. Two-sided (`bracket=True`, `--bracket`): the first round is the
curve's size and one `STEP` above it. Then, in both: while every size failed, further up in
steps that grow (squared each round); while every size passed, further down the same way;
once a size that failed lies below one that passed, sizes splitting the gap in three, until
the smallest pass is within `PRECISION` of the largest fail below it, at most `MAX_RUNS`
simulations per block size (the one-sided search also stops at any pass not above its first
size). The sizes of a round depend only on the results of the rounds before it, never on the
number of processes, so the answer is the same with any `--jobs`. A size passes when the run's
hit rate over the workload's prompts reaches the target, nothing was preempted and no request
was rejected; a check run stops as soon as it can no longer pass (`check_bound`), and says so.
Runs the caller already has (the curve run itself, a full run at its size) count as found.

Hit rate and preemption are not strictly monotone in the size (a smaller pool can admit in
another order), so this is a search for "the smallest size found to pass", next to one found
to fail when bracketed, not a proof that nothing smaller passes; the output lists every size
it ran and says whether the side below the answer was checked (`Recommendation.lower_checked`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from pagedkv.sim.mrc_curve import MissRatioCurve

STEP = 1.05  # the first round: one step above the curve's estimate (and the estimate, two-sided)
PRECISION = 0.05  # done when the smallest pass is within 5% of the largest fail below it
ROUND = 2  # sizes per round at most (fixed: the answer must not depend on the processes)
MAX_RUNS = 12
MIN_BLOCKS = 2


@dataclass(frozen=True, slots=True)
class Trial:
    """One simulation at `num_blocks` (to the end, or stopped once it could not pass)."""

    num_blocks: int
    hit_rate: float  # over the workload's prompts (admitted so far if stopped early)
    preemptions: int
    rejected: int
    target: float
    stopped: str = ""  # why the run stopped before the end ("": it ran to the end)
    source: str = "check"  # "check": a sizing run; "curve": the curve's own run

    @property
    def passed(self) -> bool:
        return (
            not self.stopped
            and self.hit_rate >= self.target - 1e-12
            and not self.preemptions
            and not self.rejected
        )

    def why(self) -> str:
        if self.passed:
            return "passed"
        if self.stopped:
            return f"stopped early: {self.stopped}"
        reasons = []
        if self.hit_rate < self.target - 1e-12:
            reasons.append(f"hit rate {self.hit_rate:.2%}")
        if self.preemptions:
            reasons.append(f"{self.preemptions} preemption{'s' * (self.preemptions != 1)}")
        if self.rejected:
            reasons.append(f"{self.rejected} request{'s' * (self.rejected != 1)} rejected")
        return ", ".join(reasons)


@dataclass(frozen=True, slots=True)
class Recommendation:
    """The answer for one block size (so far, while `complete` is False)."""

    block_size: int
    target: float
    target_note: str  # how the target was chosen
    estimate: int | None  # the curve's smallest size for the target; None: never reached
    num_blocks: int | None  # the smallest size that passed; None: none did
    trials: tuple[Trial, ...]
    checked: bool = True  # False: curve only, no check runs (`--mrc-only`)
    complete: bool = True  # False: interrupted, or still running
    two_sided: bool = False  # the search's kind: `--bracket` (True) or one-sided (the default)
    # Why the search ended: "bracketed" (a fail within PRECISION below the answer),
    # "one-sided" (the default search's stop at its first pass), "out of runs" (`MAX_RUNS`);
    # "" while it runs, when interrupted, or when nothing passed.
    ended: str = ""

    @property
    def passed(self) -> Trial | None:
        return next((t for t in self.trials if t.num_blocks == self.num_blocks), None)

    @property
    def largest_fail(self) -> Trial | None:
        below = [t for t in self.trials if not t.passed and (t.num_blocks < (self.num_blocks or 0))]
        return max(below, key=lambda t: t.num_blocks, default=None)

    @property
    def lower_checked(self) -> bool:
        """Whether a size within `PRECISION` below the answer was run and failed (so the
        answer is bracketed); False when none passed."""
        fail = self.largest_fail
        n = self.num_blocks
        return n is not None and fail is not None and _close(fail.num_blocks, n)


def _close(lo: int, hi: int) -> bool:
    """`hi` is within `PRECISION` (or one block) of `lo`: the search needs no size between."""
    return hi <= lo * (1 + PRECISION) + 1


class Search:
    """The check runs of one block size, a round at a time (see the module docstring).

    `next_round()` gives the sizes to run next (empty: done); `record(trial)` takes each
    result, in any order. `known`: runs already made (they count as found, not as runs).
    `bracket`: the two-sided search (the first round runs the curve's estimate too, and the
    search goes on until a failing size lies within `PRECISION` below the answer).
    """

    def __init__(
        self,
        curve: MissRatioCurve,
        target: float,
        *,
        target_note: str = "",
        ceiling: int | None = None,
        known: tuple[Trial, ...] = (),
        bracket: bool = False,
    ) -> None:
        self.block_size = curve.block_size
        self.two_sided = bracket
        self.target = target
        self.target_note = target_note
        self.estimate = curve.smallest_size(target)
        # One-sided: the one size of the first round (at least a block above the estimate).
        e = max(self.estimate or 0, MIN_BLOCKS)
        self.first = max(round(e * STEP), e + 1)
        self.top = ceiling or max(4 * curve.largest_useful_size, 1 << 20)
        self.trials: dict[int, Trial] = {t.num_blocks: t for t in known}
        self.runs = 0  # check runs proposed
        self.rounds = 0
        self.grow = STEP
        self.pending: set[int] = set()

    def bracket(self) -> tuple[int | None, int | None]:
        """(largest size that failed below the smallest that passed, that smallest)."""
        hi = min((n for n, t in self.trials.items() if t.passed), default=None)
        lo = max(
            (n for n, t in self.trials.items() if not t.passed and (hi is None or n < hi)),
            default=None,
        )
        return lo, hi

    def done(self) -> bool:
        """Whether the search is over (no more rounds): out of runs, bracketed, or (one-sided)
        a size not above the first round's passed."""
        if self.estimate is None or self.runs >= MAX_RUNS:
            return True
        lo, hi = self.bracket()
        if hi is None:
            return False
        if lo is not None and _close(lo, hi):
            return True
        return not self.two_sided and hi <= self.first

    def next_round(self) -> list[int]:
        """The sizes of the next round; empty when the search is over."""
        if self.pending or self.done():
            return []
        assert self.estimate is not None
        lo, hi = self.bracket()
        e = max(self.estimate, MIN_BLOCKS)
        g = self.grow
        inside = (lo is None or e > lo) and (hi is None or e < hi)
        first = self.first
        if (
            self.rounds == 0
            and not self.two_sided
            and first not in self.trials
            and (lo is None or first > lo)
        ):
            points = [first]  # hi, if any, lies above it (`done` otherwise)
        elif self.rounds == 0 and self.two_sided and inside and e not in self.trials:
            points = [e, round(e * STEP)]
        elif hi is None:
            base = e if lo is None else lo
            points = [round(base * g), round(base * g * g)]
            self.grow = g * g
        elif lo is None:
            points = [int(hi / g), int(hi / (g * g))]
            self.grow = g * g
        elif hi > 2 * lo:  # far apart: thirds of the ratio
            r = hi / lo
            points = [int(lo * r ** (1 / 3)), int(lo * r ** (2 / 3))]
        else:
            points = [lo + (hi - lo) // 3, lo + 2 * (hi - lo) // 3]
        out: list[int] = []
        for n in points:
            n = min(n, self.top)
            fits = (lo is None or n > lo) and (hi is None or n < hi)
            if fits and n >= MIN_BLOCKS and n not in self.trials and n not in out:
                out.append(n)
        out = out[: min(ROUND, MAX_RUNS - self.runs)]
        self.rounds += 1
        self.runs += len(out)
        self.pending = set(out)
        return out

    def record(self, trial: Trial) -> None:
        self.trials[trial.num_blocks] = trial
        self.pending.discard(trial.num_blocks)

    def result(self, *, checked: bool = True, complete: bool = True) -> Recommendation:
        """The answer from the runs so far."""
        lo, hi = self.bracket()
        ended = ""
        if hi is not None and lo is not None and _close(lo, hi):
            ended = "bracketed"
        elif hi is not None and not self.two_sided and hi <= self.first:
            ended = "one-sided"
        elif hi is not None and self.runs >= MAX_RUNS:
            ended = "out of runs"
        ordered = tuple(sorted(self.trials.values(), key=lambda t: t.num_blocks))
        return Recommendation(
            self.block_size,
            self.target,
            self.target_note,
            self.estimate,
            hi,
            ordered,
            checked=checked,
            complete=complete,
            two_sided=self.two_sided,
            ended=ended,
        )


def recommend(
    curve: MissRatioCurve,
    target: float,
    run: Callable[[int], Trial],
    *,
    target_note: str = "",
    ceiling: int | None = None,
    known: tuple[Trial, ...] = (),
    bracket: bool = False,
) -> Recommendation:
    """Search for the smallest passing size, one run at a time (`Search`).

    `run(num_blocks)` simulates the workload at that size. `ceiling`: the largest size tried
    (default: 4 x the curve's flat point, or `1 << 20` blocks when the curve is empty).
    `bracket`: the two-sided search.
    """
    search = Search(
        curve, target, target_note=target_note, ceiling=ceiling, known=known, bracket=bracket
    )
    while sizes := search.next_round():
        for n in sizes:
            search.record(run(n))
    return search.result()


__all__ = [
    "MAX_RUNS",
    "PRECISION",
    "ROUND",
    "STEP",
    "Recommendation",
    "Search",
    "Trial",
    "recommend",
]
