"""Random programs with shared prefixes (tests/vllm/test_scheduler_differential.py's: a full
and a window group on a small pool, preemptions, prefixes computed twice at once), under
vLLM's scheduler with sparse window retention: pagedkv schedules every step as vLLM's
manager with pagedkv's duplicate rule grafted on (`vllm_engine.duplicate_rule`), free
blocks and finishes included, under the engine's setting (0) as under None. Against stock
vLLM such programs differ only through that rule (docs/vllm.md: 3 of 30 with None, measured
4 of 30 with 0 on 2026-12-06 under vLLM 0.33)."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("vllm")

from test_scheduler_differential import random_program
from vllm_engine.duplicate_rule import duplicate_rule
from vllm_schedules import Program, first_difference, run


def program(seed: int, drafts: int, retention: int | None) -> Program:
    p = random_program(seed, num_drafts=drafts, window=32, shared=True)
    p.config["retention_interval"] = retention
    return p


def cases() -> list[Any]:
    return [
        pytest.param(seed, drafts, retention, id=f"r{retention}-d{drafts}-{seed}")
        for retention in (None, 0)
        for drafts in (0, 2)
        for seed in range(30)
    ]


@pytest.mark.parametrize(("seed", "drafts", "retention"), cases())
def test_schedules_as_vllm_with_the_duplicate_rule(
    seed: int, drafts: int, retention: int | None
) -> None:
    p = program(seed, drafts, retention)
    ours = run("pagedkv", p)
    with duplicate_rule():
        theirs = run("vllm", p)
    assert first_difference(theirs, ours) is None, first_difference(theirs, ours)


@pytest.mark.parametrize("drafts", [0, 2])
def test_the_setting_changes_most_schedules(drafts: int) -> None:
    """So the programs above check the mask: under vLLM 0.33, 25 (no drafts) and 26 (two
    drafts) of the 30 programs schedule differently with 0 than with None."""
    apart = sum(
        first_difference(
            run("pagedkv", program(s, drafts, None)), run("pagedkv", program(s, drafts, 0))
        )
        is not None
        for s in range(30)
    )
    assert apart >= 15
