"""The simulator schedules like a current engine: chunked prefill under a per-step token
budget, hit-aware admission, speculative decoding (lookahead, truncate), aborts freed with
`num_computed_tokens`, and `--check`'s independent record of scheduled blocks, which a manager
that registers what was not scheduled fails."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pagedkv import BlockManager
from pagedkv.__main__ import main
from pagedkv.sim import Request, Workload, bind_trace, build_workload, read_trace, run_workload
from pagedkv.sim.calls import same_result
from pagedkv.sim.record import ScheduleRecord, UnscheduledHitError
from pagedkv.sim.scheduler import SimResult, _Scheduler
from pagedkv_reference import ReferenceBlockManager


def _prompt(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 32000, size=n, dtype=np.uint32)


def _workload(*requests: tuple[int, int, np.ndarray]) -> Workload:
    """Requests of (arrival step, new tokens, prompt)."""
    return Workload(
        tuple(
            Request(i, len(p), new, prompt_tokens=p, arrival_step=step)
            for i, (step, new, p) in enumerate(requests)
        ),
        seed=0,
    )


def _calls(result: Any, name: str) -> list[tuple[tuple[Any, ...], dict[str, Any], Any]]:
    assert result.trace is not None and result.results is not None
    return [
        (args, kw, out)
        for (n, args, kw), out in zip(result.trace, result.results, strict=True)
        if n == name
    ]


def _names(result: Any) -> list[str]:
    assert result.trace is not None
    return [n for n, _, _ in result.trace]


# --------------------------------------------------------------------------------------------
# chunked prefill


def test_long_prompt_is_prefilled_in_chunks_then_decodes() -> None:
    m = BlockManager(1024, 16)
    w = _workload((0, 3, _prompt(5000)))
    r = run_workload(m, w, max_num_batched_tokens=1024, record=True, check=True)
    (_, kw, hit), *_ = _calls(r, "allocate")
    assert kw["num_new_tokens"] == 1024 and hit == 0
    assert [args[1] for args, _, _ in _calls(r, "extend")] == [1024, 1024, 1024, 904]
    names = _names(r)
    last_extend = max(i for i, n in enumerate(names) if n == "extend")
    assert names.index("append_batch") > last_extend  # no decode before the prompt is in
    assert r.prefill_chunks == 5 and r.extend_calls == 4 and r.chunked_prompts == 1
    assert r.series.scheduled_tokens[:5] == [1024, 1024, 1024, 1024, 904]
    assert r.decode_tokens == 3 and r.finished_requests == 1
    assert len(m) == 0
    assert m.stats().registered_blocks == 5003 // 16


def test_decodes_take_the_budget_first() -> None:
    """A decoding request takes one token of each step's budget; the long prompt gets the rest."""
    m = BlockManager(1024, 16)
    w = _workload((0, 40, _prompt(100, 1)), (1, 1, _prompt(3000, 2)))
    r = run_workload(m, w, max_num_batched_tokens=512, record=True, check=True)
    allocs = _calls(r, "allocate")
    assert allocs[1][1]["num_new_tokens"] == 511
    assert [args[1] for args, _, _ in _calls(r, "extend")] == [511] * 4 + [3000 - 5 * 511]
    assert max(r.series.scheduled_tokens) == 512


def test_prefix_hit_is_not_charged_to_the_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    """The second copy of a prompt hits the first one's blocks: the budget pays only for the
    tokens computed, so a long cached prompt is admitted whole in one step."""
    p = _prompt(3000, 3)
    # Asked even where the count-only answer makes it sure (see the test below).
    monkeypatch.setattr(_Scheduler, "skip_sure_checks", False)
    m = BlockManager(2048, 16)
    r = run_workload(
        m, _workload((0, 2, p), (10, 2, p)), max_num_batched_tokens=1024, record=True, check=True
    )
    (_, _, hit0), (_, kw1, hit1) = _calls(r, "allocate")
    assert hit0 == 0 and hit1 == (3000 - 1) // 16 * 16
    assert kw1["num_new_tokens"] == 1024
    assert r.extend_calls == 2  # only the first copy needed more than one step
    # Hit-aware admission: can_allocate got the tokens, the chunk and the salt.
    checks = [c for c in _calls(r, "can_allocate") if "num_new_tokens" in c[1]]
    assert len(checks) == 2
    assert isinstance(checks[0][0][0], np.ndarray) and "cache_salt" in checks[0][1]


