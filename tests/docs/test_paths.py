"""Every file a docs page names exists in the repository (README.md and docs/*.md: the prose and
its inline code; fenced blocks are commands, which test_commands.py runs).

1. A path from the repository's top (`packages/...`, `tests/...`, `docs/...`, `configs/...`,
   `examples/...`, `bench/...`) or from a package's import folder (`nanotron_train/...`, which
   is `packages/<name>/src/nanotron_train/...`) exists there, as a file or (ending in `/`) a
   folder.
2. Any other Python file (`trainer.py`, `data/datatrove.py`) is a file of the repository whose
   path ends so.
3. In docs/internals.md, a Python file under a package's heading (`## nanotron_train`) is a file
   of that package.
Placeholders (`<dim>`, `{R}`, `*`) are not paths. The files of another project that a page names
(Nanotron's) are listed in OTHERS, each with its owner, and each must be named somewhere.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from tests.docs.doc_pages import ROOT, blocks, pages, rel

TOP = ("packages", "tests", "docs", "configs", "examples", "bench", ".ci")
PACKAGES = ("nanotron_parallel", "nanotron_models", "nanotron_train", "nanotron_dashboard")
SKIP_DIRS = {".git", ".venv", "node_modules", "__pycache__", "build", "dist", ".cache"}
# A path-shaped word: slash-separated names ending in a file extension or a slash.
PATH = re.compile(
    r"(?<![\w./<>{}*-])((?:[\w.+-]+/)*[\w+-][\w.+-]*\.(?:py|md|yaml|yml|toml|sh|txt|js|css|html)"
    r"|(?:[\w.+-]+/)+)(?![\w/<>{}*-])"
)

# Files of other projects that the pages name, by their own paths: (path, whose).
OTHERS: list[tuple[str, str]] = [
    ("examples/config_tiny_llama.py", "Nanotron's example script"),
    ("examples/config_qwen.yaml", "Nanotron's example config"),
]


def repo_files() -> list[str]:
    """Every file under the repository's root, relative to it (hidden folders but .ci, caches,
    environments and build outputs left out)."""
    out = []
    for folder, dirs, files in os.walk(ROOT):
        dirs[:] = [
            d for d in dirs
            if d not in SKIP_DIRS and not d.endswith(".egg-info")
            and (d == ".ci" or not d.startswith("."))
        ]  # fmt: skip
        out += [os.path.relpath(os.path.join(folder, f), ROOT) for f in files]
    return sorted(out)


def text_without_fences(page: Path) -> list[str]:
    """The page's lines, those of fenced blocks (and their fences) blanked."""
    lines = page.read_text().splitlines()
    for b in blocks(page):
        for k in range(b.line - 1, min(b.line + b.text.count("\n") + 2, len(lines))):
            lines[k] = ""
    return lines


def package_sources(package: str) -> Path | None:
    found = sorted(ROOT.glob(f"packages/*/src/{package}"))
    return found[0] if found else None


def missing(name: str, files: list[str], package: str | None) -> str | None:
    """Why `name` names no file of the repository, or None."""
    first = name.split("/", 1)[0]
    if first in TOP:
        return None if (ROOT / name).exists() else "no such path from the repository's top"
    if first in PACKAGES:
        src = package_sources(first)
        ok = src is not None and (src.parent / name).exists()
        return None if ok else f"no such path in the package {first}"
    if not name.endswith(".py"):
        return None  # an output file (config.yaml, metadata.json) or a folder of one
    if package is not None and "/" not in name:
        src = package_sources(package)
        inside = src is not None and any(src.rglob(name))
        return None if inside else f"no such module in {package} (this section's package)"
    return None if any(f == name or f.endswith("/" + name) for f in files) else "no such file"


def named_paths(page: Path) -> list[tuple[int, str, str | None]]:
    """(line, path, package of the section) for each path-shaped word of the page."""
    out, package = [], None
    for number, line in enumerate(text_without_fences(page), start=1):
        heading = re.match(r"^(#+)\s+(.*)$", line)
        if heading and page.name == "internals.md" and len(heading.group(1)) == 2:
            title = heading.group(2).strip("` ")
            package = title if title in PACKAGES else None
        # (a URL's parts follow a "/" or a ".", so they are never path-shaped words)
        out += [(number, m.group(1), package) for m in PATH.finditer(line)]
    return out


def broken_paths(page: Path, files: list[str]) -> list[str]:
    others = {p for p, _ in OTHERS}
    bad = []
    for number, name, package in named_paths(page):
        if name in others:
            continue
        why = missing(name, files, package)
        if why is not None:
            bad.append(f"{rel(page)}:{number}: {name} ({why})")
    return bad


def test_every_file_a_page_names_exists():
    files = repo_files()
    assert [b for p in pages() for b in broken_paths(p, files)] == []


def test_every_other_projects_file_is_named():
    named = {name for p in pages() for _, name, _ in named_paths(p)}
    assert [p for p, _ in OTHERS if p not in named] == []


def test_the_path_check_sees_stale_names(tmp_path, monkeypatch):
    """The checker itself: the module names that docs/internals.md kept after the files were
    split (config.py, ...) fail, under the package's heading and as paths; real ones pass."""
    import tests.docs.test_paths as me

    page = tmp_path / "internals.md"
    page.write_text(
        "# Internals\n\n## nanotron_train\n\n- `config.py`, `config_loader.py`, "
        "`trainer.py`, `data/datatrove.py`, `data_source.py`\n"
        "- tests/train/test_cli.py and tests/train/gone.py; `nanotron_train/config/` and "
        "`nanotron_train/config.py`; `packages/<name>/pyproject.toml`; `metadata.json`\n\n"
        "```bash\npython gone.py\n```\n\n## nanotron_models\n\n- `config.py`, `trainer.py`\n"
    )
    monkeypatch.setattr(me, "rel", lambda p: p.name)
    assert broken_paths(page, repo_files()) == [
        "internals.md:5: config.py (no such module in nanotron_train (this section's package))",
        "internals.md:5: config_loader.py (no such module in nanotron_train (this section's "
        "package))",
        "internals.md:5: data_source.py (no such module in nanotron_train (this section's "
        "package))",
        "internals.md:6: tests/train/gone.py (no such path from the repository's top)",
        "internals.md:6: nanotron_train/config.py (no such path in the package nanotron_train)",
        "internals.md:14: trainer.py (no such module in nanotron_models (this section's package))",
    ]
