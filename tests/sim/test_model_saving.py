"""`simulate --model`: a one-group model replays once; a hybrid one states its memory saving
(tokens at equal memory, memory at equal hits) with the figures it comes from, and every row
it prints is explained in `--help`."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from pagedkv.__main__ import main
from pagedkv.config import BlockManagerConfig
from pagedkv.sim.factory import make_manager
from pagedkv.sim.model_run import compare
from pagedkv.sim.models import get_model, model_layout
from pagedkv.sim.saving import BISECT_FRACTION, equal_hits, search_equal_hits
from pagedkv.sim.workloads import build_workload

SMALL = ["simulate", "--requests", "30", "--doc-tokens", "2048", "--no-progress"]
SCHEDULE = {"max_batch": 256, "max_num_batched_tokens": 2048}


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    assert main(list(argv)) == 0
    return capsys.readouterr().out


def _counting() -> tuple[list[BlockManagerConfig], Any]:
    made: list[BlockManagerConfig] = []

    def make(config: BlockManagerConfig, **kw: Any) -> Any:
        made.append(config)
        return make_manager(config, **kw)

    return made, make


@pytest.mark.parametrize(("name", "replays"), [("llama-3-8b", 1), ("gemma-3-12b", 2)])
def test_one_group_replays_once(name: str, replays: int) -> None:
    made, make = _counting()
    workload = build_workload("mixed", 20, seed=0, doc_tokens=2048)
    config = BlockManagerConfig(num_blocks=512, block_size=16)
    section, runs = compare(get_model(name), workload, config, SCHEDULE, make=make)
    assert len(made) == section["replays"] == replays
    assert section["one_run"] is (replays == 1)
    assert [r["label"] for r in runs] == ["model", "all_full"]
    if replays == 1:
        # the one run stands for both columns
        keys = ("workload_hit_rate", "num_steps", "evictions", "preemptions")
        assert all(runs[0][k] == runs[1][k] for k in keys)
        assert section["model"]["groups"] == section["all_full"]["groups"]


def test_one_group_says_it_replayed_once(capsys: pytest.CaptureFixture[str]) -> None:
    out = _run(capsys, *SMALL, "--model", "llama-3-8b")
    assert "memory saved  none: the model's layout is one full-attention group" in out
    assert "replayed once" in out


def test_hybrid_states_the_saving(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    js = tmp_path / "m.json"
    out = _run(capsys, *SMALL, "--num-blocks", "256", "--model", "gemma-3-12b", "--json", str(js))
    doc = json.loads(js.read_text())
    section = doc["model"]
    m, a, sv = section["model"], section["all_full"], section["saving"]
    model = get_model("gemma-3-12b")
    # All-full attention pays exactly the model's bytes per token for every held token.
    assert a["bytes_per_held_token"] == pytest.approx(model.full_kv_bytes_per_token)
    # The model's figure from its own per-group totals: held bytes over held token positions
    # are at most all groups' bytes (every group holding every token) and at least the
    # largest group's alone.
    layout = model_layout(model, 16)
    page_per_token = layout.page_bytes / layout.block_size
    assert m["bytes_per_held_token"] <= len(layout.groups) * layout.group_size * page_per_token
    assert m["bytes_per_held_token"] >= layout.group_size * page_per_token
    ratio = a["bytes_per_held_token"] / m["bytes_per_held_token"]
    assert sv["tokens_ratio_at_equal_memory"] == pytest.approx(ratio)
    line = next(x for x in out.splitlines() if x.startswith("memory saved"))
    assert f"at equal memory ({section['budget_gib']:.2f} GiB" in line
    assert f"hold {ratio:.2f}x the tokens of all-full attention" in line
    kib = f"{m['bytes_per_held_token'] / 1024:.1f} KiB of KV per held token against"
    assert kib in line
    assert "at equal hits: not searched (--equal-hits" in out
    # The hit limit: what the full group alone had, and the window groups' cut.
    split = sv["hit_split"]
    assert split["hit_rate"] == pytest.approx(m["workload_hit_rate"])
    limit = next(x for x in out.splitlines() if x.startswith("hit limit"))
    assert f"alone had {split['full_groups_hit_rate']:.2%}" in limit
    assert f"cut that to {split['hit_rate']:.2%}" in limit
    assert "sliding_window(1024)" in limit and split["most_cut_kind"] == "sliding_window(1024)"
    g = split["most_cut_group"]
    assert f"{100 * split['cut_rate'][g]:.2f} points" in limit
    assert split["full_groups_hit_rate"] - split["hit_rate"] >= max(split["cut_rate"]) - 1e-12


def test_equal_hits_search_finds_the_smallest_pool() -> None:
    layout = model_layout(get_model("gemma-3-12b"), 16)
    calls: list[int] = []

    def replay(lay: Any, n: int, label: str) -> tuple[dict[str, Any], dict[str, Any]]:
        calls.append(n)
        return {"workload_hit_rate": min(1.0, n / 3000)}, {}

    # From 1000 blocks (a third): doubling to 4000 reaches 0.9, bisection narrows to 1000/32.
    out = search_equal_hits(replay, layout, 1000, 1000 / 3000, 0.9)
    assert out["reached"] and 2700 <= out["num_blocks"] <= 2700 + 1000 // BISECT_FRACTION
    assert out["hit_rate"] >= 0.9 and 1000 not in calls  # the known rate is not rerun
    assert out["gib"] == pytest.approx(layout.gib(out["num_blocks"]))
    assert out["more_runs"] == len(calls)
    # Downwards: a budget that is more than enough.
    down = search_equal_hits(replay, layout, 8000, 1.0, 0.5)
    assert down["reached"] and 1500 <= down["num_blocks"] <= 1500 + 8000 // BISECT_FRACTION
    # The saving is what all-full attention needs less what the model's groups need.
    both = equal_hits(out, down, 0.9)
    assert both["saved_gib"] == pytest.approx(down["gib"] - out["gib"])
    # Never reached within 16x: said so, and no saving is stated.
    never = search_equal_hits(
        lambda lay, n, label: ({"workload_hit_rate": 0.1}, {}), layout, 100, 0.1, 0.9
    )
    assert not never["reached"] and never["num_blocks"] is None
    assert never["largest_tried_gib"] == pytest.approx(layout.gib(1600))
    assert equal_hits(never, down, 0.9)["saved_gib"] is None


def test_equal_hits_from_the_command_line(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    js = tmp_path / "m.json"
    argv = [
        *SMALL,
        "--num-blocks",
        "256",
        "--model",
        "gemma-3-12b",
        "--equal-hits",
        "--json",
        str(js),
    ]
    out = _run(capsys, *argv)
    section = json.loads(js.read_text())["model"]
    eq = section["saving"]["equal_hits"]
    assert section["replays"] == 2 + eq["more_runs"]
    target = section["saving"]["workload_hit_rate"]["all_full"]
    assert eq["target_hit_rate"] == target
    full = eq["all_full"]
    assert full["reached"]  # all-full attention reaches its own hit rate at the budget
    assert full["num_blocks"] <= section["all_full"]["num_blocks"]
    line = next(x for x in out.splitlines() if "at equal hits" in x)
    assert f"all-full attention {full['gib']:.2f} GiB ({full['hit_rate']:.2%})" in line
    model = eq["model"]
    if model["reached"]:
        assert model["hit_rate"] >= target
        assert f"the model's groups need {model['gib']:.2f} GiB" in line
        assert eq["saved_gib"] == pytest.approx(full["gib"] - model["gib"])
        assert f"{abs(eq['saved_gib']):.2f} GiB" in line
    else:
        assert "not reached" in line and "no saving to state" in line
    assert f"in {eq['more_runs']} more runs" in line


def test_equal_hits_needs_model(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*SMALL, "--equal-hits"]) == 2
    assert "--equal-hits needs --model" in capsys.readouterr().err


def test_every_model_row_is_in_help(capsys: pytest.CaptureFixture[str]) -> None:
    out = _run(capsys, *SMALL, "--num-blocks", "256", "--model", "gemma-3-12b")
    table = out.split("\n\n", 1)[1]
    rows = [re.split(r"  +", line)[0] for line in table.splitlines() if line and line[0] != " "]
    rows = [r for r in rows if r and not r.startswith(("model", "all-full", "run", "-"))]
    assert {
        "hit rate",
        "KV per live token",
        "KV per held token",
        "memory saved",
        "hit limit",
    } <= set(rows)
    with pytest.raises(SystemExit):
        main(["simulate", "--help"])
    sim_help = capsys.readouterr().out
    for row in rows:
        assert f"\n  {row} " in sim_help or f"\n  {row}\n" in sim_help, row
    assert "cut hits" in sim_help
