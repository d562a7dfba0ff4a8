"""`sim.why`: every prompt-token miss gets one cause, and the causes sum to the misses.

Small hand-made workloads (block size 4) each produce a cause whose count is worked out by
hand; the built-in mixed workload checks the sums per tenant against the replay's own count.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pagedkv import BlockManager, KVCacheGroup
from pagedkv.__main__ import main
from pagedkv.sim.requests import Request, Workload
from pagedkv.sim.scheduler import SimResult, run_workload
from pagedkv.sim.why import CAUSES, MissWhy
from pagedkv.sim.workloads import build_workload

BS = 4


def _req(rid: int, prompt: Iterable[int], at: int, **kw: Any) -> Request:
    tokens = np.fromiter(prompt, dtype=np.uint32)
    kw.setdefault("max_new_tokens", 1)
    return Request(rid, len(tokens), prompt_tokens=tokens, arrival_step=at, **kw)


def _replay(requests: list[Request], num_blocks: int = 64, **kw: Any) -> tuple[SimResult, MissWhy]:
    groups = kw.pop("groups", None)
    m = BlockManager(num_blocks, BS, enable_kv_events=True, groups=groups)
    why = MissWhy(ms_per_step=kw.pop("ms_per_step", None))
    res = run_workload(
        why.watch(m),
        Workload(tuple(requests), 0),
        watch=why,
        before_step=why.before_step,
        max_num_batched_tokens=kw.pop("budget", 256),
        **kw,
    )
    total = sum(t.misses for t in why.tenants.values())
    assert total == res.prompt_tokens - res.prefix_hit_tokens
    for t in why.tenants.values():
        assert sum(t.causes.values()) == t.misses
    return res, why


def _causes(why: MissWhy, tenant: str = "(none)") -> dict[str, int]:
    return {k: v for k, v in why.tenants[tenant].causes.items() if v}


def test_never_stored_and_partial_last_block() -> None:
    _, why = _replay([_req(0, range(10), 0)])
    # 10 tokens: two full blocks never stored, 2 tokens in the partial last block
    assert _causes(why) == {"never_stored": 8, "last_block": 2}


def test_the_last_full_block_is_always_computed() -> None:
    _, why = _replay([_req(0, range(8), 0), _req(1, range(8), 10)])
    # the second prompt hits block 0; block 1 is its last: one token is always computed
    assert why.tenants["(none)"].hit_tokens == 4
    assert _causes(why) == {"never_stored": 4, "last_block": 4 + 4}


def test_stored_under_another_salt() -> None:
    _, why = _replay([_req(0, range(9), 0, cache_salt="a"), _req(1, range(9), 10, cache_salt="b")])
    assert _causes(why, "a") == {"never_stored": 8, "last_block": 1}
    assert _causes(why, "b") == {"other_salt": 8, "last_block": 1}


def test_evicted_with_its_age() -> None:
    # 6 blocks: prompt 0 (2 full blocks) is evicted by the unique prompts that follow it
    fill = [_req(i, range(100 * i, 100 * i + 9), 10 * i) for i in range(1, 4)]
    _, why = _replay(
        [_req(0, range(9), 0), *fill, _req(9, range(9), 50)], num_blocks=6, ms_per_step=20.0
    )
    c = _causes(why)
    assert c["evicted"] == 8
    assert c["never_stored"] == 4 * 8
    t = why.tenants["(none)"]
    assert t.evicted_blocks == 2
    # evicted while prompts 2 or 3 were admitted (steps 20..31), missed at step 50
    assert 50 - 31 <= t.evicted_max_age_steps <= 50 - 20
    doc = t.as_dict(20.0, why.policy)
    assert doc["evicted"]["policy"] == "lru"
    assert doc["evicted"]["max_age_s"] == pytest.approx(t.evicted_max_age_steps * 0.02)


def test_lost_to_preemption() -> None:
    # 8 blocks, no swap space: two sequences growing to 28 tokens each cannot both run; the
    # newer is preempted, its blocks evicted as the older grows, then recomputed
    res, why = _replay(
        [_req(0, range(8), 0, max_new_tokens=20), _req(1, range(50, 58), 0, max_new_tokens=20)],
        num_blocks=8,
    )
    assert res.preempted_recompute == 1
    # the recompute (8 prompt + 8 generated tokens) hits its block 0, still cached; the 12
    # tokens after it were its own, lost with the preemption (its last block included)
    assert res.prompt_tokens == 8 + 8 + 16 and res.prefix_hit_tokens == 4
    assert _causes(why) == {"never_stored": 4 + 4, "last_block": 4 + 4, "preemption": 12}


def test_cut_by_a_hybrid_groups_window() -> None:
    groups = [KVCacheGroup("full"), KVCacheGroup("sliding_window", window=4)]
    shared = list(range(16))
    res, why = _replay(
        [
            _req(0, shared + list(range(100, 117)), 0),
            _req(1, list(range(200, 229)), 20),
            _req(2, shared + list(range(300, 305)), 40),
        ],
        num_blocks=24,
        groups=groups,
    )
    # the shared 16 tokens are still in the full group, but the window group's blocks of
    # them went first (released as the window passed them): the hit is cut to nothing
    assert res.prefix_hit_tokens == 0
    assert _causes(why) == {"never_stored": 32 + 28 + 4, "window": 16, "last_block": 3}


def test_sums_on_the_mixed_workload_per_tenant() -> None:
    wl = build_workload("mixed", 120, seed=3)
    m = BlockManager(512, 16, enable_kv_events=True)
    why = MissWhy()
    res = run_workload(
        why.watch(m), wl, watch=why, before_step=why.before_step, max_num_batched_tokens=2048
    )
    assert len(why.tenants) >= 2
    assert sum(t.prompt_tokens for t in why.tenants.values()) == res.prompt_tokens
    assert sum(t.hit_tokens for t in why.tenants.values()) == res.prefix_hit_tokens
    for t in why.tenants.values():
        assert sum(t.causes.values()) == t.misses
        assert t.causes["unexplained"] == 0
    assert set(CAUSES) >= set(why.tenants["(none)"].causes)


def test_the_command_prints_and_writes_the_causes(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    path = tmp_path / "why.json"
    argv = ["simulate", "--requests", "80", "--num-blocks", "512", "--no-progress"]
    assert main([*argv, "--why", "--json", str(path)]) == 0
    out = capsys.readouterr().out
    assert "why misses" in out and "evicted (none):" in out
    doc = json.loads(path.read_text())
    tenants = doc["misses"]["tenants"]
    assert sum(t["miss_tokens"] for t in tenants.values()) == (
        doc["prompt_tokens"] - doc["prefix_hit_tokens"]
    )
    for t in tenants.values():
        assert sum(t["causes"].values()) == t["miss_tokens"]
    assert tenants["(none)"]["causes"]["evicted"] > 0
    # the replay is the same with and without the attribution
    assert main([*argv, "--json", str(tmp_path / "plain.json")]) == 0
    plain = json.loads((tmp_path / "plain.json").read_text())
    assert plain["prefix_hit_tokens"] == doc["prefix_hit_tokens"] and "misses" not in plain


def test_why_is_refused_where_it_cannot_explain(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "--why", "--mrc", "--requests", "10"]) == 2
    assert "--why explains the misses of a replay" in capsys.readouterr().err


def test_a_hybrid_model_run_says_what_its_window_cut(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    path = tmp_path / "model.json"
    argv = ["simulate", "--model", "gpt-oss-20b", "--requests", "300", "--no-progress"]
    assert main([*argv, "--why", "--json", str(path)]) == 0
    assert "model run\nwhy misses" in capsys.readouterr().out
    hybrid, full = json.loads(path.read_text())["runs"]
    for run in (hybrid, full):
        tenants = run["misses"]["tenants"]
        assert sum(t["miss_tokens"] for t in tenants.values()) == (
            run["prompt_tokens"] - run["prefix_hit_tokens"]
        )
        for t in tenants.values():
            assert sum(t["causes"].values()) == t["miss_tokens"]
            assert t["causes"]["unexplained"] == 0
    window = sum(t["causes"]["window"] for t in hybrid["misses"]["tenants"].values())
    assert window > 0  # the sliding-window group cut hits the full group could serve
    assert all(t["causes"]["window"] == 0 for t in full["misses"]["tenants"].values())


def test_a_manager_it_cannot_read_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    why = MissWhy()
    with pytest.raises(ValueError, match="enable_kv_events=True"):
        why.watch(BlockManager(8, BS))
    assert main(["simulate", "--why", "--reference", "--requests", "5", "--no-progress"]) == 2
    assert "--why needs pagedkv's BlockManager" in capsys.readouterr().err
