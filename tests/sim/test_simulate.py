"""The simulator end to end: built-in workloads, the scheduler, the Rust manager and the
reference answering every call alike."""

from __future__ import annotations

import io

import numpy as np
import pytest

from pagedkv import BlockManager
from pagedkv.sim import WORKLOADS, build_workload
from pagedkv.sim.progress import ProgressBar
from pagedkv.sim.scheduler import _Seq
from pagedkv.simulate import (
    bind_trace,
    generate_workload,
    generated_token,
    generated_tokens,
    run_workload,
    same_result,
)
from pagedkv_reference import ReferenceBlockManager


@pytest.mark.parametrize(
    ("num_blocks", "block_size", "num_cpu_blocks", "hash_algo"),
    [
        (1024, 16, 256, "sha256"),
        (400, 16, 0, "sha256"),
        (3000, 4, 64, "xxh3_128"),
        (160, 32, 32, "sha256"),
        (6000, 1, 0, "sha256"),
    ],
)
def test_rust_and_reference_agree_on_every_call(
    num_blocks: int, block_size: int, num_cpu_blocks: int, hash_algo: str
) -> None:
    workload = generate_workload(60, seed=num_blocks)
    kwargs = {"num_cpu_blocks": num_cpu_blocks, "hash_algo": hash_algo}
    rust = BlockManager(num_blocks, block_size, **kwargs)  # type: ignore[arg-type]
    result = run_workload(rust, workload, record=True)
    rust.check_invariants()
    assert result.trace is not None
    assert result.results is not None
    assert result.finished_sequences + result.rejected_sequences == sum(
        r.num_samples for r in workload.requests
    )
    assert len(rust) == 0

    ref = ReferenceBlockManager(num_blocks, block_size, **kwargs)  # type: ignore[arg-type]
    for i, ((fn, args, kw), want) in enumerate(
        zip(bind_trace(ref, result.trace), result.results, strict=True)
    ):
        got = fn(*args, **kw)
        assert same_result(got, want), (i, result.trace[i][0], got, want)
    assert ref.stats() == rust.stats()


def test_workload_is_deterministic() -> None:
    a, b = generate_workload(40, seed=7), generate_workload(40, seed=7)
    assert [r.prompt.tolist() for r in a.requests] == [r.prompt.tolist() for r in b.requests]
    assert [r.max_new_tokens for r in a.requests] == [r.max_new_tokens for r in b.requests]
    c = generate_workload(40, seed=8)
    assert [r.prompt.tolist() for r in a.requests] != [r.prompt.tolist() for r in c.requests]


def test_generated_tokens_match_scalar_form() -> None:
    for seq_id in (0, 5, 2**40 + 3, 2**64 - 1):
        assert generated_tokens(seq_id, 10, 50).tolist() == [
            generated_token(seq_id, p) for p in range(10, 50)
        ]


def test_small_pool_preempts_and_evicts() -> None:
    m = BlockManager(300, 16, num_cpu_blocks=32)
    result = run_workload(m, generate_workload(120, seed=1))
    st = m.stats()
    assert result.preempted_swap + result.preempted_recompute > 0
    assert st.evictions > 0
    assert st.prefix_hits > 0
    assert result.forks > 0
    m.check_invariants()


# --------------------------------------------------------------------------------------------
# the built-in workloads


@pytest.mark.parametrize("kind", WORKLOADS)
@pytest.mark.parametrize(("num_blocks", "num_cpu_blocks"), [(1200, 128), (900, 0)])
def test_builtin_workloads_agree_with_reference(
    kind: str, num_blocks: int, num_cpu_blocks: int
) -> None:
    """Each built-in workload on a small pool (preemption by swap or recompute), invariants
    checked after every step, answered call for call alike by the reference."""
    workload = build_workload(kind, 40, seed=3, arrival_rate=4.0, doc_tokens=2048)
    rust = BlockManager(num_blocks, 16, num_cpu_blocks=num_cpu_blocks)
    result = run_workload(rust, workload, record=True, check=True, max_batch_tokens=4096)
    assert len(rust) == 0
    assert result.finished_requests == len(workload.requests)
    assert result.series.step == sorted(result.series.step)
    assert len(result.series.usage) == result.steps
    assert result.prefix_hit_tokens == rust.stats().prefix_hits
    assert result.prompt_tokens == rust.stats().prefix_queries
    assert result.trace is not None and result.results is not None
    ref = ReferenceBlockManager(num_blocks, 16, num_cpu_blocks=num_cpu_blocks)
    for i, ((fn, args, kw), want) in enumerate(
        zip(bind_trace(ref, result.trace), result.results, strict=True)
    ):
        assert same_result(fn(*args, **kw), want), (i, result.trace[i][0])
    assert ref.stats() == rust.stats()


