"""`simulate --mrc` in parallel processes (`sim.sizing_jobs`): the same answer for any
`--jobs`, progress lines on a stream that is not a terminal, `--json` valid after every stage,
and Ctrl-C: a clean stop with exit status 130 that prints and saves what was known."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from pagedkv.__main__ import main
from pagedkv.sim import progress, sizing_jobs
from pagedkv.sim.progress import RunLines
from sigint import sigint_default_in_children

SMALL = ["simulate", "--requests", "120", "--doc-tokens", "2048", "--mrc"]
TIMING = {"wall_s", "jobs", "manager_ns"}  # and every key naming seconds


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def _without_timing(x: Any) -> Any:
    """The document with every measured time left out (they differ from run to run)."""
    if isinstance(x, dict):
        return {
            k: _without_timing(v)
            for k, v in x.items()
            if k not in TIMING and "seconds" not in k and "ns_per" not in k
        }
    if isinstance(x, list):
        return [_without_timing(v) for v in x]
    return x


@pytest.mark.parametrize(
    "mode",
    [[], ["--bracket", "--num-blocks", "4096"]],
    ids=["one-replay-one-sided", "own-replays-bracket"],
)
def test_parallel_equals_serial(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, mode: list[str]
) -> None:
    docs = []
    for jobs in ("1", "2"):
        js = tmp_path / f"jobs{jobs}.json"
        argv = [*SMALL, *mode, "--block-size", "16,32", "--no-progress", "--jobs", jobs]
        rc, out, _ = _run(capsys, *argv, "--json", str(js))
        assert rc == 0, out
        assert f"--jobs {jobs}" in out
        docs.append(json.loads(js.read_text()))
    serial, parallel = docs
    assert serial["sizing"]["recommendations"] == parallel["sizing"]["recommendations"]
    assert len(serial["sizing"]["recommendations"]) == 2
    assert serial["sizing"]["curve_replays"] == (2 if mode else 1)
    assert serial["sizing"]["curves"] == parallel["sizing"]["curves"]
    for a, b in zip(serial["runs"], parallel["runs"], strict=True):
        assert a["mrc"] == b["mrc"] and a["mrc_info"] == b["mrc_info"]
        assert a["workload_hit_rate"] == b["workload_hit_rate"]
        assert a["steps"]["hit_rate"] == b["steps"]["hit_rate"]
    assert _without_timing(serial) == _without_timing(parallel)


# ---------------------------------------------------------------------- progress


def test_progress_lines_when_not_a_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    now = [100.0]
    monkeypatch.setattr(progress.time, "perf_counter", lambda: now[0])
    stream = io.StringIO()
    lines = RunLines(stream, tty=False)
    lines.start("B=16 curve run")
    for done in range(1, 50):
        now[0] += 2.0  # 98 s in all: one line at the minute, no more
        lines.update("B=16 curve run", done, 12031)
    lines.end("B=16 curve run", "done")
    text = stream.getvalue().splitlines()
    assert text == [
        "[sizing] B=16 curve run: started",
        "[sizing] B=16 curve run: 30/12031 requests, 1m00s",
        "[sizing] B=16 curve run: done (1m38s)",
    ]
    assert "\r" not in stream.getvalue()


def test_progress_redraws_one_line_on_a_terminal() -> None:
    stream = io.StringIO()
    lines = RunLines(stream, tty=True)
    lines.start("B=16 curve run")
    lines.start("B=32 curve run")
    lines.update("B=16 curve run", 5, 10)
    lines.end("B=16 curve run", "done")
    lines.close()
    text = stream.getvalue()
    assert "\r[sizing] B=16 curve run 0/0 0s | B=32 curve run 0/0 0s" in text
    assert "[sizing] B=16 curve run: done (0s)\n" in text
    assert text.endswith("\n")


@pytest.mark.parametrize("jobs", ["1", "2"])
def test_progress_of_a_sizing_run(capsys: pytest.CaptureFixture[str], jobs: str) -> None:
    rc, _, err = _run(capsys, *SMALL, "--jobs", jobs)
    assert rc == 0
    lines = err.splitlines()
    assert "[sizing] B=16 curve run: started" in lines
    assert any(x.startswith("[sizing] B=16 curve run: done, hit rate ") for x in lines)
    assert any(x.startswith("[sizing] B=16: target ") and "check runs" in x for x in lines)
    started = [x for x in lines if "check run at" in x and x.endswith("started")]
    ended = [x for x in lines if "check run at" in x and ("passed" in x or "failed" in x)]
    assert started and len(started) == len(ended)
    assert any(x.startswith("[sizing] B=16: check runs done: ") for x in lines)
    assert "\r" not in err
    rc, _, err = _run(capsys, *SMALL, "--jobs", jobs, "--no-progress")
    assert rc == 0 and err == ""


# ---------------------------------------------------------------------- --json as it goes


def test_json_is_valid_after_every_stage(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    js = tmp_path / "stages.json"
    seen: list[dict[str, Any]] = []
    write = sizing_jobs.write_doc

    def spy(path: str, doc: dict[str, Any]) -> None:
        write(path, doc)
        seen.append(json.loads(Path(path).read_text()))  # the file as a reader finds it

    monkeypatch.setattr(sizing_jobs, "write_doc", spy)
    # Sizes given: a curve run per block size, so there is a stage between them.
    argv = [*SMALL, "--block-size", "16,32", "--num-blocks", "4096", "--no-progress", "--jobs", "1"]
    rc, _, _ = _run(capsys, *argv, "--json", str(js))
    assert rc == 0
    statuses = [d["sizing"]["status"] for d in seen]
    assert statuses[0] == "curve runs" and statuses[-1] == "complete"
    assert "check runs" in statuses
    # The first write holds the first curve run; each later one a run more.
    assert len(seen[0]["runs"]) == 1 and "mrc" in seen[0]["runs"][0]

    def runs(d: dict[str, Any]) -> int:
        return sum(
            len([r for r in rec["runs"] if r["source"] == "check"])
            for rec in d["sizing"]["recommendations"]
        )

    checks = [runs(d) for d in seen if d["sizing"]["status"] == "check runs"]
    assert checks == sorted(checks) and checks[-1] > checks[0]
    final = json.loads(js.read_text())
    assert final == seen[-1] and all(r["complete"] for r in final["sizing"]["recommendations"])


# ---------------------------------------------------------------------- Ctrl-C


def test_ctrl_c_in_a_check_run_saves_the_curves(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    js = tmp_path / "partial.json"
    perform = sizing_jobs.perform
    checks = [0]

    def interrupt_second_check(task: Any, ctx: Any, report: Any) -> Any:
        if task.kind == "check":
            checks[0] += 1
            if checks[0] == 2:
                report(task.label, 3, 120)
                raise KeyboardInterrupt
        return perform(task, ctx, report)

    monkeypatch.setattr(sizing_jobs, "perform", interrupt_second_check)
    rc, out, err = _run(capsys, *SMALL, "--jobs", "1", "--json", str(js))
    assert rc == sizing_jobs.INTERRUPTED == 130
    assert "Traceback" not in err
    assert "interrupted (Ctrl-C)" in out and "miss-ratio curve, block size 16" in out
    assert "interrupted: the search did not finish" in out
    doc = json.loads(js.read_text())
    assert doc["sizing"]["status"] == "interrupted"
    assert "mrc" in doc and doc["mrc_info"]["method"] == "exact"
    (rec,) = doc["sizing"]["recommendations"]
    assert rec["complete"] is False and rec["curve_estimate_blocks"] is not None
    assert [r["source"] for r in rec["runs"]].count("check") == 1  # the one that finished


def test_ctrl_c_in_the_curve_run_leaves_valid_json(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    js = tmp_path / "early.json"
    calls = [0]
    update = RunLines.update

    def interrupt(self: RunLines, label: str, done: int, total: int) -> None:
        calls[0] += 1
        if done >= 5:  # from inside the replay: the scheduler's progress callback
            raise KeyboardInterrupt
        update(self, label, done, total)

    monkeypatch.setattr(RunLines, "update", interrupt)
    rc, out, err = _run(capsys, *SMALL, "--jobs", "1", "--json", str(js))
    assert rc == 130 and "Traceback" not in err and "interrupted" in out
    assert "interrupted (Ctrl-C): stopping the runs; what is known follows" in err
    doc = json.loads(js.read_text())
    assert doc["sizing"]["status"] == "interrupted" and doc["sizing"]["recommendations"] == []
    # What the replay did before the interrupt is kept, and said to be partial.
    (part,) = doc["sizing"]["partial_curves"]
    done, total = part["requests_done"], part["requests"]
    assert 0 < done < total and part["block_size"] == 16 and part["mrc"]
    assert (
        f"partial     the B=16 curve run was interrupted after {done} of {total} requests: "
        "the curve below is of those requests only" in out
    )
    assert out.index("partial     the B=16") < out.index("miss-ratio curve, block size 16")


def _children(pid: int) -> set[int]:
    kids: set[int] = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        text = (task / "children").read_text().split()
        kids.update(int(x) for x in text)
    return kids


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.split(")")[-1].split()[0] != "Z"


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="reads /proc (Linux)")
def test_sigint_stops_a_real_run_and_its_workers(tmp_path: Path) -> None:
    """A real process, SIGINT while the check runs run in two workers."""
    js = tmp_path / "sigint.json"
    argv = ["--requests", "1500", "--doc-tokens", "4096", "--mrc", "--jobs", "2"]
    with sigint_default_in_children():  # CI may have started pytest ignoring SIGINT
        proc = subprocess.Popen(
            [sys.executable, "-m", "pagedkv", "simulate", *argv, "--json", str(js)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=dict(os.environ),
        )
    try:
        deadline = time.monotonic() + 120
        status = None
        while time.monotonic() < deadline and proc.poll() is None:
            if js.exists():
                status = json.loads(js.read_text())["sizing"]["status"]
                if status == "check runs":
                    break
            time.sleep(0.05)
        assert status == "check runs", "the run never reached its check runs"
        workers = _children(proc.pid)
        assert workers, "the check runs run in worker processes"
        t0 = time.monotonic()
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 130, out + err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err
    assert "interrupted (Ctrl-C): stopping the runs; what is known follows" in err
    assert took < 10.0, f"{took:.1f} s from Ctrl-C to the exit"  # no curve run to wait for
    assert "interrupted (Ctrl-C)" in out and "time        wall" in out
    doc = json.loads(js.read_text())
    assert doc["sizing"]["status"] == "interrupted" and "mrc" in doc
    time.sleep(0.5)
    assert not [w for w in workers if _alive(w)], "the workers outlived the run"


@pytest.mark.slow  # a replay long enough to be interrupted midway: tens of seconds
def test_sigint_in_the_first_replay_keeps_its_partial_curve(tmp_path: Path) -> None:
    """A real process, SIGINT while a worker process replays the curve run: the worker hands
    back the curve of the requests it replayed, and the output says it is partial."""
    js = tmp_path / "first.json"
    # 60,000 requests: about 3 s to build in the worker, then a replay of tens of seconds.
    argv = ["--requests", "60000", "--doc-tokens", "1024", "--mrc", "--jobs", "2"]
    with sigint_default_in_children():  # CI may have started pytest ignoring SIGINT
        proc = subprocess.Popen(
            [sys.executable, "-m", "pagedkv", "simulate", *argv, "--json", str(js)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=dict(os.environ),
        )
    try:
        assert proc.stderr is not None
        first = proc.stderr.readline()  # the worker has started: it builds, then replays
        assert first.startswith("[sizing] B=16 curve run: started"), first
        time.sleep(8.0)
        assert proc.poll() is None and not js.exists(), "the replay ended before Ctrl-C"
        t0 = time.monotonic()
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=120)
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 130, out + err
    assert "Traceback" not in err and "interrupted (Ctrl-C): stopping the runs" in err
    assert took < 30.0, f"{took:.1f} s from Ctrl-C to the exit"
    doc = json.loads(js.read_text())
    assert doc["sizing"]["status"] == "interrupted" and doc["sizing"]["recommendations"] == []
    (part,) = doc["sizing"]["partial_curves"]
    assert 0 < part["requests_done"] < part["requests"] == 60000
    assert f"interrupted after {part['requests_done']} of 60000 requests" in out
    assert "miss-ratio curve, block size 16" in out
