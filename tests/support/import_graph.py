"""The import graph of a package's modules, read from their source (an AST walk): which
module imports which (function-level imports included: a circle through one is a circle
still), the cycles, and the uses of another module's private names."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = "pagedkv.sim"


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _target(module: str | None, level: int) -> str | None:
    """The sibling module an import names (`pagedkv.sim.X` or `.X`), or "" for the package."""
    if level == 1:
        return module.split(".")[0] if module else ""
    if module == PACKAGE:
        return ""
    if module and module.startswith(PACKAGE + "."):
        return module[len(PACKAGE) + 1 :].split(".")[0]
    return None


def _edges(path: Path, modules: set[str]) -> tuple[set[str], list[str]]:
    """(the sibling modules `path` imports, its uses of their private names)."""
    tree = ast.parse(path.read_text(), str(path))
    deps: set[str] = set()
    uses: list[str] = []
    aliases: dict[str, str] = {}  # local name -> sibling module it is bound to
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            target = _target(node.module, node.level)
            if target is None:
                continue
            for alias in node.names:
                if target == "" and alias.name in modules:  # from pagedkv.sim import X
                    deps.add(alias.name)
                    aliases[alias.asname or alias.name] = alias.name
                elif target:
                    deps.add(target)
                    if _private(alias.name):
                        uses.append(f"{path.name} imports {target}.{alias.name}")
                else:
                    deps.add("__init__")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                target = _target(alias.name, 0)
                if target:
                    deps.add(target)
                    if alias.asname:
                        aliases[alias.asname] = target
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in aliases
            and _private(node.attr)
        ):
            uses.append(f"{path.name} uses {aliases[node.value.id]}.{node.attr}")
        elif (  # pagedkv.sim.X._name
            isinstance(node, ast.Attribute)
            and _private(node.attr)
            and ast.unparse(node.value).startswith(PACKAGE + ".")
        ):
            uses.append(f"{path.name} uses {ast.unparse(node)[len(PACKAGE) + 1 :]}")
    deps.discard(path.stem)
    return deps, uses


def sim_graph(folder: Path) -> dict[str, set[str]]:
    """Module -> the sibling modules it imports (the package's `__init__` left out: it
    imports the modules to re-export them; a module importing from it is kept)."""
    modules = {p.stem for p in folder.glob("*.py")}
    return {
        p.stem: _edges(p, modules)[0] for p in sorted(folder.glob("*.py")) if p.stem != "__init__"
    }


def private_uses(folder: Path) -> list[str]:
    """Each use of a sibling module's private name, as "a.py imports b._x" / "a.py uses b._x"."""
    modules = {p.stem for p in folder.glob("*.py")}
    out: list[str] = []
    for p in sorted(folder.glob("*.py")):
        out += _edges(p, modules)[1]
    return sorted(out)


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)
