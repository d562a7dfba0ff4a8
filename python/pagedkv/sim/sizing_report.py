"""How `--mrc` prints and saves: the curve as a table, the recommendation, their JSON."""

from __future__ import annotations

from typing import Any

import numpy as np

from pagedkv.sim.kv_bytes import KVBytes
from pagedkv.sim.mrc_curve import MissRatioCurve
from pagedkv.sim.sizing import MAX_RUNS, PRECISION, Recommendation, Trial

TABLE_ROWS = 24  # rows of the printed curve (--mrc-points); the JSON has more
START_FRACTION = 0.01  # the table starts where the curve reaches this share of its top
BAND = 1.25  # around the target: rows this ratio apart
BAND_ROWS = (-3, -2, -1, 1, 2)  # powers of BAND around the target's size (which is a row too)
MIN_ROWS = 4


def table_sizes(
    curve: MissRatioCurve, rows: int = TABLE_ROWS, targets: tuple[float, ...] = ()
) -> list[int]:
    """The sizes the table shows, from where the curve reaches 1% of its top to where it goes
    flat (that size last), about `rows` of them: rows `BAND` apart around each target's size;
    of the rest, half where the curve reaches equal steps of its top hit rate (so they crowd
    where it climbs, at the knee) and half spread evenly on a log scale (so a plateau shows)."""
    top = curve.largest_useful_size
    if top < 1:
        return [1]
    peak = curve.unbounded_hit_rate
    first = max(1, curve.smallest_size(START_FRACTION * peak) or 1)
    band: set[int] = set()
    for t in targets:
        e = curve.smallest_size(t)
        if e is None:
            continue
        band.add(max(1, e))
        band.update(max(1, round(e * BAND**k)) for k in BAND_ROWS)
    rest = max(4, rows - len(band))
    spread = rest // 2
    steps = rest - spread
    climb = {curve.smallest_size(peak * k / steps) or top for k in range(1, steps + 1)}
    even = {int(n) for n in np.unique(np.round(np.geomspace(first, top, spread)))}
    sizes = {first, top} | climb | even | {n for n in band if first <= n <= top}
    return sorted(n for n in sizes if n >= 1)


def mrc_table(
    curve: MissRatioCurve,
    kv: KVBytes | None,
    *,
    rows: int = TABLE_ROWS,
    targets: tuple[float, ...] = (),
    source: str = "",
) -> str:
    """The curve at a few sizes (`table_sizes`): blocks (tokens, GiB) against hit rate; the
    row where the curve first reaches a target says so. `source`: where the curve was
    recorded, when not in its own block size's run ("from the B=16 replay")."""
    bs = curve.block_size
    where = f"{source}; " if source else ""
    head = f"miss-ratio curve, block size {bs} ({where}{curve.method()}; {curve.lookups} prompts)"
    cols = ["blocks", "tokens", *(["GiB"] if kv else []), "hit rate"]
    table = [cols]
    marks: dict[int, str] = {}
    for t in targets:
        e = curve.smallest_size(t)
        if e is not None:
            marks[max(1, e)] = f"  <- reaches the target {t:.2%} (the curve's estimate)"
    sizes = table_sizes(curve, rows, targets)
    notes = []
    for n in sizes:
        row = [str(n), str(n * bs)]
        if kv:
            row.append(f"{kv.gib(n, bs):.2f}")
        row.append(f"{curve.hit_rate(n):.2%}")
        table.append(row)
        notes.append(marks.get(n, ""))
    widths = [max(len(r[i]) for r in table) for i in range(len(cols))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in table]
    for i, note in enumerate(notes, 1):
        lines[i] += note
    lines.insert(1, "  ".join("-" * w for w in widths))
    lines[-1] += "  (flat from here: every hit the workload has)"
    return "\n".join([head, *("  " + line for line in lines)])


def _size(n: int, bs: int, kv: KVBytes | None) -> str:
    gib = f" = {kv.gib(n, bs):.2f} GiB" if kv else ""
    return f"{n} blocks ({n * bs} tokens{gib})"


def _run(t: Trial) -> str:
    what = "ok" if t.passed else "(" + t.why() + ")"
    return f"{t.num_blocks} {what}" + (" [the curve's own run]" if t.source == "curve" else "")


def _lower_side(r: Recommendation, n: int) -> str:
    """Why no failing size lies just below the answer `n` (`r.lower_checked` is False)."""
    e = r.estimate
    if r.ended == "one-sided":
        if e is not None and e < n and e not in {t.num_blocks for t in r.trials}:
            return (
                f"passed a full run; the curve's estimate {e}, {1 - e / n:.0%} below, was not "
                "run (add --bracket to check it)"
            )
        return "passed a full run; the sizes below it were not run (add --bracket to check them)"
    if r.ended == "out of runs":
        return (
            f"the runs ran out ({MAX_RUNS} per block size) before a size within "
            f"{PRECISION:.0%} below it was found to fail"
        )
    return f"no size within {PRECISION:.0%} below it was found to fail"


