"""Tenants side by side (`simulate --noisy-neighbour`): a loud tenant beside a quiet one.

The workload has two cache salts. The quiet tenant sends a few requests, each one of its
few system prompts plus a short question of its own: alone, it hits most of its prompt
tokens. The loud tenant sends `ratio` times as many requests, each a long document drawn
from many (a Zipf law, so some repeat) plus a question: its working set is far larger than
the cache, so alone it thrashes, and beside the quiet tenant it evicts the quiet tenant's
system prompts between two of its requests.

The same pool replays four ways: the quiet tenant's requests alone (the baseline), both
tenants with no quotas, both with a reserve of CACHED blocks for the quiet tenant
(`set_tenant_quota(reserved=)`: no eviction takes it below while another tenant has blocks
to give), and both with a cap on the loud tenant's CACHED blocks (`max_cached=`). Each row
gives the quiet tenant's hit rate (its prefix-hit tokens over its prompt tokens, recomputes
included) and that rate as a share of its rate alone; the goal (issue 35) is that with a
reserve the quiet tenant keeps at least 90% of it.
"""

from __future__ import annotations

import argparse
import dataclasses
import random
from dataclasses import dataclass, field
from typing import Any, TextIO

import numpy as np
import numpy.typing as npt

from pagedkv import BlockManager
from pagedkv.sim.requests import VOCAB_SIZE, Request, Workload

QUIET, LOUD = "quiet", "loud"


