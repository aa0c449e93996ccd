"""The import graph of the four packages, read from the source with `ast`: no cycle, and the
dependencies point one way (nanotron_parallel <- nanotron_models <- nanotron_train; the
dashboard imports none of them and none imports it).

Every import counts: module level, under `if TYPE_CHECKING:` and inside functions, since a
type-only or deferred cycle is still two modules that cannot be read (or moved) apart.
"""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = {
    "nanotron_parallel": ROOT / "packages/parallel/src/nanotron_parallel",
    "nanotron_models": ROOT / "packages/models/src/nanotron_models",
    "nanotron_train": ROOT / "packages/train/src/nanotron_train",
    "nanotron_dashboard": ROOT / "packages/dashboard/src/nanotron_dashboard",
}
# Which packages each one may import (besides itself).
ALLOWED = {
    "nanotron_parallel": set(),
    "nanotron_models": {"nanotron_parallel"},
    "nanotron_train": {"nanotron_parallel", "nanotron_models"},
    "nanotron_dashboard": set(),
}
# Cycles another change is removing, by their modules; empty when the code has none.
KNOWN_CYCLES: list[frozenset[str]] = []


def module_files(package: str, folder: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every module of one package."""
    found = {}
    for path in sorted(folder.rglob("*.py")):
        parts = [package, *path.relative_to(folder).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


@cache
def all_modules() -> dict[str, Path]:
    return {m: p for pkg, folder in PACKAGES.items() for m, p in module_files(pkg, folder).items()}


def imported_names(module: str, path: Path) -> set[str]:
    """Every dotted name `module` imports anywhere in its file (relative imports resolved)."""
    is_package = path.name == "__init__.py"
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")
                base = base[: len(base) - node.level + (1 if is_package else 0)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            names.add(source)
            # `from pkg import submodule` imports the submodule.
            names.update(f"{source}.{alias.name}" for alias in node.names)
    return names


def resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The module of ours a dotted name is, or lies in; None outside the four packages."""
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


@cache
def import_graph() -> dict[str, frozenset[str]]:
    modules = all_modules()
    graph = {}
    for module, path in modules.items():
        targets = {resolve(n, modules) for n in imported_names(module, path)}
        graph[module] = frozenset(t for t in targets if t and t != module)
    return graph


def cycles(graph: dict[str, frozenset[str]]) -> list[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(frozenset(component))
    return found


def test_the_graph_sees_every_package_and_its_imports():
    graph = import_graph()
    assert {m.partition(".")[0] for m in graph} == set(PACKAGES)
    assert "nanotron_train.config.schema" in graph["nanotron_train.trainer"]
    assert "nanotron_parallel.context" in graph["nanotron_train.trainer"]


def test_no_import_cycle():
    found = [sorted(c) for c in cycles(import_graph()) if c not in KNOWN_CYCLES]
    assert found == []


def test_dependencies_point_one_way():
    wrong = sorted(
        f"{module} imports {target}"
        for module, targets in import_graph().items()
        for target in targets
        if (src := module.partition(".")[0]) != (dst := target.partition(".")[0])
        and dst not in ALLOWED[src]
    )
    assert wrong == []


def test_the_cycle_finder_sees_direct_indirect_and_type_only_cycles(tmp_path: Path):
    """The checker itself, on a package whose cycles hide under TYPE_CHECKING and in functions."""
    pkg = tmp_path / "demo"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from demo.b import B\n"
    )
    (pkg / "b.py").write_text("def f():\n    from . import c\n")
    (pkg / "c.py").write_text("import demo.a\n")
    (pkg / "d.py").write_text("from demo import a\n")
    modules = module_files("demo", pkg)
    graph = {
        m: frozenset(t for n in imported_names(m, p) if (t := resolve(n, modules)) and t != m)
        for m, p in modules.items()
    }
    assert graph["demo.b"] == {"demo", "demo.c"}
    assert cycles(graph) == [frozenset({"demo.a", "demo.b", "demo.c"})]
