"""The simulator's house: each `sim` module imports alone, none imports another's private
name, and the import graph of `sim/` has no cycle (the commands share `sim.runner`)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import pagedkv.sim
from import_graph import cycles, private_uses, sim_graph

SIM = Path(pagedkv.sim.__file__).parent
MODULES = sorted(p.stem for p in SIM.glob("*.py") if p.stem != "__init__")


@pytest.mark.parametrize("name", MODULES)
def test_each_module_imports_alone(name: str) -> None:
    """A fresh interpreter imports the module first (an import circle fails here with a
    partially initialised module)."""
    env_path = ":".join(sys.path)
    proc = subprocess.run(
        [sys.executable, "-c", f"import pagedkv.sim.{name}"],
        capture_output=True,
        text=True,
        timeout=60,
        env={"PYTHONPATH": env_path, "PATH": "/usr/bin:/bin"},
    )
    assert proc.returncode == 0, proc.stderr


def test_no_private_names_across_modules() -> None:
    uses = private_uses(SIM)
    assert uses == [], "sim modules using another module's private names:\n" + "\n".join(uses)


def test_import_graph_has_no_cycle() -> None:
    graph = sim_graph(SIM)
    assert "runner" in graph["cli"] and "runner" in graph["sizing_jobs"]
    assert "cli" not in graph["sizing_jobs"] and "sizing_jobs" not in graph["policies_cli"]
    assert cycles(graph) == []


def test_the_checks_find_a_planted_circle(tmp_path: Path) -> None:
    """The checker itself: a circle through a function-level import and a private name used
    through a module alias are both found."""
    pkg = tmp_path / "sim"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pagedkv.sim.b import _helper\n")
    (pkg / "b.py").write_text(
        "def _helper():\n    from pagedkv.sim import c\n    return c._thing\n"
    )
    (pkg / "c.py").write_text("import pagedkv.sim.a\n_thing = 1\n")
    graph = sim_graph(pkg)
    assert graph == {"a": {"b"}, "b": {"c"}, "c": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]
    assert private_uses(pkg) == ["a.py imports b._helper", "b.py uses c._thing"]