def test_a_sure_admission_skips_the_hit_aware_check(monkeypatch: pytest.MonkeyPatch) -> None:
    """When the whole prompt fits beside the watermark with no hit (the count-only answer is
    OK), the hit-aware `can_allocate` could only say OK: it is not asked, and the run is the
    same call for call otherwise. In a tight pool it is still asked."""

    def run(skip: bool, num_blocks: int) -> tuple[SimResult, list[Any]]:
        monkeypatch.setattr(_Scheduler, "skip_sure_checks", skip)
        work = build_workload("chat", 40, seed=2)
        r = run_workload(
            BlockManager(num_blocks, 16), work, max_num_batched_tokens=512, record=True
        )
        checks = [c for c in _calls(r, "can_allocate") if "num_new_tokens" in c[1]]
        return r, checks

    roomy, roomy_checks = run(True, 4096)
    asked, asked_checks = run(False, 4096)
    assert roomy_checks == [] and len(asked_checks) >= 40
    assert roomy.trace is not None and roomy.results is not None
    assert asked.trace is not None and asked.results is not None
    kept = [
        (c, x)
        for c, x in zip(asked.trace, asked.results, strict=True)
        if not (c[0] == "can_allocate" and "num_new_tokens" in c[2])
    ]
    assert len(kept) == len(roomy.trace)
    for (c, x), (c2, x2) in zip(kept, zip(roomy.trace, roomy.results, strict=True), strict=True):
        assert c[0] == c2[0] and same_result(x, x2)
    assert roomy.prefix_hit_tokens == asked.prefix_hit_tokens > 0
    tight, tight_checks = run(True, 160)
    assert tight.preemptions > 0 and tight_checks  # under pressure it is asked


def test_same_step_hits_with_a_per_prompt_cap() -> None:
    """With --long-prefill-token-threshold two copies of one prompt prefill side by side; the
    second hits the first one's blocks scheduled in the same step (never the rest)."""
    p = _prompt(4000, 4)
    m = BlockManager(4096, 16)
    r = run_workload(
        m,
        _workload((0, 2, p), (0, 2, p)),
        max_num_batched_tokens=2048,
        long_prefill_token_threshold=512,
        record=True,
        check=True,
    )
    (_, _, hit0), (_, _, hit1) = _calls(r, "allocate")
    assert (hit0, hit1) == (0, 512)
    assert r.series.scheduled_tokens[0] == 1024


def test_whole_prompt_scheduler_is_unchanged_by_default() -> None:
    m = BlockManager(2048, 16, num_cpu_blocks=128)
    r = run_workload(m, build_workload("mixed", 60, seed=1), record=True)
    assert "extend" not in _names(r) and "truncate" not in _names(r)
    assert all("num_new_tokens" not in kw for _, kw, _ in _calls(r, "allocate"))
    assert all(isinstance(args[0], int) for args, _, _ in _calls(r, "can_allocate"))
    assert r.max_num_batched_tokens is None


# --------------------------------------------------------------------------------------------
# speculative decoding and aborts


