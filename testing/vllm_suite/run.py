"""Run vLLM's scheduler tests with a chosen KV-cache manager and count the outcomes.

    python -m vllm_suite.run [--version 0.34.0] [--manager module:Class]
                             [--tests PATH::name ...] [--json out.json] [--gate]

Needs `python -m vllm_suite.fetch --version ...` first, and that release of vLLM installed
(checked: the run fails when the installed vLLM is another). pytest runs in a subprocess,
rooted in the extracted vLLM tree with vLLM's own pytest configuration (not this
project's), with vllm_suite.swap_manager loaded; its full output goes to a log file beside
the JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from vllm_suite import pins
from vllm_suite.results import Outcomes, read_junit
from vllm_suite.swap_manager import ENV_VAR, VERSION_ENV_VAR

# CI's gate (--gate): the fewest scheduler tests that must pass, per pinned release. vLLM's
# own manager passes them all (0.33.0: 281, 0.34.0: 303), and so does
# pagedkv.vllm.KVCacheManager (docs/vllm.md).
MIN_PASSED = 281
MIN_PASSED_BY_VERSION = {
    "0.33.0": MIN_PASSED,
    "0.34.0": 303,
}

_SHOWN_PROBLEMS = 20


def test_environment(release: pins.Pin, manager: str | None) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        VLLM_TARGET_DEVICE="cpu",  # otherwise vLLM fails to infer a device type
        CUDA_VISIBLE_DEVICES="",
        HF_HOME=str(release.hf_home),
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        PYTHONDONTWRITEBYTECODE="1",
    )
    # vllm_suite (the plugin) must be importable in the subprocess.
    testing = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (testing, env.get("PYTHONPATH")) if p)
    env[VERSION_ENV_VAR] = release.version  # the plugin refuses another installed vLLM
    env.pop(ENV_VAR, None)
    if manager is not None:
        env[ENV_VAR] = manager
    return env


def run_pytest(
    tree: Path, tests: list[str], env: dict[str, str], junit: Path, log: Path, timeout: float
) -> int:
    command = [
        sys.executable, "-m", "pytest",
        "-c", str(tree / "pyproject.toml"), "--rootdir", str(tree),
        "-p", "no:cacheprovider", "-p", "vllm_suite.swap_manager",
        "-rN", f"--junitxml={junit}",
        *tests,
    ]  # fmt: skip
    with log.open("w") as out:
        try:
            done = subprocess.run(
                command, cwd=tree, env=env, stdout=out, stderr=subprocess.STDOUT,
                timeout=timeout, check=False,
            )  # fmt: skip
        except subprocess.TimeoutExpired:
            print(f"pytest ran past {timeout:.0f} s and was stopped", file=sys.stderr)
            return -1
    return done.returncode


def summarize(version: str, outcomes: Outcomes, manager: str | None, wall: float) -> None:
    for test_id, line in list(outcomes.problems.items())[:_SHOWN_PROBLEMS]:
        print(f"  {test_id.split('::', 1)[-1]}: {line[:140]}")
    if len(outcomes.problems) > _SHOWN_PROBLEMS:
        print(f"  ... {len(outcomes.problems) - _SHOWN_PROBLEMS} more in the JSON")
    c = outcomes.counts
    # Deliberately not pytest's "N passed, N failed" shape: CI logs read such closing lines
    # as the project's own test results.
    who = manager or "vLLM's own"
    print(
        f"vLLM {version} scheduler tests with {who}: passed {c['passed']}, "
        f"failed {c['failed']}, errors {c['error']}, skipped {c['skipped']} ({wall:.0f} s)"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m vllm_suite.run", description=__doc__)
    parser.add_argument(
        "--version", default=pins.DEFAULT_VERSION,
        help=f"the vLLM release, installed and fetched (pinned: {', '.join(pins.SDIST_SHA256)})",
    )  # fmt: skip
    parser.add_argument("--manager", help="module:Class to build schedulers' KV-cache managers")
    parser.add_argument(
        "--tests", nargs="+", default=[pins.SCHEDULER_TESTS],
        help="test ids relative to the vLLM tree (default: the whole scheduler test file)",
    )  # fmt: skip
    parser.add_argument("--json", type=Path, help="write counts and failing tests here")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds for pytest")
    parser.add_argument(
        "--gate", action="store_true",
        help="exit 1 unless the release's MIN_PASSED_BY_VERSION pass",
    )  # fmt: skip
    args = parser.parse_args(argv)
    release = pins.pin(args.version)
    min_passed = MIN_PASSED_BY_VERSION[release.version]

    if not (release.tree_dir / pins.SCHEDULER_TESTS).is_file():
        parser.error(
            f"no vLLM tests in {release.tree_dir}: run "
            f"`python -m vllm_suite.fetch --version {release.version}`"
        )
    out_dir = args.json.resolve().parent if args.json else Path(tempfile.mkdtemp())
    out_dir.mkdir(parents=True, exist_ok=True)
    junit, log = out_dir / "vllm-scheduler-junit.xml", out_dir / "vllm-scheduler-pytest.log"
    junit.unlink(missing_ok=True)  # never count an earlier run's report

    start = time.monotonic()
    env = test_environment(release, args.manager)
    code = run_pytest(release.tree_dir, args.tests, env, junit, log, args.timeout)
    wall = time.monotonic() - start
    if not junit.exists():
        print(log.read_text()[-3000:], file=sys.stderr)
        print(f"pytest exited {code} without a report; log: {log}", file=sys.stderr)
        return 1
    outcomes = read_junit(junit)
    if args.json:
        report = {"vllm": release.version, "manager": args.manager, "wall_s": round(wall, 1),
                  "pytest_exit": code, **outcomes.to_json()}  # fmt: skip
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    summarize(release.version, outcomes, args.manager, wall)
    print(f"pytest log: {log}")
    if code not in (0, 1):  # 1 = some tests failed; anything else = pytest itself went wrong
        print(f"pytest exited {code}: see the log", file=sys.stderr)
        return 1
    if args.gate and outcomes.counts["passed"] < min_passed:
        print(
            f"fewer than {min_passed} passed (vllm_suite.run.MIN_PASSED_BY_VERSION)",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