def test_mixed_workload_exercises_every_feature() -> None:
    workload = build_workload("mixed", 300, seed=0)
    assert {r.kind for r in workload.requests} == set(WORKLOADS) - {"mixed"}
    m = BlockManager(2048, 16, num_cpu_blocks=256)
    result = run_workload(m, workload)
    st = m.stats()
    assert result.forks > 0 and result.pruned_sequences > 0
    assert st.cow_copies > 0 and st.evictions > 0 and st.swapped_out_blocks > 0
    assert result.preempted_swap > 0
    assert 0.5 < result.hit_rate < 1.0
    assert max(result.series.usage) > 0.9
    assert result.clock_steps >= max(r.arrival_step for r in workload.requests)


def test_chat_turn_prompt_is_the_whole_conversation() -> None:
    """Turn t+1's prompt = turn t's prompt + exactly the tokens turn t generated + a message,
    so its whole history is a prefix hit."""
    workload = build_workload("chat", 30, seed=1)
    by_id = {r.request_id: r for r in workload.requests}
    later = [r for r in workload.requests if r.after is not None]
    assert later
    for r in later:
        assert r.after is not None
        prev = by_id[r.after]
        reply = generated_tokens(
            prev.request_id, prev.prompt_len, prev.prompt_len + prev.max_new_tokens
        )
        history = np.concatenate([prev.prompt, reply])
        assert np.array_equal(r.prompt[: len(history)], history)
        assert r.prompt_len > len(history)
    m = BlockManager(8192, 16)
    result = run_workload(m, workload)
    # With no eviction every later turn hits its full history blocks.
    expect = sum(
        (len(by_id[r.after].prompt) + by_id[r.after].max_new_tokens) // 16 * 16
        for r in later
        if r.after is not None
    )
    assert result.prefix_hit_tokens >= expect
    assert m.stats().evictions == 0


def test_arrivals_follow_a_poisson_process() -> None:
    w = build_workload("shared-prefix", 400, seed=2, arrival_rate=4.0)
    steps = [r.arrival_step for r in w.requests]
    assert steps == sorted(steps)
    assert 70 < steps[-1] < 130  # about 400 / 4 steps
    closed = build_workload("shared-prefix", 50, arrival_rate=0.0)
    assert {r.arrival_step for r in closed.requests} == {0}


def test_recompute_of_a_fork_gets_back_its_tokens() -> None:
    """A beam forked mid-decode and then recomputed allocates the parent's tokens up to the
    fork and its own after: the manager's chain digests match the ones it held."""
    w = build_workload("beam", 1, seed=0)
    req = w.requests[0]
    m = BlockManager(4096, 4)
    parent = _Seq(req.request_id, req, segments=((req.request_id, req.prompt_len),))
    m.allocate(parent.seq_id, parent.all_tokens())
    for _ in range(5):
        m.append(parent.seq_id, [generated_token(parent.seq_id, parent.num_tokens)])
        parent.generated += 1
    child = _Seq(99, req, parent.generated, True, (*parent.segments, (99, parent.num_tokens)))
    m.fork(parent.seq_id, 99)
    for _ in range(6):
        m.append(99, [generated_token(99, child.num_tokens)])
        child.generated += 1
    held = m.block_hashes(99)
    m.allocate(100, child.all_tokens())
    assert m.block_hashes(100) == held
    assert m.num_tokens(100) == m.num_tokens(99)


def test_bad_workload_arguments() -> None:
    with pytest.raises(ValueError, match="unknown workload"):
        build_workload("nope")
    with pytest.raises(ValueError, match="arrival_rate"):
        build_workload("chat", 5, arrival_rate=-1)
    with pytest.raises(ValueError, match="max_batch_tokens"):
        run_workload(BlockManager(16, 16), build_workload("chat", 1), max_batch_tokens=0)


def test_progress_bar_draws_and_ends_the_line() -> None:
    out = io.StringIO()
    bar = ProgressBar("run", stream=out, width=10, interval=0.0)
    bar(3, 10)
    bar(10, 10)
    bar.close()
    text = out.getvalue()
    assert "\rrun [###.......] 3/10 requests" in text
    assert "[##########] 10/10 requests 100%" in text
    assert text.endswith("\n")
