"""The README's router example runs as written (two managers' publishers on loopback, the
index following both) and prints what its comment says."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

README = (Path(__file__).resolve().parents[2] / "README.md").read_text(encoding="utf-8")


def test_readme_router_example_runs() -> None:
    section = README[README.index("### A KV-aware router index") :]
    code = section.split("```python\n", 1)[1].split("```", 1)[0]
    assert "ix.follow(" in code and "loads=" in code
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.strip() == "[('e0', 16), ('e1', 0)]"
