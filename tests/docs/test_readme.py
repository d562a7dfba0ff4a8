"""The README's claims a new user acts on: install commands that work from the checkout, and
the GPU pool example, which runs as written (on the CPU where there is no GPU). The other
usage examples run in tests/docs/test_stubs.py."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

README = (Path(__file__).resolve().parents[2] / "README.md").read_text(encoding="utf-8")


def test_installs_come_from_the_checkout() -> None:
    """pagedkv is not on a package index: extras install as `'.[extra]'`."""
    assert not re.search(r"pip install [\"']?pagedkv\[", README)
    for extra in ("plot", "cuda", "test"):
        assert f"pip install '.[{extra}]'" in README, extra
    assert "pytest benches" in README and "'.[test]'" in README


def test_gpu_example_runs_as_written() -> None:
    pytest.importorskip("torch")  # the [cuda] extra (CI installs it with kernels-ci)
    section = README[README.index("## GPU KV pool and kernels") :]
    code = section.split("```python\n", 1)[1].split("```", 1)[0]
    assert "device=device" in code and "paged_decode_attention" in code
    proc = subprocess.run(
        [sys.executable, "-c", code + "\nassert out.shape == q.shape, out.shape\n"],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
