"""Packaging checks: the typed stubs match the extension, `import pagedkv` stays light, and the
command-line tool runs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import pagedkv

ROOT = Path(__file__).resolve().parents[2]
ALLOWLIST = ROOT / "tests" / "docs" / "stubtest-allowlist.txt"


def _run(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, timeout=timeout, check=False
    )


@pytest.mark.slow
def test_stubtest_passes() -> None:
    """`_core.pyi` describes exactly what the compiled `pagedkv._core` exports."""
    proc = _run("-m", "mypy.stubtest", "pagedkv._core", "--allowlist", str(ALLOWLIST), timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_import_needs_numpy_only() -> None:
    """`import pagedkv` pulls in no GPU framework."""
    code = (
        "import sys, pagedkv, pagedkv.simulate\n"
        "heavy = sorted(m for m in ('torch', 'cupy', 'cuda', 'triton') if m in sys.modules)\n"
        "print(heavy)\n"
    )
    proc = _run("-c", code)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


def test_public_names() -> None:
    for name in pagedkv.__all__:
        assert hasattr(pagedkv, name), name
    assert isinstance(pagedkv.__version__, str)
    assert pagedkv.__version__


def test_cli_simulate_runs() -> None:
    proc = _run("-m", "pagedkv", "simulate", "--requests", "50", "--check")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    for needle in ("GPU blocks", "prefix hits", "evictions", "ns/token", "invariants  OK"):
        assert needle in out, out


def test_cli_rejects_bad_sizes() -> None:
    proc = _run("-m", "pagedkv", "simulate", "--num-blocks", "0")
    assert proc.returncode == 2
    assert "num_blocks" in proc.stderr


def test_readme_example_runs() -> None:
    """The usage examples in README.md (the basic one, then the engine-fit one, which
    continues it, then the hybrid-model one, then the eviction one) run as written."""
    text = (ROOT / "README.md").read_text()
    blocks = text.split("```python\n")[1:5]
    code = "".join(b[: b.index("```")] for b in blocks)
    assert "num_new_tokens" in code and "lookahead" in code and "groups=" in code
    assert "eviction=" in code and "set_tenant_quota" in code
    proc = _run("-c", code + "\nassert 5 not in m and m.stats().registered_blocks > 0\n")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "GPU blocks" in proc.stdout
