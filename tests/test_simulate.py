"""The simulate workload end to end: the Rust manager and the reference answer every call alike."""

from __future__ import annotations

import pytest

from pagedkv import BlockManager
from pagedkv.reference import ReferenceBlockManager
from pagedkv.simulate import (
    bind_trace,
    generate_workload,
    generated_token,
    generated_tokens,
    run_workload,
    same_result,
)


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
