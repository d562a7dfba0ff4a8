"""Stock vLLM and pagedkv in the same CPU engine, offline (`LLM`), scenario by scenario:
identical token ids, equal prefix hits per request and equal engine counters; pagedkv's
scheduler turned on by `PAGEDKV_VLLM_SCHEDULER=1` alone, and shown to have run."""

from __future__ import annotations

from typing import Any

import pytest

from vllm_engine import offline as scen
from vllm_engine import probe

pytestmark = pytest.mark.engine

MAIN = (
    "control",
    "shared_prefixes",
    "preemption",
    "chunked_prefill",
    "parallel_sampling",
    "aborts",
    "duplicate_probe",
)
# (engine, scenario) pairs compared token for token and hit for hit.
COMPARED = [("main", s) for s in MAIN if s != "duplicate_probe"] + [
    ("ngram", "spec_decode"),
    ("window", "window_shared"),
    ("window", "window_preempt"),
]
USABLE_BLOCKS = scen.NUM_BLOCKS - 1


def record(offline: dict[str, Any], engine: str, kind: str, scenario: str) -> dict[str, Any]:
    run = offline[engine][kind]
    assert "engine_error" not in run, run.get("traceback", run["engine_error"])
    rec: dict[str, Any] = run[scenario]
    assert "error" not in rec, f"{engine}/{kind}/{scenario}: {rec.get('traceback')}"
    return rec


def test_the_model_depends_on_the_kv(offline):
    """Replacing only a prompt's first block changes its greedy output: a wrong KV block
    would show in the token ids these tests compare."""
    rec = record(offline, "main", "stock", "control")
    changed = sum(
        a["tokens"] != b["tokens"] for a, b in zip(rec["outputs"], rec["changed"], strict=True)
    )
    assert changed >= 7, f"only {changed} of 8 outputs changed with their first block"


@pytest.mark.parametrize("engine", scen.ENGINES)
def test_the_variable_alone_chooses_the_scheduler(offline, engine):
    stock, ours = offline[engine]["stock"], offline[engine]["pagedkv"]
    assert stock["env"] is None and ours["env"] == "1"
    assert stock["started"]["scheduler"] == "vllm.v1.core.sched.scheduler.Scheduler"
    assert stock["started"]["manager"] == "vllm.v1.core.kv_cache_manager.KVCacheManager"
    assert ours["started"]["scheduler"] == "pagedkv.vllm.scheduler.Scheduler"
    assert ours["started"]["manager"] == "pagedkv.vllm.manager.KVCacheManager"


def test_pagedkvs_duplicate_rule_shows_in_the_engine(offline):
    """An effect only pagedkv's manager has (a block computed twice is cached once): the
    probe's last request hits 64 tokens under vLLM's manager and 32 under pagedkv's."""
    for kind in ("stock", "pagedkv"):
        hits = record(offline, "main", kind, "duplicate_probe")["num_cached_tokens"]
        assert hits["B"] == 32, hits
        assert hits["D"] == probe.EXPECTED_D_HIT[kind], (kind, hits)


@pytest.mark.parametrize(("engine", "scenario"), COMPARED)
def test_same_tokens_same_hits(offline, engine, scenario):
    stock = record(offline, engine, "stock", scenario)
    ours = record(offline, engine, "pagedkv", scenario)
    assert ours["outputs"] and len(ours["outputs"]) == len(stock["outputs"])
    for i, (a, b) in enumerate(zip(stock["outputs"], ours["outputs"], strict=True)):
        assert a["tokens"] == b["tokens"], f"request {i}: token ids differ"
    if engine == "window":
        # Compared in test_window_hits_differ_exactly_as_explained.
        return
    assert [o["num_cached_tokens"] for o in ours["outputs"]] == [
        o["num_cached_tokens"] for o in stock["outputs"]
    ]
    assert ours["metrics"] == stock["metrics"]
    if scenario == "aborts":
        assert ours["finished"] == stock["finished"]