@pytest.mark.parametrize(("p", "expect"), [(0.0, 0.0), (1.0, 1.0), (0.6, (0.6 + 0.36) / 2)])
def test_speculation_acceptance(p: float, expect: float) -> None:
    m = BlockManager(4096, 16)
    w = build_workload("shared-prefix", 60, seed=5)
    r = run_workload(
        m, w, max_num_batched_tokens=2048, spec_tokens=2, spec_acceptance=p, record=True
    )
    assert r.draft_tokens > 0
    assert r.acceptance_rate == pytest.approx(expect, abs=0.05)
    assert r.decode_tokens == sum(q.max_new_tokens for q in w.requests)
    if p == 0.0:
        assert r.tokens_per_step == 1.0 and "append" not in _names(r)
    if p == 1.0:
        assert r.tokens_per_step > 2.5
    # Decodes reserve the draft slots with lookahead; truncate drops blocks rejected drafts used.
    assert {kw.get("lookahead") for _, kw, _ in _calls(r, "append_batch")} == {2}
    if p < 1.0:
        assert r.truncate_calls > 0 and m.stats().truncated_blocks == r.truncate_calls
    assert len(m) == 0
    m.check_invariants()


def test_speculation_shrinks_to_the_budget() -> None:
    m = BlockManager(2048, 16)
    w = _workload(*((0, 30, _prompt(40, 10 + i)) for i in range(8)))
    r = run_workload(m, w, max_num_batched_tokens=20, spec_tokens=4, record=True, check=True)
    # 8 decoders, 20 tokens: 1 + 1 draft each.
    assert {kw.get("lookahead") for _, kw, _ in _calls(r, "append_batch")} <= {None, 1, 2, 3, 4}
    assert max(r.series.scheduled_tokens) <= 20


