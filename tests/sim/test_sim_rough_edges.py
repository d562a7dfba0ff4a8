"""What a new user hit (issue 12): output options checked before the run, empty traces and
`--limit 0`, backwards timestamps, a cache smaller than a block, a summary whose figures agree
and whose every term `--help` explains, the program's name, `--version`, a closed pipe."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

import pagedkv
from pagedkv.__main__ import main
from pagedkv.sim import outputs

SMALL = ["simulate", "--requests", "40", "--doc-tokens", "2048", "--no-progress"]


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def _trace(path: Path, timestamps: list[int]) -> Path:
    rows = [
        {"timestamp": t, "input_length": 600, "output_length": 2, "hash_ids": [1, i + 2]}
        for i, t in enumerate(timestamps)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


# ------------------------------------------------------------------ outputs, before the run


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--json", "/nonexistent-folder/run.json"], "the folder /nonexistent-folder does not"),
        (["--plot", "/nonexistent-folder/run.png"], "the folder /nonexistent-folder does not"),
        (["--plot", "{tmp}/run.txt"], "must end in one of .png"),
        (["--json", "{tmp}"], "is a folder"),
    ],
)
def test_outputs_are_checked_before_the_run(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, argv: list[str], message: str
) -> None:
    # A long run: were the check made after it, this test would take minutes, not a moment.
    long = ["simulate", "--requests", "100000", "--no-progress"]
    t0 = time.perf_counter()
    rc, out, err = _run(capsys, *long, *(a.format(tmp=tmp_path) for a in argv))
    assert rc == 2 and message in err, err
    assert out == "" and time.perf_counter() - t0 < 5


def test_plot_without_matplotlib_fails_first(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = outputs.importlib.util.find_spec
    monkeypatch.setattr(
        outputs.importlib.util,
        "find_spec",
        lambda name, *a: None if name == "matplotlib" else real(name, *a),
    )
    rc, out, err = _run(capsys, *SMALL, "--plot", str(tmp_path / "p.png"))
    assert rc == 2 and "--plot needs matplotlib" in err and "'.[plot]'" in err
    assert out == ""


# ------------------------------------------------------------------ inputs


def test_empty_trace_and_limit_zero_are_errors(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n", encoding="utf-8")
    rc, _, err = _run(capsys, "simulate", "--trace", str(empty))
    assert rc == 2 and "the trace has no requests" in err
    trace = _trace(tmp_path / "t.jsonl", [0, 10])
    rc, _, err = _run(capsys, "simulate", "--trace", str(trace), "--limit", "0")
    assert rc == 2 and "--limit must be >= 1" in err
    rc, _, err = _run(capsys, "simulate", "--requests", "0")
    assert rc == 2 and "--requests must be >= 1" in err


def test_backwards_timestamps_warn_with_the_line(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    trace = _trace(tmp_path / "back.jsonl", [0, 50, 30, 60, 10])
    rc, out, err = _run(capsys, "simulate", "--trace", str(trace), "--no-progress")
    assert rc == 0, err
    assert f"warning: {trace}:3: timestamp 30 is earlier than the line before it (50)" in err
    assert "(2 lines in all)" in err and "timestamp order" in err
    assert "requests       5: 5 finished" in out
    _trace(trace, [0, 10, 20])
    _, _, err = _run(capsys, "simulate", "--trace", str(trace), "--no-progress")
    assert "warning" not in err


def test_cache_tokens_below_one_block_names_the_flag(capsys: pytest.CaptureFixture[str]) -> None:
    rc, _, err = _run(capsys, *SMALL, "--block-size", "16,64", "--cache-tokens", "32")
    assert rc == 2
    assert "--cache-tokens 32 is smaller than one block of 64 tokens (--block-size)" in err


# ------------------------------------------------------------------ the summary


def _row(out: str, name: str) -> str:
    match = re.search(rf"^{name} +(.*)$", out, re.MULTILINE)
    assert match, (name, out)
    return match.group(1)


def test_token_counts_agree(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    js = tmp_path / "f.json"
    rc, out, _ = _run(capsys, *SMALL, "--json", str(js))
    assert rc == 0
    asked = re.search(r"(\d+) prompt tokens, (\d+) to generate", out)
    assert asked
    prompt, generate = int(asked.group(1)), int(asked.group(2))
    tokens = _row(out, "tokens")
    assert tokens.startswith(f"{prompt} prompt + {generate} generated")  # every request finished
    f = json.loads(js.read_text())
    assert (f["workload_prompt_tokens"], f["generated_tokens"]) == (prompt, generate)


def test_recomputed_tokens_are_reported_apart(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    js = tmp_path / "f.json"
    argv = [*SMALL, "--num-blocks", "300", "--num-cpu-blocks", "0", "--json", str(js)]
    rc, out, _ = _run(capsys, *argv)
    assert rc == 0
    f = json.loads(js.read_text())
    assert f["preempted_recompute"] > 0 and f["recomputed_tokens"] > 0
    assert f["prompt_tokens"] == f["workload_prompt_tokens"] + f["recomputed_tokens"]
    asked = re.search(r"(\d+) prompt tokens, \d+ to generate", out)
    assert asked and int(asked.group(1)) == f["workload_prompt_tokens"]
    assert _row(out, "allocated").startswith(
        f"{f['prompt_tokens']} prompt tokens: {f['workload_prompt_tokens']} of the workload + "
        f"{f['recomputed_tokens']} recomputed after preemption"
    )
    assert _row(out, "prefix hits").startswith(
        f"{f['workload_hit_rate']:.2%} of the workload's prompt tokens"
    )
    assert _row(out, "recomputed").startswith(f"{f['recomputed_hit_rate']:.2%} of")


def test_every_printed_term_is_in_help(capsys: pytest.CaptureFixture[str]) -> None:
    argv = [*SMALL, "--spec-tokens", "2", "--abort-rate", "0.01", "--kv-bytes-per-token", "64"]
    rc, out, _ = _run(capsys, *argv)
    assert rc == 0
    rows = [line.split("  ")[0] for line in out.split("\n\n", 1)[1].splitlines() if line]
    assert len(rows) > 15 and "speculation" in rows and "aborts" in rows
    with pytest.raises(SystemExit):
        main(["simulate", "--help"])
    sim_help = capsys.readouterr().out
    for row in rows:
        assert f"\n  {row} " in sim_help, row
    for term in ("clock", "recomputed", "appended", "evictable", "miss-ratio curve", "SHARDS"):
        assert term in sim_help, term


def test_trace_runs_print_no_seed(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    trace = _trace(tmp_path / "t.jsonl", [0, 1000, 2000])
    _, out, _ = _run(capsys, "simulate", "--trace", str(trace), "--no-progress")
    assert "seed" not in out
    assert "(20 ms per step = 2.0 s)" in out and "s of trace time" in out
    _, out, _ = _run(capsys, *SMALL)
    assert "(seed 0)" in out


# ------------------------------------------------------------------ the program


def _cli(*args: str, script: bool = False) -> subprocess.CompletedProcess[str]:
    cmd = [str(Path(sys.executable).parent / "pagedkv")] if script else [sys.executable, "-m"]
    cmd += [] if script else ["pagedkv"]
    return subprocess.run([*cmd, *args], capture_output=True, text=True, timeout=120, check=False)


def test_program_name_and_version() -> None:
    script = _cli("--help", script=True)
    assert script.returncode == 0 and script.stdout.startswith("usage: pagedkv ")
    module = _cli("--help")
    assert module.stdout.startswith("usage: python -m pagedkv ")
    version = _cli("--version", script=True)
    assert version.stdout.strip() == f"pagedkv {pagedkv.__version__}"
    sim = _cli("simulate", "--help", script=True)
    assert sim.stdout.startswith("usage: pagedkv simulate ")
    # The trace format is in the help: one hash id per 512 prompt tokens.
    assert "one hash id per 512 prompt tokens" in " ".join(sim.stdout.split())


def test_a_closed_pipe_is_no_error() -> None:
    """`pagedkv simulate | head -1`: the reader goes away before the summary is written."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "pagedkv", "simulate", "--requests", "60", "--no-progress"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()
    err = proc.stderr.read()
    assert proc.wait(timeout=120) == 141
    assert err == "", err
