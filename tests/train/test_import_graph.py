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


# -- The model-family seam --------------------------------------------------------------------
# A family is its own modules plus its row in nanotron_models/families.py: everything else
# (the trainer, parallelize, inference, conversion, checkpoints, the memory check, telemetry,
# the family-agnostic parts of the models package) reaches it through the row and the stage
# interface (nanotron_models/stage.py), never by naming its functions or classes.
#
# The Llama family's own modules (Llama, Nanotron's Qwen2, their Mixtral / Qwen2-MoE forms):
FAMILY_MODULES = {
    f"nanotron_models.{m}"
    for m in (
        "config", "qwen2", "blocks", "attention_layer", "model", "init", "flops", "kv_cache",
        "nanotron_names", "hf", "hf_qwen2", "hf_qwen2_moe", "hf_mixtral", "hf_llama_family",
        # the Mamba-2 / hybrid family (its layers reuse the Llama family's attention and norm)
        "mamba2_hybrid", "mamba2_hybrid.config", "mamba2_hybrid.spec", "mamba2_hybrid.layers",
        "mamba2_hybrid.stage", "mamba2_hybrid.hf", "mamba2_hybrid.decode_state",
        "mamba2_hybrid.names", "mamba2_hybrid.comm",
        # the Mamba-1 family (Nanotron's example; its stage is the hybrid's with its layers)
        "mamba1", "mamba1.config", "mamba1.spec", "mamba1.layers", "mamba1.stage", "mamba1.hf",
        "mamba1.names",
        # the Qwen3-Next family (its stage and layers build on the hybrid's)
        "qwen3_next", "qwen3_next.config", "qwen3_next.spec", "qwen3_next.attention",
        "qwen3_next.layers", "qwen3_next.stage", "qwen3_next.hf", "qwen3_next.names",
        "qwen3_next.comm",
    )
}  # fmt: skip
# Modules that may name a family: its row, and the package's facade (re-exports for scripts).
FAMILY_REACHERS = {"nanotron_models.families", "nanotron_models"}
# Names in those modules that are no family's: every family builds with them.
SHARED = {
    ("nanotron_models.config", "DTYPES"),  # model.dtype's names
    ("nanotron_models.config", "ModelConfigError"),
    ("nanotron_models.init", "InitSpec"),  # how a full tensor is made (materialise.py)
    ("nanotron_models.init", "full_tensor"),
    ("nanotron_models.blocks", "Loss"),  # the loss block (the trainer sums its z-loss)
    ("nanotron_models.blocks", "MLP"),  # the `-` layer, a MoE layer's shared expert
    ("nanotron_models.blocks", "RMSNorm"),  # every family's norm (stage_plumbing.py's tp mode)
    ("nanotron_models.blocks", "linear_mode"),
}


def facade_sources(path: Path, package: str) -> dict[str, str]:
    """Name -> the module it comes from, for the names a package's __init__ re-exports."""
    out = {}
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module:
            for alias in node.names:
                out[alias.asname or alias.name] = f"{package}.{node.module}"
    return out


def family_names_used(
    module: str, path: Path, family_modules: set[str], facade: tuple[str, dict[str, str]], shared
) -> list[str]:
    """`module imports <family module>[.<name>]` for each family name or module `module`
    imports; `facade`: (package, its re-exported names' modules) of `facade_sources`."""
    is_package = path.name == "__init__.py"
    facade_package, facade_names = facade
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [f"{module} imports {a.name}" for a in node.names if a.name in family_modules]
            continue
        if not isinstance(node, ast.ImportFrom):
            continue
        source = node.module or ""
        if node.level:
            base = module.split(".")
            base = base[: len(base) - node.level + (1 if is_package else 0)]
            source = ".".join(base + ([node.module] if node.module else []))
        for alias in node.names:
            if f"{source}.{alias.name}" in family_modules:  # `from pkg import family_module`
                found.append(f"{module} imports {source}.{alias.name}")
                continue
            origin = facade_names.get(alias.name, source) if source == facade_package else source
            if origin in family_modules and (origin, alias.name) not in shared:
                found.append(f"{module} imports {origin}.{alias.name}")
    return found


def test_only_a_family_and_its_row_name_its_functions():
    """A family whose blocks are not attention must not have to touch the trainer: no module
    outside the Llama family's own files and families.py imports its functions or classes
    (llama_init_spec, build_llama_stage, LlamaStage, DecoderLayer, KVCache, LlamaConfig, the
    Llama FLOPs, ...), directly or through the package's facade."""
    facade = (
        "nanotron_models",
        facade_sources(PACKAGES["nanotron_models"] / "__init__.py", "nanotron_models"),
    )
    wrong = sorted(
        use
        for module, path in all_modules().items()
        if module.startswith(("nanotron_parallel", "nanotron_models", "nanotron_train"))
        and module not in FAMILY_MODULES | FAMILY_REACHERS
        for use in family_names_used(module, path, FAMILY_MODULES, facade, SHARED)
    )
    assert wrong == []


def test_the_family_seam_check_sees_direct_facade_and_module_imports(tmp_path: Path):
    """The checker itself: a name from a family module, the same through the facade, the
    family module itself, and a shared name (allowed)."""
    pkg = tmp_path / "demo"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("from .fam import build_fam\n")
    (pkg / "fam.py").write_text("def build_fam(): ...\nSHARED = 1\n")
    (pkg / "a.py").write_text("from demo.fam import build_fam, SHARED\n")
    (pkg / "b.py").write_text("def f():\n    from demo import build_fam\n")
    (pkg / "c.py").write_text("from . import fam\nimport demo.fam\n")
    facade = ("demo", facade_sources(pkg / "__init__.py", "demo"))
    fam, shared = {"demo.fam"}, {("demo.fam", "SHARED")}
    found = {
        m: family_names_used(m, p, fam, facade, shared)
        for m, p in module_files("demo", pkg).items()
        if m in ("demo.a", "demo.b", "demo.c")
    }
    assert found == {
        "demo.a": ["demo.a imports demo.fam.build_fam"],
        "demo.b": ["demo.b imports demo.fam.build_fam"],
        "demo.c": ["demo.c imports demo.fam", "demo.c imports demo.fam"],
    }
