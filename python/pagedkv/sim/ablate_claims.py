"""The published claims, each checked on a workload of the kind it speaks of
(`simulate --ablate-claims`).

A claim holds when the measured effect goes the claimed way and reaches at least half the
claimed size (`HOLD_FRACTION`); a claimed cost ("at about +5% latency") holds when the
measured cost is at most twice the claimed one. Nothing is decided in advance: every verdict
is computed from the runs' figures. What each claim measures:

- fork sharing cuts beam-search memory ~40%: the mean memory held by sequences (tokens of
  held blocks), beams sharing against beams copying, on `beam`, in a pool large enough that
  neither preempts;
- delayed reclaim raises memory utilisation ~15% on many short sequences: utilisation is the
  mean share of the pool holding KV a request uses or can still reuse (held + cached), kept
  until needed against reclaimed at once, on `short`;
- keeping recently freed (hot) blocks cuts allocation latency ~30%: the mean time of one
  `allocate` call, blocks kept against reclaimed at once, on `short`, best of `repeats`. The
  manager always reuses free blocks last-freed first (LIFO); what a CPU simulator cannot see
  is the GPU side of "hot" (L2 residency of a reused block), so this measures the
  allocator's own latency: a kept block is revived by a hit instead of being taken, hashed
  and registered again;
- prefix sharing on highly repetitive prompts cuts memory ~40% (utilisation +30%): mean
  memory held, and tokens per held slot (the running sequences' tokens over the slots of the
  blocks they hold, above 1 when they share), prefix caching on against off, on `repetitive`;
- lz4 on cold blocks gives ~+15% capacity at ~+5% latency on long conversations: a host tier
  of the same bytes, lz4 against raw, on `long-chat`; capacity = how many more blocks the
  lz4 tier holds than the raw one at equal bytes, latency = the manager time (tier work included);
  needs the lz4 package (`pip install '.[tiers]'`);
- block size shows a U-shaped curve: of the manager time per workload token (prompt and
  generated) at equal cache tokens, 8..256, best of `repeats`: small blocks mean more blocks
  per token (left arm), large ones more fragmentation, fewer hits and more preemptions
  (right arm). It holds when the minimum is inside the range and both ends are at least 10%
  above it. A GPU's kernel efficiency at small blocks (the published curve's left arm) is
  out of a CPU simulator's reach.

The timed claims (`TIMED`: their figures are CPU or wall times, which a busy machine moves) must
stand clear of their rule: each threshold is moved `MARGIN` (a share of it) up and down, and a
verdict that changes within that band is "narrow". They run `rounds` times; one is HELD or DID
NOT HOLD only when every round agrees and none is narrow, INCONCLUSIVE otherwise (each round's
verdict is printed, so a reader sees how they disagreed). The other claims count blocks and
tokens, the same in every run: they run once and are judged by the rule as stated.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, TypedDict

from pagedkv.config import BlockManagerConfig
from pagedkv.sim.ablate import Variant, run_variant
from pagedkv.sim.ablate_report import compression_effect
from pagedkv.sim.claim_workloads import build_claim_workload
from pagedkv.sim.kv_bytes import from_model
from pagedkv.sim.option_names import BLOCK_SIZES
from pagedkv.sim.requests import Workload
from pagedkv.sim.tier_run import DEFAULT_MODEL, TierOptions
from pagedkv.sim.workloads import build_workload

HOLD_FRACTION = 0.5  # a benefit holds at half its claimed size or more; a cost at twice or less
U_MARGIN = 0.10  # the ends of a U stand this much above its minimum
MARGIN = 0.2  # a verdict must not change with the rule's thresholds moved 20% either way
TIMED = ("hot", "lz4", "block-size")  # claims measured in time: run `rounds` times
Rule = Callable[[float], bool]  # a claim's rule at a slack (-MARGIN..MARGIN: thresholds moved)


@dataclass(frozen=True, slots=True)
class ClaimResult:
    claim: str  # as published
    workload: str
    measured: str  # the figures, in words
    held: bool | None  # None: not run, or the rounds disagree
    why: str = ""  # the rule applied, or why it was not run
    figures: dict[str, Any] | None = None
    narrow: bool = False  # the verdict changes with the thresholds moved by MARGIN
    rounds: tuple[str, ...] = field(default=())  # each round's verdict, when run in rounds

    @property
    def verdict(self) -> str:
        if self.held is None:
            return "inconclusive" if self.rounds or self.narrow else "not run"
        if self.narrow:
            return "inconclusive"
        return "held" if self.held else "did not hold"

    def as_dict(self) -> dict[str, Any]:
        return {
            "claim": self.claim,
            "workload": self.workload,
            "measured": self.measured,
            "held": self.held if self.verdict != "inconclusive" else None,
            "verdict": self.verdict,
            "narrow": self.narrow,
            "rounds": list(self.rounds),
            "why": self.why,
            "figures": self.figures or {},
        }


def benefit_holds(measured: float, claimed: float, slack: float = 0.0) -> bool:
    """A claimed benefit (a positive fraction) holds at `HOLD_FRACTION` of it or more (the
    threshold raised by `slack` of itself; lowered when negative)."""
    return measured >= HOLD_FRACTION * claimed * (1 + slack)


def cost_holds(measured: float, claimed: float, slack: float = 0.0) -> bool:
    """A claimed cost (a positive fraction) holds at twice it or less (the bound lowered by
    `slack` of itself)."""
    return measured <= claimed / HOLD_FRACTION * (1 - slack)


def u_shape(xs: Sequence[int], ys: Sequence[float], slack: float = 0.0) -> tuple[bool, int]:
    """Whether `ys` over `xs` is U-shaped (minimum inside, both ends `U_MARGIN` above it,
    raised by `slack` of itself), and the x of the minimum."""
    i = min(range(len(ys)), key=lambda k: ys[k])
    low = ys[i]
    inside = 0 < i < len(ys) - 1
    return inside and min(ys[0], ys[-1]) >= low * (1 + U_MARGIN * (1 + slack)), xs[i]


class Judged(TypedDict):
    held: bool
    narrow: bool


def judged(rule: Rule) -> Judged:
    """`held` (the rule as stated) and `narrow` (whether it changes with the thresholds moved
    `MARGIN` up or down), for `ClaimResult(..., **judged(rule))`."""
    return {"held": rule(0.0), "narrow": rule(MARGIN) != rule(-MARGIN)}


@dataclass(slots=True)
class ClaimRunner:
    """What every claim's runs share: sizes, scheduling, repeats, progress."""

    requests: int
    seed: int
    schedule: dict[str, Any]
    repeats: int = 3
    progress: Callable[[str], Callable[[int, int], None] | None] | None = None

    def run(self, workload: Workload, variant: Variant) -> dict[str, Any]:
        bar = self.progress(f"{workload.name}: {variant.name}") if self.progress else None
        try:
            return run_variant(workload, variant, self.schedule, progress=bar, repeats=self.repeats)
        finally:
            close = getattr(bar, "close", None)
            if close is not None:
                close()

    def best(self, workload: Workload, variant: Variant, key: str) -> dict[str, Any]:
        """The run with the least `key` (a time) of `repeats` runs: timing noise only adds
        (for the tiered runs, timed in wall time within the run)."""
        runs = [self.run(workload, variant) for _ in range(max(1, self.repeats))]
        return min(runs, key=lambda f: f[key] if f[key] is not None else float("inf"))