# Printed after the answer and the curves: the replay's own size is not the answer.
CURVE_RUN_HEADING = "curve run   the replay that recorded the curve, at its own configured size"


def recommendation_lines(recs: list[Recommendation], kv: KVBytes | None) -> str:
    """The summary's last lines: per block size, the smallest size that passed (or, without
    check runs, the curve's estimate, marked as such)."""
    lines = ["sizing      the smallest cache that reaches the target hit rate, no preemption"]
    for r in recs:
        bs = r.block_size
        head = f"  block {bs:<4}target {r.target:.2%}{r.target_note}: "
        if r.estimate is None:
            lines.append(head + "no cache size reaches it (the curve is flat below it)")
            continue
        estimate = _size(r.estimate, bs, kv)
        if not r.checked:
            lines.append(
                head + f"{estimate}: the curve's estimate, not checked by full runs (--mrc-only)"
            )
            continue
        checks = [t for t in r.trials if t.source == "check"]
        best = r.passed
        if best is None:
            verdict = "none of the sizes tried passed" if checks else "no check run finished"
            lines.append(head + f"{verdict}; the curve's estimate is {estimate}")
        else:
            lines.append(
                head + f"{_size(best.num_blocks, bs, kv)}, hit rate {best.hit_rate:.2%} "
                f"(curve estimate {r.estimate})"
            )
            if not r.lower_checked and r.complete:
                lines.append("              " + _lower_side(r, best.num_blocks))
        if not r.complete:
            lines.append("              interrupted: the search did not finish")
        lines.append(f"              runs: {', '.join(_run(t) for t in r.trials) or 'none'}")
    if any(t.stopped for r in recs for t in r.trials):
        lines.append(
            "              (a run that stopped early could no longer pass: a preemption, a "
            "rejection, or too few hits left to reach the target)"
        )
    return "\n".join(lines)


def curve_json(curve: MissRatioCurve, extra_sizes: list[int] | None = None) -> dict[str, Any]:
    """`mrc` (`[num_blocks, hit_rate]` pairs: 96 sizes evenly spread on a log scale, plus
    `extra_sizes`, the printed table's) and how it was computed (`mrc_info`)."""
    points = {int(n): h for n, h in curve.points()}
    for n in extra_sizes or ():
        points[n] = curve.hit_rate(n)
    return {
        "mrc": [[n, points[n]] for n in sorted(points)],
        "mrc_info": {
            "method": "exact" if curve.exact else "shards",
            "sample_rate": curve.sample_rate,
            "block_size": curve.block_size,
            "unbounded_hit_rate": curve.unbounded_hit_rate,
            "flat_from_blocks": curve.largest_useful_size,
            "distinct_blocks": curve.distinct_blocks,
            "prompt_lookups": curve.lookups,
            "prompt_tokens": curve.prompt_tokens,
            "touches": curve.touches,
        },
    }


def recommendation_json(r: Recommendation, kv: KVBytes | None) -> dict[str, Any]:
    bs = r.block_size
    best = r.passed
    return {
        "block_size": bs,
        "target_hit_rate": r.target,
        "curve_estimate_blocks": r.estimate,
        "curve_estimate_gib": kv.gib(r.estimate, bs) if kv and r.estimate is not None else None,
        "checked": r.checked,
        "complete": r.complete,
        "search": "bracket" if r.two_sided else "one-sided",
        # A size within PRECISION below the answer was run and failed (the answer bracketed).
        "lower_side_checked": r.lower_checked,
        "search_ended": r.ended or None,  # "bracketed", "one-sided", "out of runs"
        "largest_fail_below_blocks": fail.num_blocks if (fail := r.largest_fail) else None,
        "num_blocks": r.num_blocks,
        "gib": kv.gib(r.num_blocks, bs) if kv and r.num_blocks is not None else None,
        "hit_rate": best.hit_rate if best else None,
        "runs": [
            {
                "num_blocks": t.num_blocks,
                "hit_rate": t.hit_rate,
                "preemptions": t.preemptions,
                "rejected_requests": t.rejected,
                "passed": t.passed,
                "stopped_early": t.stopped or None,
                "source": t.source,
            }
            for t in r.trials
        ],
    }


__all__ = [
    "CURVE_RUN_HEADING",
    "curve_json",
    "mrc_table",
    "recommendation_json",
    "recommendation_lines",
    "table_sizes",
]
