"""`simulate --model NAME` end to end, every preset, with the real managers.

The hybrid presets run with `BlockManager(..., groups=)` (docs/semantics.md "KV-cache
groups"); llama-3-8b (one full group) runs on the plain manager.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from pagedkv.__main__ import main
from pagedkv.sim.models import MODELS, model_layout

SMALL = ["simulate", "--requests", "30", "--doc-tokens", "2048"]
LONG = ["simulate", "--workload", "long-doc", "--requests", "12"]


def _simulate(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, *argv: str
) -> tuple[str, dict[str, Any]]:
    js = tmp_path / "model.json"
    rc = main([*argv, "--no-progress", "--json", str(js)])
    out, err = capsys.readouterr()
    assert rc == 0, out + err
    return out, json.loads(js.read_text())


def _check_section(doc: dict[str, Any], name: str) -> None:
    """What holds for every run of every preset (docs/semantics.md, "KV-cache groups")."""
    section = doc["model"]
    layout = model_layout(MODELS[name], doc["runs"][1]["block_size"])
    m, a = section["model"], section["all_full"]
    fm, fa = doc["runs"]
    assert (fm["label"], fa["label"]) == ("model", "all_full")
    # Same bytes: the all-full run's pool, as many model blocks as fit.
    assert a["num_blocks"] * a["bytes_per_block"] == section["budget_bytes"]
    assert m["num_blocks"] == section["budget_bytes"] // layout.bytes_per_block
    assert fm["block_size"] == layout.block_size
    assert [g["spec"] for g in m["groups"]] == [
        (f"{g.kind}({g.window or g.chunk})" if g.window or g.chunk else g.kind)
        for g in layout.groups
    ]
    for s, f in ((m, fm), (a, fa)):
        assert f["rejected_requests"] == 0
        assert f["finished_requests"] == f["requests"]
        assert s["peak_blocks"] == sum(g["blocks_at_peak"] for g in s["groups"])
        assert 0 < s["peak_blocks"] < s["num_blocks"]
        assert s["bytes_per_token"] == pytest.approx(sum(g["bytes_per_token"] for g in s["groups"]))
        assert s["hit_rate"] == pytest.approx(f["prefix_hit_rate"])
        full = [g for g in s["groups"] if g["kind"] == "full"]
        assert full, "every preset has full-attention layers"
        # A full-attention group pins every hit block: the reconciled hit, in blocks.
        for g in full:
            assert g["hit_blocks"] * s["block_size"] == s["prefix_hit_tokens"]
        # Other kinds keep at most what full attention keeps: a window, a chunk, a state.
        for g in s["groups"]:
            assert g["max_blocks"] <= full[0]["max_blocks"]
            assert g["hit_blocks"] <= full[0]["hit_blocks"]


@pytest.mark.parametrize("name", list(MODELS))
def test_every_preset_mixed_workload(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, name: str
) -> None:
    out, doc = _simulate(capsys, tmp_path, *SMALL, "--num-blocks", "2048", "--model", name)
    _check_section(doc, name)
    assert f"model       {name}: " in out
    assert "blocks@peak" in out and "KV per live token" in out


def test_one_full_group_is_the_plain_manager(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    _, doc = _simulate(capsys, tmp_path, *SMALL, "--num-blocks", "1024", "--model", "llama-3-8b")
    m, a = doc["model"]["model"], doc["model"]["all_full"]
    for key in ("num_blocks", "peak_blocks", "bytes_per_token", "prefix_hit_tokens"):
        assert m[key] == a[key], key
    # 128 KiB per token held, less what forks and prefix hits share.
    assert 0 < a["bytes_per_token"] <= 131072 * 1.1


@pytest.mark.parametrize(
    ("name", "doc_tokens"),
    [("gpt-oss-20b", 8192), ("gemma-3-12b", 8192), ("llama-4-scout", 24576)],
)
def test_windows_hold_less_on_long_documents(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, name: str, doc_tokens: int
) -> None:
    # Documents of 4K-8K tokens (12K-24K for Scout's 8K chunks): a window (128, 1024) or
    # the current chunk keeps fewer blocks than the whole context, so the model's KV per
    # live token is below the all-full one.
    argv = [*LONG, "--doc-tokens", str(doc_tokens), "--num-blocks", str(doc_tokens // 2)]
    _, doc = _simulate(capsys, tmp_path, *argv, "--model", name)
    _check_section(doc, name)
    m, a = doc["model"]["model"], doc["model"]["all_full"]
    assert m["bytes_per_token"] < a["bytes_per_token"]
    sw = [g for g in m["groups"] if g["kind"] != "full"]
    full = [g for g in m["groups"] if g["kind"] == "full"]
    assert max(g["max_blocks"] for g in sw) < full[0]["max_blocks"]


def test_state_model_uses_large_blocks(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    argv = [*LONG, "--doc-tokens", "8192", "--num-blocks", "4096"]
    _, doc = _simulate(capsys, tmp_path, *argv, "--model", "qwen3-next-80b-a3b")
    _check_section(doc, "qwen3-next-80b-a3b")
    m = doc["model"]["model"]
    assert m["block_size"] == 544
    assert m["prefix_hit_tokens"] % 544 == 0
    # A state group holds the block of the latest state plus those a prefill chunk of at
    # most 2048 tokens writes, per running sequence; full attention holds whole documents.
    running = max(doc["runs"][0]["steps"]["running"])
    full = next(g for g in m["groups"] if g["kind"] == "full")
    for g in m["groups"]:
        if g["kind"] == "state":
            assert g["max_blocks"] <= running * (2 + -(-2048 // 544))
            assert g["max_blocks"] < full["max_blocks"]


def test_check_reference_speculation_and_aborts(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    # Every path of the scheduler (chunked prefill, forks, swap, drafts and truncate, aborts)
    # on a hybrid model, invariants checked after every step, in both managers.
    extra = ["--spec-tokens", "2", "--abort-rate", "0.01", "--check", "--model", "gpt-oss-20b"]
    results = []
    for ref in ([], ["--reference"]):
        out, doc = _simulate(
            capsys, tmp_path, "simulate", "--requests", "20", "--num-blocks", "512", *extra, *ref
        )
        assert "invariants  OK" in out
        results.append(doc["model"])
    for label in ("model", "all_full"):
        for key in ("prefix_hit_tokens", "peak_blocks", "bytes_per_token"):
            assert results[0][label][key] == results[1][label][key], (label, key)