def _config(num_blocks: int, block_size: int = 16, cpu: int = 512) -> BlockManagerConfig:
    return BlockManagerConfig(num_blocks=num_blocks, block_size=block_size, num_cpu_blocks=cpu)


def _pool_note(*runs: dict[str, Any]) -> str:
    p = sum(f["preemptions"] for f in runs)
    return f"; {p} preemptions" if p else "; no preemptions"


def fork_sharing(r: ClaimRunner) -> ClaimResult:
    w = build_workload("beam", r.requests, seed=r.seed, arrival_rate=1.0)
    cfg = _config(32768)
    share = r.run(w, Variant("share", "full", cfg))
    copy = r.run(w, Variant("copy", "fork sharing", cfg, fork_copies=True))
    cut = 1 - share["mean_used_tokens"] / copy["mean_used_tokens"]
    peak = 1 - share["peak_used_tokens"] / copy["peak_used_tokens"]
    return ClaimResult(
        "fork sharing cuts beam-search memory ~40%",
        w.describe(),
        f"mean memory held {cut:.1%} less sharing than copying (peak {peak:.1%}); "
        f"{copy['copied_forks']} forks copied" + _pool_note(share, copy),
        why="held if the mean cut >= 20%",
        figures={"mean_cut": cut, "peak_cut": peak},
        **judged(lambda s: benefit_holds(cut, 0.40, s)),
    )


