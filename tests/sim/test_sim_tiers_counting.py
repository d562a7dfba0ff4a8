"""`simulate --host-tier-bytes` without torch and without bytes (`--tier-data count`, the
default without `--compress`, `--remote` or `--check`), the same figures as with real bytes,
and the tier table's headline: the workload's own hit rate first, the prompt tokens not
computed, and what the tiers served of the workload's prompts (docs/tiers.md, "In the
simulator").
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import pagedkv
from pagedkv.__main__ import main
from pagedkv.sim.tier_cli import comparison_table

# Hit figures a count-only run must share with a real-bytes one.
SAME = (
    "prefix_hit_tokens",
    "gpu_hit_tokens",
    "tier_hit_tokens",
    "workload_tier_hit_tokens",
    "blocks_demoted",
    "blocks_promoted",
    "evictions",
    "preemptions",
    "recomputed_tokens",
    "recomputed_hit_tokens",
    "workload_hit_rate",
)


def _trace(path: Path, n: int = 80, seed: int = 3) -> Path:
    """A Mooncake-format trace of conversations over 6 shared system prompts: each turn
    repeats its conversation's history, so prefixes come back after the GPU evicted them."""
    rng = random.Random(seed)
    next_id = 100
    convs: list[list[int]] = [[i] for i in range(6)]
    lines = []
    for i in range(n):
        c = rng.randrange(len(convs))
        new = rng.randrange(1, 4)
        convs[c] += list(range(next_id, next_id + new))
        next_id += new
        ids = convs[c][: rng.randrange(max(1, len(convs[c]) - 3), len(convs[c]) + 1)]
        lines.append(
            {
                "timestamp": 40 * i,
                "input_length": 512 * len(ids) - rng.randrange(0, 200),
                "output_length": rng.randrange(4, 40),
                "hash_ids": ids,
            }
        )
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


def _args(trace: Path, js: Path, *extra: str) -> list[str]:
    return [
        "simulate",
        "--no-progress",
        "--trace",
        str(trace),
        "--num-blocks",
        "512",
        "--host-tier-bytes",
        "2GiB",
        "--json",
        str(js),
        *extra,
    ]


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[str, dict[str, Any]]:
    rc = main(argv)
    out, err = capsys.readouterr()
    assert rc == 0, err
    doc: dict[str, Any] = json.loads(Path(argv[argv.index("--json") + 1]).read_text())
    return out, doc


def test_count_only_has_the_hit_figures_of_real_bytes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = _trace(tmp_path / "t.jsonl")
    out_c, count = _run(_args(trace, tmp_path / "c.json"), capsys)
    out_r, real = _run(_args(trace, tmp_path / "r.json", "--tier-data", "real"), capsys)
    assert count["tier_data"] == "count" and real["tier_data"] == "real"
    assert "count-only" in out_c and "real bytes" in out_r
    c, r = count["runs"][1], real["runs"][1]
    assert c["blocks_demoted"] > 0 and c["blocks_promoted"] > 0, "the trace must use the tier"
    for key in SAME:
        assert c[key] == r[key], key
    assert c["data_bytes_demoted"] == 0 < r["data_bytes_demoted"]
    # Throughput is reported with bytes only.
    assert count["demote_gbps"] is None and real["demote_gbps"] > 0
    assert real["promote_gbps"] > 0 and real["load_us_per_block"] > 0
    assert "promoted GB/s" in out_r and "promoted GB/s" not in out_c


def test_compression_reports_codec_throughput(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("lz4")
    trace = _trace(tmp_path / "t.jsonl")
    out, doc = _run(_args(trace, tmp_path / "z.json", "--compress", "shuffle+lz4"), capsys)
    assert doc["tier_data"] == "real"  # compression needs bytes: the default follows
    assert doc["compress_gbps"] > 0 and doc["decompress_gbps"] > 0
    assert doc["compression_ratio"] > 1.0
    assert "compressed GB/s (codec)" in out


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--tier-data", "count", "--compress", "lz4"], "--compress needs the blocks' bytes"),
        (["--tier-data", "count", "--check"], "--check reads the KV back"),
        (["--tier-data", "fast"], "invalid choice"),
    ],
)
def test_count_only_refuses_what_needs_bytes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: list[str], message: str
) -> None:
    trace = _trace(tmp_path / "t.jsonl", n=5)
    try:
        rc = main(_args(trace, tmp_path / "e.json", *extra))
    except SystemExit as e:  # argparse's own usage error
        rc = int(e.code or 0)
    assert rc == 2
    assert message in capsys.readouterr().err


