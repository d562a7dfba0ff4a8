"""`sim.models` (the model table, vLLM's grouping, bytes per block) and the `--model` and
`--list-models` options, checked without a manager that takes `groups=` (a stand-in splits
the plain manager's totals over the groups, to check the plumbing of the per-group figures)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

from pagedkv.__main__ import main
from pagedkv.config import BlockManagerConfig
from pagedkv.groups import KVCacheGroup, check_groups
from pagedkv.sim import build_workload, factory, run_workload
from pagedkv.sim.factory import make_manager
from pagedkv.sim.model_report import comparison_table
from pagedkv.sim.model_run import GroupSampler, compare
from pagedkv.sim.models import (
    GIB,
    MODELS,
    ModelShape,
    attention_block_size,
    bytes_per_block,
    full_bytes_per_block,
    full_layout,
    get_model,
    group_size,
    model_layout,
)
from pagedkv.stats import GroupStats

FULL = KVCacheGroup("full")


# ---------------------------------------------------------------- arithmetic


def test_llama_3_8b_kv_bytes_per_token() -> None:
    m = get_model("llama-3-8b")
    assert m.kv_bytes_per_token_per_layer == 2 * 8 * 128 * 2 == 4096
    assert m.full_kv_bytes_per_token == 32 * 2 * 8 * 128 * 2 == 131072
    # One block of 16 tokens: 2 MiB; the model's layout is the all-full one.
    assert full_bytes_per_block(m, 16) == bytes_per_block(m, 16) == 16 * 131072 == 2 << 20
    assert model_layout(m) == full_layout(m)
    assert model_layout(m).manager_groups is None  # one full group: the plain manager


@pytest.mark.parametrize(
    ("name", "per_layer", "layers"),
    [
        # shared/notes/hybrid-groups.md section 5, "KV bytes per token per layer in bf16"
        ("llama-3-8b", 4096, 32),
        ("gemma-3-12b", 8192, 48),
        ("gemma-3-27b", 8192, 62),
        ("gpt-oss-20b", 2048, 24),
        ("gpt-oss-120b", 2048, 36),
        ("llama-4-scout", 4096, 48),
        ("qwen3-next-80b-a3b", 2048, 48),
    ],
)
def test_bytes_per_token_per_layer(name: str, per_layer: int, layers: int) -> None:
    m = MODELS[name]
    assert m.dtype_bytes == 2  # bf16
    assert m.num_layers == layers
    assert m.kv_bytes_per_token_per_layer == per_layer
    assert m.full_kv_bytes_per_token == layers * per_layer
    assert full_layout(m, 32).bytes_per_block == layers * per_layer * 32


def test_qwen3_next_state_and_raised_block() -> None:
    m = get_model("qwen3-next-80b-a3b")
    # conv (3, 8192) + SSM (32, 128, 128), bf16
    assert m.state_bytes == 3 * 8192 * 2 + 32 * 128 * 128 * 2 == 1_097_728
    # 16 * cdiv(state, 16 * 2048) = 16 * 34 tokens; that page holds one state.
    assert attention_block_size(m, 16) == 16 * -(-1_097_728 // (16 * 2048)) == 544
    layout = model_layout(m, 16)
    assert layout.block_size == 544
    assert layout.page_bytes == 544 * 2048 >= m.state_bytes
    assert all(g.block_size == 544 for g in layout.groups)
    # A larger block than needed is kept.
    assert attention_block_size(m, 1024) == model_layout(m, 1024).block_size == 1024
    # The all-full equivalent keeps the block size asked for.
    assert full_layout(m, 16).block_size == 16


def test_budget_in_blocks_and_gib() -> None:
    m = get_model("gemma-3-27b")
    full, hybrid = full_layout(m), model_layout(m)
    budget = 4096 * full.bytes_per_block
    assert full.num_blocks(budget) == 4096
    assert hybrid.bytes_per_block == 10 * 16 * 8192  # 10 layer pages of 16 tokens
    assert hybrid.num_blocks(budget) == budget // (10 * 16 * 8192) == 4096 * 62 // 10
    assert full.gib(4096) == pytest.approx(4096 * 62 * 16 * 8192 / GIB)


# ---------------------------------------------------------------- grouping


def _kinds(name: str) -> list[tuple[str, int]]:
    return [(g.kind, g.num_layers) for g in model_layout(MODELS[name]).groups]


def test_gemma_3_27b_groups_as_vllm() -> None:
    layout = model_layout(get_model("gemma-3-27b"))
    # 52 SW + 10 full: group size 10; SW splits into 6 strided groups (9, 9, 9, 9, 8, 8),
    # padded to 10 layers each (8 padding layers); SW first (layer 0 is SW), as vLLM's buckets.
    assert layout.group_size == 10
    assert _kinds("gemma-3-27b") == [("sliding_window", n) for n in (9, 9, 9, 9, 8, 8)] + [
        ("full", 10)
    ]
    assert layout.padding_layers == 8
    assert {g.window for g in layout.groups[:6]} == {1024}
    sw = [i for i in range(62) if (i + 1) % 6]
    assert layout.layer_ids[0] == tuple(sw[0::6])
    assert layout.layer_ids[5] == tuple(sw[5::6])
    assert layout.layer_ids[6] == tuple(range(5, 62, 6))
    assert sorted(i for ids in layout.layer_ids for i in ids) == list(range(62))
    check_groups(layout.groups, layout.block_size)  # what the manager will accept


@pytest.mark.parametrize(
    ("name", "expect", "padding"),
    [
        ("gemma-3-12b", [("sliding_window", 8)] * 5 + [("full", 8)], 0),
        ("gpt-oss-20b", [("sliding_window", 12), ("full", 12)], 0),
        ("gpt-oss-120b", [("sliding_window", 18), ("full", 18)], 0),
        ("llama-4-scout", [("chunked_local", 12)] * 3 + [("full", 12)], 0),
        ("qwen3-next-80b-a3b", [("state", 12)] * 3 + [("full", 12)], 0),
        ("llama-3-8b", [("full", 32)], 0),
    ],
)
def test_groups_of_each_preset(name: str, expect: list[tuple[str, int]], padding: int) -> None:
    layout = model_layout(MODELS[name])
    assert _kinds(name) == expect
    assert layout.padding_layers == padding
    assert layout.bytes_per_block == layout.group_size * layout.page_bytes
    check_groups(layout.groups, layout.block_size)


def test_pattern_details() -> None:
    # gpt-oss: even layers SW(128); Scout: every 4th layer full, chunk 8192.
    oss = get_model("gpt-oss-20b")
    assert [g.kind for g in oss.layers[:4]] == ["sliding_window", "full"] * 2
    assert oss.layers[0].window == 128
    scout = get_model("llama-4-scout")
    assert [i for i, g in enumerate(scout.layers) if g.kind == "full"] == list(range(3, 48, 4))
    assert scout.layers[0].chunk == 8192
    gemma = get_model("gemma-3-12b")
    assert [i for i, g in enumerate(gemma.layers) if g.kind == "full"] == list(range(5, 48, 6))


@pytest.mark.parametrize(
    ("counts", "size"),
    [([52, 10], 10), ([12, 13], 13), ([10, 14], 14), ([10, 15], 10), ([36, 12], 12), ([7], 7)],
)
def test_group_size_rule(counts: list[int], size: int) -> None:
    assert group_size(counts) == size


def test_strided_split_with_padding() -> None:
    # vLLM's own example: (full.0, full.1), (sw.0, sw.1, sw.2) -> (full.0, full.1),
    # (sw.0, sw.2), (sw.1, padding).
    sw = KVCacheGroup("sliding_window", window=64)
    m = ModelShape("toy", (FULL, sw, sw, FULL, sw), kv_heads=1, head_dim=8)
    layout = model_layout(m)
    assert layout.layer_ids == ((0, 3), (1, 4), (2,))
    assert [g.num_layers for g in layout.groups] == [2, 2, 1]
    assert layout.padding_layers == 1


@pytest.mark.parametrize(
    ("name", "block_size", "message"),
    [
        ("gpt-oss-20b", 256, "window 128 is smaller than a block"),
        ("llama-4-scout", 48, "chunk 8192 is not a multiple"),
        ("llama-3-8b", 0, "block_size must be >= 1"),
    ],
)
def test_layout_errors(name: str, block_size: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        model_layout(MODELS[name], block_size)


def test_unknown_model_lists_the_presets() -> None:
    with pytest.raises(ValueError, match="llama-3-8b") as exc:
        get_model("gpt-5")
    assert "qwen3-next-80b-a3b" in str(exc.value)
    with pytest.raises(ValueError, match="no attention layer"):
        model_layout(ModelShape("mamba", (KVCacheGroup("state"),) * 2, 1, 8, state_bytes=64))


# ---------------------------------------------------------------- the per-group plumbing


class _StandIn:
    """A manager "with groups" that is the plain one underneath: every group reports the
    totals (stands in for BlockManager(..., groups=) until it exists)."""

    def __init__(self, inner: Any, groups: tuple[KVCacheGroup, ...]) -> None:
        self._inner, self._groups = inner, groups

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def stats(self) -> Any:
        st = self._inner.stats()
        one = GroupStats(
            "x",
            st.used_blocks,
            st.cached_blocks,
            st.usage,
            st.prefix_hits // st.block_size,
            st.evictions,
            st.registered_blocks,
        )
        return dataclasses.replace(
            st, groups=tuple(dataclasses.replace(one, kind=g.kind) for g in self._groups)
        )


def _stand_in(config: BlockManagerConfig, *, reference: bool = False, groups: Any = None) -> Any:
    inner = make_manager(config, reference=reference)
    return inner if groups is None else _StandIn(inner, tuple(groups))


SCHEDULE: dict[str, Any] = {"max_num_batched_tokens": 2048}


def test_observe_sees_every_step_and_live_tokens() -> None:
    wl = build_workload("mixed", 20, seed=1, doc_tokens=2048)
    m = make_manager(BlockManagerConfig(num_blocks=512, num_cpu_blocks=64))
    sampler = GroupSampler(m)
    res = run_workload(m, wl, **SCHEDULE, observe=sampler)
    assert len(sampler.used) == len(res.series.live_tokens) == res.steps
    # Usage is sampled at the same moment: held blocks agree.
    assert [round(u * 512) for u in res.series.usage] == [row[0] for row in sampler.used]
    assert max(res.series.live_tokens) > 0


def test_compare_per_group_figures_with_a_stand_in() -> None:
    model = get_model("gemma-3-27b")
    wl = build_workload("mixed", 20, seed=1, doc_tokens=2048)
    config = BlockManagerConfig(num_blocks=1024, num_cpu_blocks=64)
    section, runs = compare(model, wl, config, SCHEDULE, make=_stand_in)
    m, a = section["model"], section["all_full"]
    assert [r["label"] for r in runs] == ["model", "all_full"]
    assert section["budget_bytes"] == 1024 * 16 * 507904
    assert a["num_blocks"] == 1024 and runs[1]["num_blocks"] == 1024
    assert m["num_blocks"] == runs[0]["num_blocks"] == 1024 * 62 // 10
    assert [g["spec"] for g in m["groups"]] == ["sliding_window(1024)"] * 6 + ["full"]
    assert [g["layers"] for g in m["groups"]] == [9, 9, 9, 9, 8, 8, 10]
    for s in (m, a):
        assert s["peak_blocks"] == sum(g["blocks_at_peak"] for g in s["groups"])
        assert s["peak_gib"] == pytest.approx(s["peak_blocks"] * s["bytes_per_block"] / GIB)
        assert s["bytes_per_token"] == pytest.approx(sum(g["bytes_per_token"] for g in s["groups"]))
        assert s["hit_rate"] == pytest.approx(s["prefix_hit_tokens"] / s["prompt_tokens"])
    # The stand-in reports the totals in every group: each of the 7 groups holds what the
    # single all-full group would, at 10/62 of the bytes per block and 1024*62//10 blocks.
    g0 = m["groups"][0]
    assert all(g["blocks_at_peak"] == g0["blocks_at_peak"] for g in m["groups"])
    assert a["groups"][0]["layers"] == 62
    assert a["bytes_per_token"] > 0
    table = comparison_table(section, runs)
    assert "sliding_window(1024)" in table and "all-full" in table and "KV per live token" in table
    assert len([line for line in table.splitlines() if line.startswith("model ")]) == 7


# ---------------------------------------------------------------- the CLI


SMALL = ["simulate", "--requests", "20", "--doc-tokens", "2048", "--no-progress"]


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def test_list_models_and_help(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = _run(capsys, "simulate", "--list-models")
    assert rc == 0
    for name in MODELS:
        assert f"{name}: " in out
    assert "7 groups of 10 layers (8 padding)" in out
    assert "131072 bytes per token" in out
    assert "block 544 tokens" in out
    with pytest.raises(SystemExit):
        main(["simulate", "--help"])
    help_text = capsys.readouterr().out
    for name in MODELS:
        assert name in help_text


def test_unknown_model_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["simulate", "--model", "gpt-5"])
    assert exc.value.code == 2
    assert "gpt-oss-20b" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--model", "gemma-3-27b", "--block-size", "16,32"], "--model compares one"),
        (["--model", "gemma-3-27b", "--num-blocks", "64,128"], "--model compares one"),
        (["--model", "gemma-3-27b", "--hash-algo", "sha256,xxh3_128"], "--model compares one"),
        (["--model", "gpt-oss-20b", "--block-size", "256"], "smaller than a block"),
        (["--model", "llama-4-scout", "--block-size", "48"], "not a multiple"),
        (["--model", "qwen3-next-80b-a3b", "--num-blocks", "8"], "raise --num-blocks"),
        (["--model", "llama-3-8b", "--num-blocks", "1"], "raise --num-blocks"),
        (["--model", "llama-3-8b", "--limit", "3"], "--limit applies to --trace"),
    ],
)
def test_model_errors_exit_2(
    capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    rc, _, err = _run(capsys, *SMALL, *argv)
    assert rc == 2
    assert message in err


def test_model_json_with_a_stand_in(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # `--model` imports the factory's `make_manager` when it runs
    monkeypatch.setattr(factory, "make_manager", _stand_in)
    js = tmp_path / "m.json"
    rc, out, _ = _run(capsys, *SMALL, "--model", "llama-4-scout", "--json", str(js))
    assert rc == 0, out
    assert "model       llama-4-scout: 48 layers (36 chunked_local(8192) + 12 full)" in out
    assert "budget      " in out and "KV per live token" in out and "blocks@peak" in out
    doc = json.loads(js.read_text())
    section = doc["model"]
    assert section["name"] == "llama-4-scout"
    assert section["layer_kinds"] == {"chunked_local(8192)": 36, "full": 12}
    assert [g["spec"] for g in section["model"]["groups"]] == ["chunked_local(8192)"] * 3 + ["full"]
    assert [r["label"] for r in doc["runs"]] == ["model", "all_full"]
    assert len(doc["runs"][0]["steps"]["live_tokens"]) == doc["runs"][0]["num_steps"]


def test_the_factory_builds_grouped_managers_of_both_kinds() -> None:
    config = BlockManagerConfig(num_blocks=64)
    groups = model_layout(get_model("gpt-oss-20b")).groups
    for reference in (False, True):
        m = make_manager(config, groups=groups, reference=reference)
        assert [g.kind for g in m.stats().groups] == ["sliding_window", "full"]
        assert m.allocate(0, list(range(40))) == 0