def delayed_reclaim(r: ClaimRunner) -> ClaimResult:
    w = build_claim_workload("short", r.requests, seed=r.seed)
    cfg = _config(1024)
    kept = r.run(w, Variant("kept", "full", cfg))
    once = r.run(w, Variant("at once", "delayed reclaim", cfg, window=0))
    gain = kept["pool_in_use"] / once["pool_in_use"] - 1 if once["pool_in_use"] else 0.0
    hit = 100 * (kept["workload_hit_rate"] - once["workload_hit_rate"])
    return ClaimResult(
        "delayed reclaim raises memory utilisation ~15% on many short sequences",
        w.describe(),
        f"pool in use (held + cached) {once['pool_in_use']:.1%} -> {kept['pool_in_use']:.1%} "
        f"= {gain:+.1%}; workload hit rate {hit:+.2f} points" + _pool_note(kept, once),
        why="held if utilisation rises >= 7.5% (relative)",
        figures={"utilisation_gain": gain, "hit_points": hit},
        **judged(lambda s: benefit_holds(gain, 0.15, s)),
    )


def hot_blocks(r: ClaimRunner) -> ClaimResult:
    w = build_claim_workload("short", r.requests, seed=r.seed)
    cfg = _config(1024)
    key = "allocate_mean_seconds"
    kept = r.run(w, Variant("kept", "full", cfg))
    once = r.run(w, Variant("at once", "delayed reclaim", cfg, window=0))
    cut = 1 - kept[key] / once[key]
    return ClaimResult(
        "keeping recently freed (hot) blocks cuts allocation latency ~30%",
        w.describe(),
        f"mean allocate call {once[key] * 1e6:.2f} us reclaimed at once -> "
        f"{kept[key] * 1e6:.2f} us kept = {cut:.1%} less (CPU time, calls replayed, best of "
        f"{r.repeats}; the "
        "allocator's CPU time only: GPU L2 warmth is not simulated)",
        why="held if allocate is >= 15% faster",
        figures={"allocate_cut": cut},
        **judged(lambda s: benefit_holds(cut, 0.30, s)),
    )


def prefix_sharing(r: ClaimRunner) -> ClaimResult:
    w = build_claim_workload("repetitive", r.requests, seed=r.seed)
    cfg = _config(32768)
    on = r.run(w, Variant("on", "full", cfg))
    off = r.run(w, Variant("off", "prefix caching", replace(cfg, enable_prefix_caching=False)))
    cut = 1 - on["mean_used_tokens"] / off["mean_used_tokens"]
    util = on["tokens_per_slot"] / off["tokens_per_slot"] - 1
    return ClaimResult(
        "prefix sharing on highly repetitive prompts cuts memory ~40% (utilisation +30%)",
        w.describe(),
        f"mean memory held {cut:.1%} less; tokens per held slot {off['tokens_per_slot']:.2f} "
        f"-> {on['tokens_per_slot']:.2f} = {util:+.1%}" + _pool_note(on, off),
        why="held if memory falls >= 20% and utilisation rises >= 15%",
        figures={"memory_cut": cut, "utilisation_gain": util},
        **judged(lambda s: benefit_holds(cut, 0.40, s) and benefit_holds(util, 0.30, s)),
    )


