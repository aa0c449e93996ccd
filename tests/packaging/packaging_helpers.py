"""Building the four sdists and wheels and installing them into fresh virtual environments.

The venvs are made without pip (`python -m venv --without-pip`) and filled by this
interpreter's pip (`pip --python VENV`), with `-c constraints.txt` so torch resolves to the
pinned build; pip's cache is reused.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("parallel", "models", "train", "dashboard")


@dataclass(frozen=True)
class Built:
    package: str  # folder name under packages/
    sdist: Path
    wheel: Path


@dataclass(frozen=True)
class Venv:
    root: Path

    @property
    def python(self) -> Path:
        return self.root / "bin" / "python"

    def bin(self, name: str) -> Path:
        return self.root / "bin" / name

    def env(self) -> dict[str, str]:
        """The environment of a user who activated this venv, outside the repository."""
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
        env["PATH"] = f"{self.root / 'bin'}{os.pathsep}{env.get('PATH', '')}"
        env["VIRTUAL_ENV"] = str(self.root)
        return env

    def run(self, code: str, cwd: Path) -> str:
        proc = subprocess.run(
            [str(self.python), "-c", code], cwd=cwd, env=self.env(), capture_output=True,
            text=True, timeout=120,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-3000:]
        return proc.stdout


def run_checked(cmd: list[str], what: str, timeout: float = 600) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    assert proc.returncode == 0, f"{what} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"


def tracked_files(folder: Path) -> list[str]:
    """Paths (relative to `folder`) of the files git tracks there: what a clean clone has."""
    proc = subprocess.run(
        ["git", "ls-files", "-z", "--", "."], cwd=folder, capture_output=True, text=True
    )
    assert proc.returncode == 0, f"these tests need a git checkout: {proc.stderr}"
    return [p for p in proc.stdout.split("\0") if p]


def clean_copy(dest: Path) -> Path:
    """The tracked files of LICENSE, VERSION and packages/ (as they are in the working tree,
    links kept): what a clean clone holds, without the editable install's egg-info, caches or
    untracked files, which setuptools would otherwise pack too."""
    for rel in tracked_files(ROOT):
        if rel in ("LICENSE", "VERSION") or rel.startswith("packages/"):
            src, dst = ROOT / rel, dest / rel
            if src.is_symlink() or src.exists():
                dst.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(src, dst, follow_symlinks=False)
    return dest


def build_all(out: Path) -> dict[str, Built]:
    """`python -m build` (the sdist, then the wheel from that sdist) for each package, from a
    clean copy of the tree."""
    tree = clean_copy(out / "tree")
    result = {}
    for package in PACKAGES:
        dest = out / package
        # --no-isolation: the dev environment has the backend (setuptools, pinned in
        # constraints.txt); `make setup` exercises the isolated build of every package.
        run_checked(
            [sys.executable, "-m", "build", "--no-isolation", "--outdir", str(dest),
             str(tree / "packages" / package)],
            f"python -m build packages/{package}",
        )  # fmt: skip
        (sdist,) = dest.glob("*.tar.gz")
        (wheel,) = dest.glob("*.whl")
        result[package] = Built(package, sdist, wheel)
    return result


def make_venv(root: Path, wheels: list[Path]) -> Venv:
    run_checked([sys.executable, "-m", "venv", "--without-pip", str(root)], f"venv {root}")
    venv = Venv(root)
    run_checked(
        # --no-compile: byte-compiling torch's 20k files would double the install time
        [sys.executable, "-m", "pip", "--python", str(venv.python), "install", "--quiet",
         "--no-compile", "--disable-pip-version-check", "-c", str(ROOT / "constraints.txt"),
         *map(str, wheels)],
        f"pip install {' '.join(w.name for w in wheels)} into a fresh venv",
    )  # fmt: skip
    return venv


TINY_CONFIG = ROOT / "configs" / "tiny-llama-cpu.yaml"
STEPS = 3


def tiny_overrides(metrics: Path) -> list[str]:
    """3 steps, metrics to `metrics`, no checkpoint."""
    return [
        "--override", f"tokens.train_steps={STEPS}",
        "--override", f"logging.metrics_file={metrics}",
        "--override", "checkpoints.checkpoints_path=null",
    ]  # fmt: skip


def read_metrics(path: Path) -> list[dict]:
    assert path.is_file(), f"no metrics file at {path}"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def train_tiny(venv: Venv, workdir: Path) -> list[dict]:
    """`python -m nanotron_train` on the tiny config, run from `workdir` in `venv`."""
    metrics = workdir / "metrics.jsonl"
    cmd = [str(venv.python), "-m", "nanotron_train", "--config-file", str(TINY_CONFIG),
           *tiny_overrides(metrics)]  # fmt: skip
    proc = subprocess.run(
        cmd, cwd=workdir, env=venv.env(), capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, f"training failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    return read_metrics(metrics)
