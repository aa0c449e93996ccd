"""The committed uPlot build is the one package-lock.json pins.

The lockfile pins uPlot's npm tarball by its sha512 ("integrity"). This fetches that tarball
with npm (its cache, or the registry), checks the hash, and compares the files we commit in
the dashboard's static/vendor with the tarball's, byte for byte.
"""

from __future__ import annotations

import base64
import hashlib
import json
import shutil
import subprocess
import tarfile
from pathlib import Path

from tests.packaging.packaging_helpers import ROOT

DASHBOARD = ROOT / "packages" / "dashboard"
VENDOR = DASHBOARD / "src" / "nanotron_dashboard" / "static" / "vendor"
# committed file -> its path inside the npm tarball
FILES = {
    "uPlot.iife.min.js": "package/dist/uPlot.iife.min.js",
    "uPlot.min.css": "package/dist/uPlot.min.css",
    "uPlot.LICENSE": "package/LICENSE",
}


def locked_uplot() -> tuple[str, str]:
    lock = json.loads((DASHBOARD / "frontend" / "package-lock.json").read_text())
    entry = lock["packages"]["node_modules/uplot"]
    return entry["version"], entry["integrity"]


def test_committed_uplot_matches_the_lockfile_integrity_hash(tmp_path: Path):
    npm = shutil.which("npm")
    assert npm, "npm is missing: `make test` installs it (Debian package npm)"
    version, integrity = locked_uplot()
    algorithm, _, expected = integrity.partition("-")
    assert algorithm == "sha512", integrity
    proc = subprocess.run(
        [npm, "pack", f"uplot@{version}", "--pack-destination", str(tmp_path), "--silent"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, f"npm pack uplot@{version} failed: {proc.stderr[-2000:]}"
    tarball = tmp_path / f"uplot-{version}.tgz"
    digest = base64.b64encode(hashlib.sha512(tarball.read_bytes()).digest()).decode()
    assert digest == expected, "the npm tarball does not match package-lock.json's integrity"
    with tarfile.open(tarball) as t:
        for committed, inside in FILES.items():
            assert (VENDOR / committed).read_bytes() == t.extractfile(inside).read(), (
                f"static/vendor/{committed} is not uPlot {version}'s {inside}: "
                "run packages/dashboard/build_assets.sh and commit the result"
            )
    assert sorted(p.name for p in VENDOR.iterdir()) == sorted(FILES)
