"""`--nodes` and `--eviction` show their progress as the sizing runs do: on a stream that is
not a terminal (a log), a line when each run starts and ends and one a minute between, the
requests ended so far in it (a clock stepped by the replay stands in for the minutes)."""

from __future__ import annotations

import io
import re
import time
from typing import Any

import pytest

from pagedkv.__main__ import main


class _Err(io.StringIO):
    def isatty(self) -> bool:
        return False


def _simulate(argv: list[str], monkeypatch: pytest.MonkeyPatch) -> tuple[int, str]:
    """Run the command with stderr captured and a clock that moves 10 s per reading."""
    now = [0.0]

    def tick() -> float:
        now[0] += 10.0
        return now[0]

    monkeypatch.setattr(time, "perf_counter", tick)  # the progress lines' clock (and all)
    err = _Err()
    monkeypatch.setattr("sys.stderr", err)
    rc = main(argv)
    return rc, err.getvalue()


SMALL = ["simulate", "--requests", "40", "--doc-tokens", "1024"]


def test_a_cluster_run_prints_progress_lines(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    rc, err = _simulate([*SMALL, "--nodes", "2", "--cluster-tier", "off"], monkeypatch)
    assert rc == 0, err
    lines = err.splitlines()
    assert lines[0] == "[cluster] 2 nodes: started"
    during = [x for x in lines if re.fullmatch(r"\[cluster\] 2 nodes: \d+/40 requests, .*", x)]
    assert during, err  # the clock passes a minute every few steps
    assert re.fullmatch(r"\[cluster\] 2 nodes: done, 40 requests routed \(.*\)", lines[-1])
    assert "node 0" in capsys.readouterr().out


def test_eviction_runs_print_progress_per_policy(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    rc, err = _simulate(
        [*SMALL, "--eviction", "lru,s3fifo", "--eviction-repeats", "1"], monkeypatch
    )
    assert rc == 0, err
    lines = err.splitlines()
    for policy in ("lru", "s3fifo"):
        assert f"[eviction] {policy}: started" in lines
        assert any(re.fullmatch(rf"\[eviction\] {policy}: \d+/40 requests, .*", x) for x in lines)
        assert any(re.fullmatch(rf"\[eviction\] {policy}: done \(.*\)", x) for x in lines)
    assert lines.index("[eviction] s3fifo: started") > lines.index("[eviction] lru: started")
    capsys.readouterr()


def test_no_progress_prints_none(monkeypatch: pytest.MonkeyPatch, capsys: Any) -> None:
    argv = [*SMALL, "--no-progress", "--nodes", "2", "--cluster-tier", "off"]
    rc, err = _simulate(argv, monkeypatch)
    assert rc == 0 and err == ""
    capsys.readouterr()