def compression(r: ClaimRunner) -> ClaimResult:
    claim = "lz4 on cold blocks gives ~+15% capacity at ~+5% latency on long conversations"
    w = build_claim_workload("long-chat", r.requests, seed=r.seed)
    why = tiers_unavailable()
    if why is not None:
        return ClaimResult(claim, w.describe(), "not run", None, why)
    kv = from_model(DEFAULT_MODEL)
    cfg = _config(1024, cpu=0)
    host = TierOptions(kv=kv, host_bytes=cfg.num_blocks * kv.per_block(16) // 2, data="real")
    key = "ablation_manager_seconds"
    raw = r.best(w, Variant("raw", "compression", cfg, tiers=host), key)
    lz4 = r.best(w, Variant("lz4", "compression", cfg, tiers=replace(host, compress="lz4")), key)
    e = compression_effect([raw, lz4])
    assert e is not None
    # Aside, not the verdict: the byte shuffle that suits 2-byte KV.
    shuffled = r.run(
        w, Variant("shuffle", "compression", cfg, tiers=replace(host, compress="shuffle+lz4"))
    )
    e["shuffle_lz4_capacity"] = shuffled["compression_ratio"] / raw["compression_ratio"] - 1.0
    return ClaimResult(
        claim,
        w.describe(),
        f"host tier of half the GPU pool's bytes: capacity {e['capacity']:+.1%} (blocks held "
        f"at equal bytes), manager time {e['latency']:+.1%} (wall, tier work included, best "
        f"of {r.repeats} runs), "
        f"workload hit rate {e['hit_points']:+.2f} points; aside, shuffle+lz4 "
        f"{e['shuffle_lz4_capacity']:+.1%} capacity. The KV is the simulator's (layer 0 of a "
        "random-weight decoder, bfloat16): a real model's KV may compress otherwise",
        why="held if capacity rises >= 7.5% and time rises <= 10%",
        figures=e,
        **judged(
            lambda s: benefit_holds(e["capacity"], 0.15, s) and cost_holds(e["latency"], 0.05, s)
        ),
    )


def block_size_curve(r: ClaimRunner, sizes: Sequence[int] = BLOCK_SIZES) -> ClaimResult:
    w = build_workload("mixed", r.requests, seed=r.seed)
    tokens = 4096 * 16
    key = "ablation_manager_seconds"
    ys, hits, frags, steps, preempt = [], [], [], [], []
    for bs in sizes:
        cfg = _config(tokens // bs, bs)
        f = r.run(w, Variant(f"block size {bs}", "block size", cfg))
        work = f["workload_prompt_tokens"] + f["generated_tokens"]
        ys.append(f[key] * 1e9 / work if work else 0.0)
        hits.append(f["workload_hit_rate"])
        frags.append(f["fragmentation"])
        steps.append(f["num_steps"])
        preempt.append(f["preemptions"])
    low = u_shape(sizes, ys)[1]
    curve = ", ".join(f"{bs}: {y:.0f}" for bs, y in zip(sizes, ys, strict=True))
    return ClaimResult(
        "block size shows a U-shaped curve",
        w.describe() + f"; {tokens} cache tokens at every size",
        f"manager CPU ns per workload token {curve} (minimum at {low}; calls replayed, best "
        f"of {r.repeats}); hit "
        f"rate {hits[0]:.1%} at {sizes[0]} -> {hits[-1]:.1%} at {sizes[-1]}, fragmentation "
        f"{frags[0]:.1%} -> {frags[-1]:.1%}, preemptions {preempt[0]} -> {preempt[-1]}, steps "
        f"{steps[0]} -> {steps[-1]} (the right arm shows there; the left arm of a GPU's kernel "
        "efficiency is not simulated)",
        why=f"held if the minimum is inside {sizes[0]}..{sizes[-1]} and both ends >= "
        f"{U_MARGIN:.0%} above it",
        figures={
            "ns_per_token": dict(zip(sizes, ys, strict=True)),
            "hit_rate": hits,
            "frag": frags,
            "steps": steps,
            "preemptions": preempt,
        },
        **judged(lambda s: u_shape(sizes, ys, s)[0]),
    )


def tiers_unavailable() -> str | None:
    """Why the tier run cannot run here, or None."""
    try:
        import lz4  # noqa: F401
    except ImportError:
        return "the lz4 row needs the lz4 package: pip install 'pagedkv[tiers]'"
    return None


CLAIMS: dict[str, Callable[[ClaimRunner], ClaimResult]] = {
    "fork": fork_sharing,
    "reclaim": delayed_reclaim,
    "hot": hot_blocks,
    "prefix": prefix_sharing,
    "lz4": compression,
    "block-size": block_size_curve,
}


def _round_word(c: ClaimResult) -> str:
    return c.verdict if not c.narrow else f"{'held' if c.held else 'did not hold'}, narrowly"


def in_rounds(results: Sequence[ClaimResult]) -> ClaimResult:
    """One claim's rounds as one result: the first round's figures, its verdict when every
    round agrees and none is narrow, else inconclusive (`held` None); each round's verdict
    kept in `rounds`."""
    first = results[0]
    if len(results) == 1:
        return first
    words = tuple(_round_word(c) for c in results)
    agree = len({c.held for c in results}) == 1 and not any(c.narrow for c in results)
    return replace(
        first,
        held=first.held if agree else None,
        narrow=first.narrow if agree else False,
        rounds=words,
        measured=first.measured + f" (round 1 of {len(results)})",
    )


def check_claims(
    runner: ClaimRunner,
    names: Sequence[str] | None = None,
    *,
    rounds: int = 3,
    claims: Mapping[str, Callable[[ClaimRunner], ClaimResult]] = CLAIMS,
    timed: Sequence[str] = TIMED,
) -> list[ClaimResult]:
    """Run the claims named (default all, in `claims` order); each timed one `rounds` times
    (the others measure counts, the same every round)."""
    if rounds < 1:
        raise ValueError(f"--claim-rounds must be >= 1, got {rounds}")
    chosen = list(claims) if names is None else list(names)
    for n in chosen:
        if n not in claims:
            raise ValueError(f"unknown claim {n!r}; choose from {', '.join(claims)}")
    out = []
    for n in chosen:
        if n not in timed:  # counts: the same every run, judged by the rule as stated
            out.append(replace(claims[n](runner), narrow=False))
            continue
        runs = [claims[n](runner) for _ in range(rounds)]
        out.append(in_rounds(runs) if runs[0].held is not None else runs[0])
    return out


def claims_table(results: Sequence[ClaimResult]) -> str:
    """claim / workload / measured / held, one block per claim."""
    lines = []
    for c in results:
        lines += [
            f"{c.verdict.upper():<13} {c.claim}",
            f"  workload    {c.workload}",
            f"  measured    {c.measured}",
            f"  rule        {c.why}",
        ]
        if c.narrow:
            lines.append(
                f"  margin      the verdict changes with the thresholds moved {MARGIN:.0%} "
                "either way: too close to call"
            )
        if c.rounds:
            lines.append(f"  rounds      {'; '.join(c.rounds)}")
        lines.append("")
    return "\n".join(lines).rstrip()


__all__ = [
    "CLAIMS",
    "HOLD_FRACTION",
    "MARGIN",
    "TIMED",
    "ClaimResult",
    "ClaimRunner",
    "benefit_holds",
    "check_claims",
    "claims_table",
    "cost_holds",
    "in_rounds",
    "judged",
    "u_shape",
]
