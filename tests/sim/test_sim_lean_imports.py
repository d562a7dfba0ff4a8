"""`simulate --mrc-only` on a trace of hash ids imports what it uses only (issue 35: its CPU
time is mostly the interpreter's start-up and imports, benches/results/issue35-sizing-speed.md):
not the scheduler, the manager's runs, the tiers, the cluster, the ablations, the policies'
runs, the live recorder, nor the parallel sizing runs and their multiprocessing."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from pagedkv.sim.ablate_claims import CLAIMS
from pagedkv.sim.option_names import CLAIM_NAMES

# Modules that the pure cache replay's path never calls; each was imported by it before.
NOT_NEEDED = (
    "pagedkv.sim.scheduler",
    "pagedkv.sim.record",
    "pagedkv.sim.calls",
    "pagedkv.sim.factory",
    "pagedkv.sim.sizing_jobs",
    "pagedkv.sim.ablate",
    "pagedkv.sim.ablate_claims",
    "pagedkv.sim.cluster",
    "pagedkv.sim.cluster_tier",
    "pagedkv.sim.policies",
    "pagedkv.sim.live",
    "pagedkv.sim.model_run",
    "pagedkv.sim.tier_run",
    "pagedkv.sim.mrc_fast",
    "pagedkv.sim.mrc",
    "pagedkv.tiers",
    "pagedkv.router",
    "multiprocessing",
    "concurrent.futures",
)

# Runs the command in a fresh interpreter, then prints its exit status, its output and the
# modules it left imported.
RUN = """
import io, json, sys
from pagedkv.__main__ import main
out = io.StringIO()
real, sys.stdout = sys.stdout, out
rc = main(sys.argv[1:])
sys.stdout = real
print(json.dumps({"rc": rc, "out": out.getvalue(), "modules": sorted(sys.modules)}))
"""


def _run(*argv: str) -> dict[str, object]:
    proc = subprocess.run(
        [sys.executable, "-c", RUN, *argv],
        capture_output=True,
        text=True,
        timeout=120,
        env={"PYTHONPATH": ":".join(sys.path), "PATH": "/usr/bin:/bin"},
    )
    assert proc.returncode == 0, proc.stderr
    doc: dict[str, object] = json.loads(proc.stdout)
    return doc


def test_mrc_only_imports_no_run_machinery(mooncake_trace: Path) -> None:
    doc = _run(
        "simulate", "--trace", str(mooncake_trace), "--block-size", "512", "--mrc-only",
        "--no-progress",
    )  # fmt: skip
    assert doc["rc"] == 0
    out = str(doc["out"])
    assert "the pure cache replay (--mrc-replay cache)" in out  # the path under test ran
    assert "optimal" in out  # and printed its bound
    modules = set(doc["modules"])  # type: ignore[call-overload]
    imported = [m for m in NOT_NEEDED if m in modules]
    assert imported == [], f"--mrc-only imported {imported}"


def test_the_scheduled_replay_still_imports_its_runs(mooncake_trace: Path) -> None:
    """The check above can fail: the same probe sees the scheduler and the sizing runs when
    the curve comes from a scheduled replay."""
    doc = _run(
        "simulate", "--trace", str(mooncake_trace), "--block-size", "512", "--mrc-only",
        "--mrc-replay", "scheduled", "--limit", "20", "--no-progress", "--jobs", "1",
    )  # fmt: skip
    assert doc["rc"] == 0
    modules = set(doc["modules"])  # type: ignore[call-overload]
    assert {"pagedkv.sim.scheduler", "pagedkv.sim.sizing_jobs"} <= modules


def test_the_claim_names_are_the_claims() -> None:
    """`--ablate-claims` accepts the names of `option_names` without importing the claims:
    they must be `CLAIMS`' keys, in order."""
    assert tuple(CLAIMS) == CLAIM_NAMES


def _blas_threads(env: dict[str, str]) -> tuple[str, int]:
    """OPENBLAS_NUM_THREADS as the command's process sees it once numpy is imported, and the
    process's threads then (Linux: numpy's BLAS pool starts one per core at import)."""
    code = (
        "import pagedkv.__main__, os, sys; assert 'numpy' in sys.modules; "
        "print(os.environ.get('OPENBLAS_NUM_THREADS'), len(os.listdir('/proc/self/task')))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env={"PYTHONPATH": ":".join(sys.path), "PATH": "/usr/bin:/bin", **env},
    )
    assert proc.returncode == 0, proc.stderr
    value, threads = proc.stdout.split()
    return value, int(threads)


def test_the_command_runs_one_blas_thread_unless_told_otherwise() -> None:
    """numpy's BLAS pool would start a thread per core at import, for no linear algebra:
    the command's process keeps its one thread (set before numpy's import), and a caller's
    own setting stays."""
    assert _blas_threads({}) == ("1", 1)
    assert _blas_threads({"OPENBLAS_NUM_THREADS": "2"})[0] == "2"