def test_tier_data_needs_a_tier(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "--no-progress", "--requests", "5", "--tier-data", "count"]) == 2
    assert "--tier-data needs --host-tier-bytes" in capsys.readouterr().err


# torch made unimportable: `import torch` anywhere raises ImportError.
_NO_TORCH = """
import sys
sys.modules["torch"] = None
from pagedkv.__main__ import main
rc = main(sys.argv[1:])
assert "torch" not in [m for m, v in sys.modules.items() if v is not None], "torch imported"
sys.exit(rc)
"""


@pytest.mark.parametrize(
    "extra",
    [[], ["--compress", "shuffle+lz4", "--check"]],
    ids=["count-only", "real-bytes-compressed-checked"],
)
def test_tier_runs_without_torch(tmp_path: Path, extra: list[str]) -> None:
    if extra:
        pytest.importorskip("lz4")
    trace = _trace(tmp_path / "t.jsonl")
    js = tmp_path / "n.json"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(Path(pagedkv.__file__).parents[1]), env.get("PYTHONPATH", "")]
    )
    proc = subprocess.run(
        [sys.executable, "-c", _NO_TORCH, *_args(trace, js, *extra)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(js.read_text())
    assert doc["runs"][1]["blocks_promoted"] > 0
    if extra:
        assert doc["runs"][1]["checked_tokens"] > 0


def _figures(**kw: Any) -> dict[str, Any]:
    f: dict[str, Any] = {
        "workload_prompt_tokens": 1000,
        "prompt_tokens": 1000,
        "prefix_hit_tokens": 100,
        "recomputed_tokens": 0,
        "recomputed_hit_tokens": 0,
        "computed_prompt_tokens": 900,
        "workload_hit_rate": 0.1,
        "prefix_hit_rate": 0.1,
        "evictions": 10,
        "preemptions": 0,
        "manager_seconds": 0.1,
        "wall_seconds": 1.0,
    }
    f.update(kw)
    return f


def test_the_table_leads_with_the_workloads_own_hit_rate() -> None:
    """The issue's case: with tiers the hit rate over every allocation fell (fewer
    preemptions, so fewer recomputed prompts hitting their own blocks) while the tokens
    computed fell: the headline is the workload's rate, and it rose."""
    base = _figures(
        prompt_tokens=1600,
        prefix_hit_tokens=700,
        recomputed_tokens=600,
        recomputed_hit_tokens=600,
        computed_prompt_tokens=900,
        prefix_hit_rate=700 / 1600,
        preemptions=6,
    )
    tier = {
        "tier_hit_tokens": {"CPU": 150},
        "workload_tier_hit_tokens": 150,
        "tiers": [
            {
                "medium": "CPU",
                "name": "host",
                "hit_tokens": 150,
                "puts": 5,
                "dropped_puts": 0,
                "evictions": 0,
                "gets": 2,
                "hits": 2,
                "corrupt": 0,
            }
        ],
        "blocks_demoted": 5,
        "blocks_promoted": 2,
        "bytes_demoted": 0,
        "bytes_promoted": 0,
        "compression_ratio": 1.0,
        "failed_loads": 0,
        "dropped_demotions": 0,
        "tier_data": "count",
    }
    tiered = _figures(
        prompt_tokens=1100,
        prefix_hit_tokens=350,
        recomputed_tokens=100,
        recomputed_hit_tokens=100,
        computed_prompt_tokens=750,
        workload_hit_rate=0.25,
        prefix_hit_rate=350 / 1100,
        preemptions=1,
        wall_seconds=1.5,
        **tier,
    )
    lines = comparison_table(base, tiered).splitlines()
    rows = {line[:30].strip(): line[30:].split() for line in lines[1:]}
    assert lines[1].startswith("workload prompt tokens")
    assert lines[2].startswith("workload hit rate")
    assert rows["workload hit rate"] == ["10.00%", "25.00%", "+150.00%"]
    assert rows["from the GPU"] == ["10.00%", "10.00%"]
    assert rows["from the tiers"] == ["-", "15.00%"]
    assert rows["workload tokens not computed"] == ["100", "250", "+150.00%"]
    assert rows["prompt tokens computed"] == ["900", "750", "-16.67%"]
    assert rows["hit rate, recomputed incl."] == ["43.75%", "31.82%"]
    assert rows["wall added per demoted block"] == ["-", "100000.0", "us"]
    # Recomputed prompts have their own rows, after the workload's.
    assert rows["recomputed after preemption"] == ["600", "100", "-83.33%"]