# Per request, stock's hits against pagedkv's with the window model: under the engine's
# sparse retention only request 11 of `window_shared`, by pagedkv's duplicate rule
# (tests/vllm/test_window_hits.py says why).
WINDOW_APART: dict[str, dict[int, tuple[int, int]]] = {
    "window_shared": {11: (96, 0)},
    "window_preempt": {},
}


@pytest.mark.parametrize("scenario", ["window_shared", "window_preempt"])
def test_window_hits_differ_exactly_as_explained(offline, scenario):
    """With the sliding-window model (docs/vllm-engine.md, "Sliding-window hits") both
    engines run vLLM's sparse prefix-cache retention (`prefix_cache_retention_interval` 0,
    the engine's default). The stock engine's hits are those of vLLM's manager under vLLM's
    scheduler with that setting, pagedkv's are those of vLLM's manager with the same setting
    and pagedkv's duplicate rule grafted on, each replayed on the same request stream
    without the engine (tests/support/vllm_window_streams.py); so they differ by the rule
    alone, request by request as `WINDOW_APART` lists."""
    stock = record(offline, "window", "stock", scenario)
    ours = record(offline, "window", "pagedkv", scenario)
    import vllm_env

    vllm_env.prepare()  # the scheduler replays build vLLM configs: an offline hub
    from vllm_window_streams import ENGINE_DEFAULT, hits

    stock_hits = [o["num_cached_tokens"] for o in stock["outputs"]]
    our_hits = [o["num_cached_tokens"] for o in ours["outputs"]]
    assert stock_hits == hits("vllm", scenario, ENGINE_DEFAULT).hits
    assert our_hits == hits("vllm", scenario, ENGINE_DEFAULT, dedup=True).hits
    apart = {i: (a, b) for i, (a, b) in enumerate(zip(stock_hits, our_hits, strict=True)) if a != b}
    assert apart == WINDOW_APART[scenario]
    same = [k for k in scen.METRICS if k != "vllm:prefix_cache_hits"]
    assert {k: ours["metrics"][k] for k in same} == {k: stock["metrics"][k] for k in same}
    assert ours["metrics"]["vllm:prefix_cache_hits"] == sum(our_hits)


@pytest.mark.parametrize(("engine", "scenario"), [*COMPARED, ("main", "duplicate_probe")])
def test_every_block_comes_back(offline, engine, scenario):
    """After each scenario no request holds a block: all 47 are free (cached or not) in both
    managers, pagedkv's invariants hold and it keeps no sequence."""
    for kind in ("stock", "pagedkv"):
        state = record(offline, engine, kind, scenario)["state"]
        assert state["free_blocks"] == USABLE_BLOCKS, (kind, state)
    state = record(offline, engine, "pagedkv", scenario)["state"]
    assert state["pagedkv_held_sequences"] == 0
    assert state["pagedkv_core_stats"]["num_sequences"] == 0


def test_the_scenarios_exercise_what_they_name(offline):
    """Preemptions happened, prompts were longer than the step budget, drafts were
    proposed, requests were cut mid-generation, shared prefixes hit."""
    main = offline["main"]["stock"]
    assert main["preemption"]["metrics"]["vllm:num_preemptions"] > 0
    assert min(main["chunked_prefill"]["prompt_lengths"]) > scen.MAX_BATCHED_TOKENS
    assert main["shared_prefixes"]["metrics"]["vllm:prefix_cache_hits"] > 0
    assert all(len(o["tokens"]) == 4 for o in main["parallel_sampling"]["outputs"])
    spec = offline["ngram"]["stock"]["spec_decode"]["metrics"]
    assert spec["vllm:spec_decode_num_draft_tokens"] > 0
    aborts = main["aborts"]
    assert aborts["aborted"]
    assert all(0 < n < 48 for n in aborts["aborted_tokens_at_abort"].values())
    assert all(len(t) == 48 for t in aborts["finished"].values())
    assert offline["window"]["stock"]["window_preempt"]["metrics"]["vllm:num_preemptions"] > 0
