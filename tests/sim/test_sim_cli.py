"""`python -m pagedkv simulate`: the summary table, --json, --plot, sweeps, --trace/--limit,
--reference, --check, the progress bar and the errors."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import pytest

from pagedkv.__main__ import _build_parser, main
from pagedkv.sim.cli import simulate

SMALL = ["simulate", "--requests", "40", "--num-blocks", "1024", "--doc-tokens", "2048"]
REQUIRED_KEYS = (
    "requests",
    "prompt_tokens",
    "prefix_hit_tokens",
    "prefix_hit_rate",
    "peak_usage",
    "evictions",
    "preemptions",
    "manager_seconds",
    "wall_seconds",
    "steps",
)


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def test_summary_json_plot_and_check(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    js, png = tmp_path / "run.json", tmp_path / "run.png"
    rc, out, _ = _run(capsys, *SMALL, "--check", "--json", str(js), "--plot", str(png))
    assert rc == 0, out
    for needle in (
        "GPU blocks",
        "prefix hits",
        "held ",
        "cached ",
        "evictions",
        "preemptions",
        "swaps",
        "copy-on-write",
        "fragmentation",
        "p99",
        "ns/token",
        "wall time",
        "invariants  OK",
    ):
        assert needle in out, out
    f = json.loads(js.read_text())
    for key in REQUIRED_KEYS:
        assert key in f, key
    assert f["requests"] == 40
    assert f["prefix_hit_rate"] == pytest.approx(f["prefix_hit_tokens"] / f["prompt_tokens"])
    assert 0 < f["peak_usage"] <= 1
    series = f["steps"]
    for name in ("step", "usage", "cached_blocks", "running", "hit_rate", "manager_ns"):
        assert len(series[name]) == f["num_steps"], name
    assert sum(series["manager_ns"]) == pytest.approx(f["manager_seconds"] * 1e9, rel=1e-6)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_sweep_prints_one_table(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    js = tmp_path / "sweep.json"
    rc, out, _ = _run(
        capsys,
        *SMALL[:3],
        "--block-size",
        "16,32",
        "--num-blocks",
        "512,1024",
        "--hash-algo",
        "sha256,xxh3_128",
        "--json",
        str(js),
    )
    assert rc == 0, out
    table = out[out.index("block  ") : out.index("json ")].splitlines()
    assert len(table) == 2 + 8  # header, rule, one row per combination
    runs = json.loads(js.read_text())["runs"]
    assert {(r["block_size"], r["num_blocks"], r["hash_algo"]) for r in runs} == {
        (b, n, h) for b in (16, 32) for n in (512, 1024) for h in ("sha256", "xxh3_128")
    }
    # The hash function changes nothing but the time.
    by = {(r["block_size"], r["num_blocks"], r["hash_algo"]): r for r in runs}
    assert (
        by[16, 512, "sha256"]["prefix_hit_tokens"] == by[16, 512, "xxh3_128"]["prefix_hit_tokens"]
    )


def test_cache_tokens_sizes_each_block_size(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    js = tmp_path / "c.json"
    rc, _, _ = _run(
        capsys, *SMALL[:3], "--block-size", "8,64", "--cache-tokens", "32768", "--json", str(js)
    )
    assert rc == 0
    runs = json.loads(js.read_text())["runs"]
    assert [(r["block_size"], r["num_blocks"]) for r in runs] == [(8, 4096), (64, 512)]


def test_trace_limit_and_reference(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text(
        "".join(
            json.dumps(
                {"timestamp": 10 * i, "input_length": 1000, "output_length": 3, "hash_ids": ids}
            )
            + "\n"
            for i, ids in enumerate([[1, 2], [1, 3], [1, 2], [4, 5], [1, 2]])
        )
    )
    results = {}
    for extra in ([], ["--reference"]):
        js = tmp_path / f"r{len(extra)}.json"
        argv = ["simulate", "--trace", str(trace), "--limit", "4", "--json", str(js), *extra]
        rc, out, _ = _run(capsys, *argv)
        assert rc == 0, out
        assert ("ReferenceBlockManager" in out) == bool(extra)
        results[len(extra)] = f = json.loads(js.read_text())
        assert f["requests"] == 4
        assert f["manager"] == ("reference" if extra else "rust")
    for key in ("prefix_hit_tokens", "prompt_tokens", "evictions", "num_steps"):
        assert results[0][key] == results[1][key], key
    # Request 1 repeats id 1 (32 blocks of 16); request 2 repeats request 0 entirely: all its
    # 62 full blocks (the cap, (1000 - 1) // 16 = 62, leaves the partial one computed).
    # --limit 4 leaves out the fifth line.
    assert results[0]["prefix_hit_tokens"] == (32 + 62) * 16


def test_progress_bar_on_a_terminal(capsys: pytest.CaptureFixture[str]) -> None:
    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    err, out = Tty(), io.StringIO()
    args = _build_parser().parse_args(SMALL)
    assert simulate(args, out, err) == 0
    assert "40/40 requests 100%" in err.getvalue()
    quiet = Tty()
    simulate(_build_parser().parse_args([*SMALL, "--no-progress"]), io.StringIO(), quiet)
    assert quiet.getvalue() == ""


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--trace", "/nonexistent/trace.jsonl"], "No such file"),
        (["--trace", "x.jsonl", "--workload", "chat"], "either --trace or --workload"),
        (["--limit", "3"], "--limit applies to --trace"),
        (["--num-blocks", "0"], "num_blocks"),
        (["--num-blocks", "8", "--cache-tokens", "64"], "either --num-blocks"),
    ],
)
def test_errors_exit_2(capsys: pytest.CaptureFixture[str], argv: list[str], message: str) -> None:
    rc, _, err = _run(capsys, "simulate", *argv)
    assert rc == 2
    assert message in err


def test_bad_list_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["simulate", "--block-size", "16,x"])
    assert exc.value.code == 2
    assert "16,x" in capsys.readouterr().err


def test_cli_does_not_import_matplotlib_unless_plotting() -> None:
    code = (
        "import sys\n"
        "from pagedkv.__main__ import main\n"
        "main(['simulate', '--requests', '5', '--no-progress'])\n"
        "assert 'matplotlib' not in sys.modules\n"
        "import pagedkv, pagedkv.simulate, pagedkv.sim\n"
        "assert 'matplotlib' not in sys.modules\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