def test_abort_frees_with_the_tokens_computed_before_the_step() -> None:
    """abort_rate 1: every request is aborted in the step it is admitted, before that step
    ran: free(num_computed_tokens = its hit); the blocks it registered are retracted."""
    p = _prompt(1000, 6)
    m = BlockManager(1024, 16)
    r = run_workload(
        m,
        _workload((0, 5, p), (3, 5, p)),
        max_num_batched_tokens=512,
        abort_rate=1.0,
        record=True,
        check=True,
    )
    frees = _calls(r, "free")
    assert [kw for _, kw, _ in frees] == [{"num_computed_tokens": 0}] * 2
    assert [hit for _, _, hit in _calls(r, "allocate")] == [0, 0]  # nothing left to hit
    assert r.aborted_requests == 2 and r.finished_requests == 2 and r.decode_tokens == 0
    st = m.stats()
    assert st.unregistered_blocks == 2 * (512 // 16) and st.cached_blocks == 0


def test_aborts_free_newest_first() -> None:
    """Two copies of a prompt admitted in one step, the second hitting what the first
    scheduled in that step, both aborted before it ran. Freed newest first, the hitter lets go
    first and the registrant's free retracts the blocks: a later copy hits nothing. (Freed the
    other way round, the manager keeps them cached, as the semantics say: the hitter still
    held them when the registrant was freed, and a hit's blocks are never retracted.)"""
    p = _prompt(2000, 9)
    m = BlockManager(1024, 16)
    r = run_workload(
        m,
        _workload((0, 2, p), (0, 2, p), (4, 2, p)),
        max_num_batched_tokens=2048,
        long_prefill_token_threshold=512,
        abort_rate=1.0,
        record=True,
        check=True,
    )
    assert [hit for _, _, hit in _calls(r, "allocate")] == [0, 512, 0]
    assert [(args[0], kw) for args, kw, _ in _calls(r, "free")][:2] == [
        (1, {"num_computed_tokens": 512}),  # its hit is computed
        (0, {"num_computed_tokens": 0}),
    ]


@pytest.mark.parametrize(("num_blocks", "num_cpu_blocks"), [(900, 128), (700, 0)])
def test_check_passes_with_everything_on_and_reference_agrees(
    num_blocks: int, num_cpu_blocks: int
) -> None:
    """The built-in workload on a small pool (preemption, eviction) with chunked prefill, a
    per-prompt cap, speculation and aborts, checked after every step; the reference answers
    every call alike."""
    w = build_workload("mixed", 120, seed=3, arrival_rate=4.0, doc_tokens=2048)
    rust = BlockManager(num_blocks, 16, num_cpu_blocks=num_cpu_blocks)
    r = run_workload(
        rust,
        w,
        max_num_batched_tokens=512,
        long_prefill_token_threshold=256,
        spec_tokens=3,
        spec_acceptance=0.6,
        abort_rate=0.01,
        record=True,
        check=True,
    )
    st = rust.stats()
    assert r.finished_requests == len(w.requests) and len(rust) == 0
    assert r.aborted_requests > 0 and st.unregistered_blocks > 0
    assert r.accepted_drafts > 0 and st.truncated_blocks > 0
    assert r.extend_calls > 0 and r.chunked_prompts > 0
    assert r.preemptions > 0 and st.evictions > 0 and r.forks > 0
    assert r.prefix_hit_tokens == st.prefix_hits and r.prompt_tokens == st.prefix_queries
    assert r.trace is not None and r.results is not None
    ref = ReferenceBlockManager(num_blocks, 16, num_cpu_blocks=num_cpu_blocks)
    for i, ((fn, args, kw), want) in enumerate(
        zip(bind_trace(ref, r.trace), r.results, strict=True)
    ):
        assert same_result(fn(*args, **kw), want), (i, r.trace[i][0])
    assert ref.stats() == st


def test_runs_are_deterministic() -> None:
    kw: dict[str, Any] = {"max_num_batched_tokens": 256, "spec_tokens": 2, "abort_rate": 0.02}
    w = build_workload("mixed", 50, seed=9)
    a = run_workload(BlockManager(1024, 16, num_cpu_blocks=64), w, **kw)
    b = run_workload(BlockManager(1024, 16, num_cpu_blocks=64), w, **kw)
    assert a.final_stats == b.final_stats and a.series.usage == b.series.usage


@pytest.mark.slow
def test_check_passes_on_the_shared_trace(mooncake_trace: Path) -> None:
    w = read_trace(mooncake_trace, limit=200)
    m = BlockManager(16384, 16, num_cpu_blocks=256)
    r = run_workload(
        m,
        w,
        max_num_batched_tokens=4096,
        long_prefill_token_threshold=1024,
        spec_tokens=3,
        abort_rate=0.003,
        check=True,
    )
    st = m.stats()
    assert r.finished_requests == 200 and len(m) == 0
    assert r.aborted_requests > 0 and st.unregistered_blocks > 0
    assert r.prefix_hit_tokens > 0 and st.evictions > 0 and st.truncated_blocks > 0


# --------------------------------------------------------------------------------------------
# the check can fail


class _WholePromptAllocate:
    """A wrong manager: `allocate` ignores `num_new_tokens` (schedules and registers the whole
    prompt) while the simulator believes only a chunk was scheduled; `extend` then has
    nothing left to do."""

    def __init__(self, m: BlockManager) -> None:
        self.m = m

    def __getattr__(self, name: str) -> Any:
        return getattr(self.m, name)

    def allocate(
        self, seq_id: int, token_ids: Any, *, num_new_tokens: Any = None, **kw: Any
    ) -> Any:
        return self.m.allocate(seq_id, token_ids, **kw)

    def extend(self, seq_id: int, num_new_tokens: int, *, lookahead: int = 0) -> Any:
        return []


class _FreeKeepsEverything:
    """A wrong manager: `free` ignores `num_computed_tokens` (an aborted request's blocks stay
    cached although their step never ran)."""

    def __init__(self, m: BlockManager) -> None:
        self.m = m

    def __getattr__(self, name: str) -> Any:
        return getattr(self.m, name)

    def free(self, seq_id: int, *, num_computed_tokens: Any = None) -> None:
        self.m.free(seq_id)


def test_check_fails_for_a_manager_that_registers_unscheduled_chunks() -> None:
    p = _prompt(3000, 7)
    w = _workload((0, 3, p), (1, 3, p))
    kw: dict[str, Any] = {"max_num_batched_tokens": 2048, "long_prefill_token_threshold": 512}
    ok = run_workload(BlockManager(1024, 16), w, check=True, **kw)
    assert ok.prefix_hit_tokens == 1024  # the two chunks scheduled before it came
    with pytest.raises(UnscheduledHitError, match=r"allocate\(seq 1\) served 2992 tokens"):
        run_workload(_WholePromptAllocate(BlockManager(1024, 16)), w, check=True, **kw)
    # Without --check nothing notices.
    run_workload(_WholePromptAllocate(BlockManager(1024, 16)), w, **kw)


def test_check_fails_for_a_manager_that_keeps_aborted_blocks() -> None:
    p = _prompt(1000, 8)
    w = _workload((0, 3, p), (2, 3, p))
    kw: dict[str, Any] = {"max_num_batched_tokens": 512, "abort_rate": 1.0, "check": True}
    run_workload(BlockManager(1024, 16), w, **kw)
    with pytest.raises(UnscheduledHitError, match="block 0"):
        run_workload(_FreeKeepsEverything(BlockManager(1024, 16)), w, **kw)


def test_record_alone() -> None:
    rec = ScheduleRecord(4)
    toks = np.arange(12, dtype=np.uint32)
    rec.begin_step()
    rec.allocate(1, toks, 0, 8)
    rec.allocate(2, toks, 8, 12)  # hits what 1 scheduled in this very step: allowed
    with pytest.raises(UnscheduledHitError, match="block 1"):
        rec.allocate(3, np.concatenate([toks[:4], toks[:8]]), 8, 12)
    rec.free(2)
    rec.free(1)  # both gone before the step ran: forgotten
    rec.step_ran()
    with pytest.raises(UnscheduledHitError, match="block 0"):
        rec.allocate(4, toks, 4, 8)
    rec.begin_step()
    rec.allocate(5, toks, 0, 12, cache_salt="a")
    rec.step_ran()
    rec.free(5)  # its step ran: stays
    rec.allocate(6, toks, 8, 12, cache_salt="a")
    with pytest.raises(UnscheduledHitError):
        rec.allocate(7, toks, 8, 12, cache_salt="b")  # another salt never hits it


# --------------------------------------------------------------------------------------------
# the command


def test_cli_reports_the_new_figures(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    js = tmp_path / "run.json"
    argv = [
        "simulate",
        "--requests",
        "60",
        "--num-blocks",
        "1024",
        "--doc-tokens",
        "2048",
        "--spec-tokens",
        "2",
        "--abort-rate",
        "0.01",
        "--check",
        "--json",
        str(js),
    ]
    assert main(argv) == 0
    out = capsys.readouterr().out
    for needle in (
        "chunked prefill, 2048 tokens per step",
        "recent (last 1000 allocations)",
        "registration",
        "speculation    2 drafts",
        "aborts",
        "no prefix hit on unscheduled tokens",
    ):
        assert needle in out, out
    f = json.loads(js.read_text())
    for key in (
        "max_num_batched_tokens",
        "prefill_chunks",
        "extend_calls",
        "recent_hit_rate",
        "registered_blocks",
        "unregistered_blocks",
        "truncated_blocks",
        "aborted_requests",
        "acceptance_rate",
        "tokens_per_step",
    ):
        assert key in f, key
    assert f["max_num_batched_tokens"] == 2048 and f["chunked_prefill"] is True
    assert f["aborted_requests"] > 0 and 0 < f["acceptance_rate"] < 1
    assert len(f["steps"]["scheduled_tokens"]) == f["num_steps"]


def test_cli_whole_prompt_scheduler_and_errors(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    js = tmp_path / "old.json"
    small = ["simulate", "--requests", "20", "--num-blocks", "1024", "--doc-tokens", "2048"]
    assert main([*small, "--max-batch-tokens", "4096", "--json", str(js)]) == 0
    assert "whole prompts" in capsys.readouterr().out
    f = json.loads(js.read_text())
    assert f["chunked_prefill"] is False and f["extend_calls"] == 0
    assert main([*small, "--max-batch-tokens", "8", "--max-num-batched-tokens", "8"]) == 2
    assert "not both" in capsys.readouterr().err
    assert main([*small, "--spec-acceptance", "1.5"]) == 2
    assert "spec_acceptance" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["simulate", "--help"])
    assert "2048" in capsys.readouterr().out
