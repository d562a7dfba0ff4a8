"""The vLLM release whose tests are run, and where its files go (one place for each pin)."""

from __future__ import annotations

from pathlib import Path

VLLM_VERSION = "0.33.0"
SDIST_NAME = f"vllm-{VLLM_VERSION}.tar.gz"
# Checked before anything is extracted: the tests must be exactly this release's.
SDIST_SHA256 = "f4c33c2503d52bb411146afa9618a4f48bed68912f617e6803ac8d76e4c74112"
SIMPLE_INDEX_URL = "https://pypi.org/simple/vllm/"

REPO_ROOT = Path(__file__).resolve().parents[2]
# Git-ignored (.gitignore: /.vllm-tests).
WORK_DIR = REPO_ROOT / ".vllm-tests" / VLLM_VERSION
TREE_DIR = WORK_DIR / "tree"  # holds tests/ and vLLM's pyproject.toml (pytest's markers)
HF_HOME = WORK_DIR / "hf-home"
HF_CONFIGS = Path(__file__).resolve().parent / "hf_configs"

SCHEDULER_TESTS = "tests/v1/core/test_scheduler.py"
