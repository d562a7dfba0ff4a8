"""The vLLM releases whose tests are run, and where each one's files go (one place per pin).

A release is added with its sdist's sha256 (the digest the package index lists for
`vllm-VERSION.tar.gz`) and its gate in `run.MIN_PASSED_BY_VERSION`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

# Checked before anything is extracted: the tests must be exactly this release's.
SDIST_SHA256 = {
    "0.33.0": "f4c33c2503d52bb411146afa9618a4f48bed68912f617e6803ac8d76e4c74112",
    "0.34.0": "fcad848b246a9d8652b47e6425af92334dc02492f9802720f54e27b823cf0113",
}
# The release run when none is named (the one .ci/run installs).
DEFAULT_VERSION = "0.33.0"
SIMPLE_INDEX_URL = "https://pypi.org/simple/vllm/"

REPO_ROOT = Path(__file__).resolve().parents[2]
HF_CONFIGS = Path(__file__).resolve().parent / "hf_configs"
SCHEDULER_TESTS = "tests/v1/core/test_scheduler.py"


@dataclass(frozen=True)
class Pin:
    """One pinned release: its sdist and its folders under the git-ignored .vllm-tests/."""

    version: str
    sdist_sha256: str

    @property
    def sdist_name(self) -> str:
        return f"vllm-{self.version}.tar.gz"

    @property
    def work_dir(self) -> Path:
        return REPO_ROOT / ".vllm-tests" / self.version

    @property
    def tree_dir(self) -> Path:
        """tests/ and vLLM's pyproject.toml (pytest's markers) of this release."""
        return self.work_dir / "tree"

    @property
    def hf_home(self) -> Path:
        return self.work_dir / "hf-home"


def pin(version: str) -> Pin:
    """The pin of `version`; a release without one is refused, naming those pinned."""
    digest = SDIST_SHA256.get(version)
    if digest is None:
        raise SystemExit(
            f"vLLM {version} has no pin in vllm_suite/pins.py (pinned: {', '.join(SDIST_SHA256)})"
        )
    return Pin(version, digest)


# The name .ci/run reads for the release it installs.
VLLM_VERSION = DEFAULT_VERSION
