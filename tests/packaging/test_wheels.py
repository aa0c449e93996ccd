"""What `python -m build` makes of each package: contents, metadata, one version for all four."""

from __future__ import annotations

import email
import tarfile
import zipfile
from pathlib import Path

import pytest

from tests.packaging.packaging_helpers import PACKAGES, ROOT, Built, tracked_files

VERSION = (ROOT / "VERSION").read_text().strip()


def tracked(folder: Path) -> set[str]:
    return set(tracked_files(folder))


def metadata(wheel: Path) -> email.message.Message:
    with zipfile.ZipFile(wheel) as z:
        (name,) = [n for n in z.namelist() if n.endswith(".dist-info/METADATA")]
        return email.message_from_bytes(z.read(name))


@pytest.mark.slow
@pytest.mark.parametrize("package", PACKAGES)
def test_wheel_holds_exactly_the_tracked_files_of_the_package(package, built):
    """A file the package opens at run time (static files, py.typed, any module) that the wheel
    lacks fails here, and the wheel holds nothing else of the package. The build ran on a copy
    of the tracked files, as a clean clone has them: a file only present untracked in this
    tree (e.g. a build output) is not shipped, so `git add` what the package needs."""
    import_name = f"nanotron_{package}"
    src = ROOT / "packages" / package / "src" / import_name
    expected = {f"{import_name}/{p}" for p in tracked(src)}
    with zipfile.ZipFile(built[package].wheel) as z:
        shipped = {n for n in z.namelist() if n.startswith(f"{import_name}/")}
    assert f"{import_name}/py.typed" in expected
    assert not expected - shipped, f"missing from the wheel: {sorted(expected - shipped)}"
    assert not shipped - expected, f"not the package's own: {sorted(shipped - expected)}"


@pytest.mark.slow
@pytest.mark.parametrize("package", PACKAGES)
def test_wheel_metadata_version_licence_readme_urls(package, built):
    b: Built = built[package]
    meta = metadata(b.wheel)
    assert meta["Name"] == f"nanotron-{package}"
    assert meta["Version"] == VERSION
    assert b.wheel.name.startswith(f"nanotron_{package}-{VERSION}-")
    assert b.sdist.name == f"nanotron_{package}-{VERSION}.tar.gz"
    assert meta["Requires-Python"] == ">=3.10"
    assert meta["License-Expression"].startswith("Apache-2.0")
    assert meta["Description-Content-Type"] == "text/markdown"
    readme = (ROOT / "packages" / package / "README.md").read_text()
    assert meta.get_payload().strip() == readme.strip()
    assert readme.startswith(f"# nanotron-{package}\n")
    urls = dict(u.split(", ", 1) for u in meta.get_all("Project-URL"))
    assert {"Homepage", "Documentation"} <= urls.keys()
    with zipfile.ZipFile(b.wheel) as z:
        licence = z.read(f"nanotron_{package}-{VERSION}.dist-info/licenses/LICENSE")
    assert licence == (ROOT / "LICENSE").read_bytes()


@pytest.mark.slow
def test_dashboard_wheel_ships_uplot_with_its_licence_and_the_console_script(built):
    wheel = built["dashboard"].wheel
    meta = metadata(wheel)
    assert meta["License-Expression"] == "Apache-2.0 AND MIT"
    dist_info = f"nanotron_dashboard-{VERSION}.dist-info"
    vendor = "nanotron_dashboard/static/vendor"
    with zipfile.ZipFile(wheel) as z:
        uplot_licence = z.read(f"{dist_info}/licenses/src/{vendor}/uPlot.LICENSE").decode()
        entry_points = z.read(f"{dist_info}/entry_points.txt").decode()
        minified = z.read(f"{vendor}/uPlot.iife.min.js")
    assert "MIT License" in uplot_licence and "Leon Sorokin" in uplot_licence
    assert "nanotron-dashboard = nanotron_dashboard.cli:main" in entry_points
    assert len(minified) > 40_000  # the real build, not a stub


@pytest.mark.slow
@pytest.mark.parametrize("package", PACKAGES)
def test_sdist_builds_alone(package, built):
    """The sdist carries real copies of the shared LICENSE and VERSION (links in the tree) and
    every tracked source file: the wheel is built from it, so this is what a user rebuilds."""
    root = ROOT / "packages" / package
    name = f"nanotron_{package}-{VERSION}"
    with tarfile.open(built[package].sdist) as t:
        members = {m.name.removeprefix(f"{name}/"): m for m in t.getmembers()}
        assert members["LICENSE"].isfile() and members["VERSION"].isfile()
        assert t.extractfile(members["VERSION"]).read().decode().strip() == VERSION
        assert t.extractfile(members["LICENSE"]).read() == (ROOT / "LICENSE").read_bytes()
    sources = {f"src/{p}" for p in tracked(root / "src")}
    assert not sources - members.keys(), sorted(sources - members.keys())
    assert {"README.md", "pyproject.toml"} <= members.keys()


def test_one_version_for_all_four_set_in_the_version_file():
    for package in PACKAGES:
        link = ROOT / "packages" / package / "VERSION"
        assert link.is_symlink() and link.resolve() == (ROOT / "VERSION").resolve(), link
        assert (ROOT / "packages" / package / "LICENSE").resolve() == (ROOT / "LICENSE")
        text = (ROOT / "packages" / package / "pyproject.toml").read_text()
        project = text.split("\n[project]\n", 1)[1].split("\n[", 1)[0]  # the [project] table
        assert 'dynamic = ["version"]' in project.splitlines(), package
        assert not any(line.startswith("version") for line in project.splitlines()), package
        assert '\n[tool.setuptools.dynamic]\nversion = { file = "VERSION" }\n' in text, package
    assert VERSION.count(".") == 2, VERSION
