"""pagedkv under vLLM 0.33's own scheduler against vLLM's manager under the same scheduler:
the same program of requests must give the same schedule, step by step (what each step
scheduled, whom it preempted, the free blocks, who finished), with hybrid layouts and
speculative decoding. `support/vllm_schedules.py` runs the programs.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from vllm_objects import full_spec, window_spec
from vllm_schedules import Arrival, Program, finished_at, first_difference, run


def _same(program: Program) -> list:
    theirs = run("vllm", program)
    ours = run("pagedkv", program)
    assert first_difference(theirs, ours) is None, first_difference(theirs, ours)
    return theirs


@pytest.mark.parametrize("window", [16, 32, 48])
def test_a_long_prompt_is_admitted_with_the_window_groups_cap(window: int) -> None:
    """Issue 32, item 5: a 300-token prompt on an idle 27-block pool with a full and a
    sliding-window group. vLLM's full-sequence admission charges the window group at most
    what one request can hold at once, so the prompt fits; pagedkv charged all 19 blocks in
    both groups and never scheduled it, and a short request behind it starved."""
    program = Program(
        arrivals=[
            Arrival(0, "long", tuple(range(300)), 4),
            Arrival(0, "short", tuple(range(5000, 5020)), 4),
        ],
        steps=20,
        config=dict(
            num_blocks=27,
            max_num_seqs=8,
            max_num_batched_tokens=32,
            max_model_len=1024,
            specs=[full_spec(), window_spec(window)],
        ),
    )
    trace = _same(program)
    assert finished_at(trace, "long") == 12
    assert finished_at(trace, "short") is not None