@dataclass(frozen=True, slots=True)
class NoisySetup:
    """The workload's and the pool's sizes (defaults: the command's; the test uses fewer)."""

    quiet_requests: int = 40
    ratio: int = 10  # loud requests per quiet request
    seed: int = 0
    num_blocks: int = 1024
    block_size: int = 16
    quiet_prompts: int = 4  # the quiet tenant's system prompts
    quiet_prompt_tokens: int = 768
    loud_docs: int = 60  # the loud tenant's documents (a Zipf law picks one per request)
    loud_doc_tokens: int = 1536
    question_tokens: int = 48  # each request's own tail
    new_tokens: int = 4  # tokens each request generates
    steps_per_quiet: int = 20  # mean steps between two quiet arrivals
    max_num_batched_tokens: int = 4096
    # Few tokens generated: the loud tenant's running requests hold a fraction of the pool,
    # so its CACHED blocks are what the tenants compete for (a reserve protects CACHED
    # blocks; blocks held by running sequences are never evicted, whoever's they are).

    @property
    def quiet_blocks(self) -> int:
        """The quiet tenant's shared working set in blocks (its system prompts)."""
        return self.quiet_prompts * -(-self.quiet_prompt_tokens // self.block_size)

    @property
    def reserve(self) -> int:
        """The reserve the table gives the quiet tenant: its system prompts plus a third for
        the question blocks its requests cache beside them. A reserve of the system prompts
        alone leaves no room for those: the tenant is then above its reserve, so its own
        least recently released blocks, system prompts among them, are victims again."""
        return self.quiet_blocks * 4 // 3

    @property
    def cap(self) -> int:
        """The loud tenant's cap in the table: a quarter of the pool."""
        return self.num_blocks // 4


def noisy_workload(setup: NoisySetup) -> Workload:
    """Both tenants' requests, interleaved by arrival step (see the module docstring)."""
    if setup.quiet_requests < 1 or setup.ratio < 1:
        raise ValueError("quiet_requests and ratio must be >= 1")
    rng = random.Random(setup.seed)
    np_rng = np.random.default_rng(setup.seed)

    def tokens(n: int) -> npt.NDArray[np.uint32]:
        return np_rng.integers(0, VOCAB_SIZE, size=n, dtype=np.uint32)

    quiet = [tokens(setup.quiet_prompt_tokens) for _ in range(setup.quiet_prompts)]
    docs = [tokens(setup.loud_doc_tokens) for _ in range(setup.loud_docs)]
    weights = [1.0 / (i + 1) for i in range(setup.loud_docs)]
    span = setup.quiet_requests * setup.steps_per_quiet
    plan: list[tuple[int, str, npt.NDArray[np.uint32]]] = [
        (rng.randrange(span), QUIET, quiet[rng.randrange(len(quiet))])
        for _ in range(setup.quiet_requests)
    ]
    for _ in range(setup.quiet_requests * setup.ratio):
        doc = docs[rng.choices(range(len(docs)), weights)[0]]
        plan.append((rng.randrange(span), LOUD, doc))
    plan.sort(key=lambda p: p[0])
    requests = []
    for i, (step, salt, head) in enumerate(plan):
        prompt = np.concatenate([head, tokens(setup.question_tokens)])
        requests.append(
            Request(
                i,
                len(prompt),
                setup.new_tokens,
                cache_salt=salt,
                arrival_step=step,
                kind=salt,
                prompt_tokens=prompt,
            )
        )
    return Workload(tuple(requests), setup.seed, name="noisy-neighbour")


@dataclass(slots=True)
class TenantHits:
    """A `ScheduleObserver` that counts prompt and hit tokens per cache salt."""

    prompt: dict[str | bytes | None, int] = field(default_factory=dict)
    hits: dict[str | bytes | None, int] = field(default_factory=dict)

    def rate(self, salt: str) -> float:
        return self.hits.get(salt, 0) / self.prompt[salt] if self.prompt.get(salt) else 0.0

    def allocate(
        self,
        seq_id: int,
        token_ids: Any,
        hit_tokens: int,
        scheduled: int,
        *,
        cache_salt: str | bytes | None = None,
        lora_id: int | None = None,
    ) -> None:
        self.prompt[cache_salt] = self.prompt.get(cache_salt, 0) + len(token_ids)
        self.hits[cache_salt] = self.hits.get(cache_salt, 0) + hit_tokens

    def extend(self, seq_id: int, num_new_tokens: int) -> None: ...
    def append(self, seq_id: int, token_ids: Any) -> None: ...
    def decode(self, seq_ids: list[int], token_ids: Any) -> None: ...
    def fork(self, parent_id: int, child_id: int) -> None: ...
    def swap_out(self, seq_id: int) -> None: ...
    def swap_in(self, seq_id: int) -> None: ...
    def free(self, seq_id: int) -> None: ...


@dataclass(frozen=True, slots=True)
class NoisyRow:
    label: str
    quiet_rate: float
    loud_rate: float | None  # None: the loud tenant did not run
    quotas: dict[str, dict[str, int | None]]


def noisy_run(
    setup: NoisySetup,
    workload: Workload,
    label: str,
    quotas: dict[str, dict[str, int | None]],
) -> NoisyRow:
    """One replay of `workload` on the setup's pool, with `quotas` per cache salt
    (`max_cached`, `reserved`), telling each tenant's hit rate."""
    # imported by a run only: `add_noisy_arguments` is defined for every `simulate` command
    from pagedkv.sim.scheduler import run_workload

    m = BlockManager(setup.num_blocks, setup.block_size, tenants=True)
    for salt, q in quotas.items():
        m.set_tenant_quota(salt, max_cached=q.get("max_cached"), reserved=q.get("reserved") or 0)
    tally = TenantHits()
    run_workload(m, workload, watch=tally, max_num_batched_tokens=setup.max_num_batched_tokens)
    loud = tally.rate(LOUD) if tally.prompt.get(LOUD) else None
    return NoisyRow(label, tally.rate(QUIET), loud, quotas)


def noisy_rows(setup: NoisySetup) -> list[NoisyRow]:
    """The four runs of the module docstring, the quiet tenant alone first."""
    both = noisy_workload(setup)
    alone = Workload(
        tuple(r for r in both.requests if r.cache_salt == QUIET), setup.seed, name="quiet alone"
    )
    reserve, cap = setup.reserve, setup.cap
    return [
        noisy_run(setup, alone, "quiet tenant alone", {}),
        noisy_run(setup, both, "both, no quotas", {}),
        noisy_run(
            setup, both, f"both, quiet reserve {reserve} blocks", {QUIET: {"reserved": reserve}}
        ),
        noisy_run(setup, both, f"both, loud cap {cap} blocks", {LOUD: {"max_cached": cap}}),
    ]


def noisy_table(setup: NoisySetup, rows: list[NoisyRow]) -> str:
    alone = rows[0].quiet_rate
    width = max(len(r.label) for r in rows)
    lines = [
        f"noisy neighbour: the quiet tenant sends {setup.quiet_requests} requests, the loud "
        f"one {setup.quiet_requests * setup.ratio} ({setup.ratio}x); {setup.num_blocks} "
        f"blocks of {setup.block_size} tokens, seed {setup.seed}",
        f"  {'run':<{width}}  {'quiet hit rate':>14}  {'of alone':>8}  {'loud hit rate':>13}",
    ]
    for r in rows:
        share = f"{100 * r.quiet_rate / alone:.1f}%" if alone else "-"
        loud = "-" if r.loud_rate is None else f"{100 * r.loud_rate:.1f}%"
        lines.append(f"  {r.label:<{width}}  {100 * r.quiet_rate:>13.1f}%  {share:>8}  {loud:>13}")
    return "\n".join(lines)


def add_noisy_arguments(sim: argparse.ArgumentParser) -> None:
    sim.add_argument_group("tenants side by side").add_argument(
        "--noisy-neighbour",
        action="store_true",
        help="replay a built-in workload of two tenants, one sending 10x the requests of the "
        "other, alone, together, with a reserve for the quiet tenant and with a cap on the "
        "loud one, and print the quiet tenant's hit rate against its rate alone (--seed "
        "picks the workload; --json writes the rows)",
    )


def simulate_noisy(args: argparse.Namespace, out: TextIO) -> int:
    """`simulate --noisy-neighbour`: the table at the command's sizes."""
    from pagedkv.sim.report import write_doc

    if args.trace is not None or args.workload is not None or args.why:
        raise ValueError(
            "--noisy-neighbour builds its own two-tenant workload and pool: not with --trace, "
            "--workload or --why"
        )
    setup = NoisySetup(seed=args.seed)
    rows = noisy_rows(setup)
    print(noisy_table(setup, rows), file=out)
    if args.json:
        alone = rows[0].quiet_rate
        doc = {
            "setup": dataclasses.asdict(setup),
            "rows": [
                {**dataclasses.asdict(r), "quiet_of_alone": r.quiet_rate / alone if alone else None}
                for r in rows
            ],
        }
        write_doc(args.json, doc)
        print(f"json        {args.json}", file=out)
    return 0


__all__ = [
    "NoisyRow",
    "NoisySetup",
    "TenantHits",
    "add_noisy_arguments",
    "noisy_rows",
    "noisy_run",
    "noisy_table",
    "noisy_workload",
    "simulate_noisy",
]
