"""The dashboard as one more metrics sink of the logging rank.

What the dashboard needs to know about a launch, and nothing else: a fresh run id, the command
that relaunches it (rebuilt under torchrun: a worker's sys.argv is not the launcher's command),
the checkpoint it resumed from, and a client whose replay covers only this launch's records.
The client (`dashboard_client.py`) does the sending on its own thread; nothing here blocks.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from nanotron_train.reporting.dashboard_client import DashboardClient

CHECKPOINT_METADATA = "checkpoint_metadata.json"


def new_run_id(project: str, run: str | None) -> str:
    """`project-run-YYYYmmdd-HHMMSS-xxxxxx`: unique per launch, readable in the run list."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    base = "-".join(p for p in (project, run) if p)
    base = re.sub(r"[^A-Za-z0-9_.-]+", "_", base)[:120] or "run"
    return f"{base}-{stamp}-{secrets.token_hex(3)}"


def launch_command(
    argv: list[str] | None = None, env: Mapping[str, str] | None = None
) -> list[str]:
    """The command line that relaunches this training, runnable from the recorded cwd.

    `argv` is the worker's sys.argv. Only `python -m nanotron_train` launches are known: a
    library call (tests, notebooks) has no command to record and gets []. A torchrun launch,
    plain or through the launcher, is recorded in the launcher's form
    (`python -m nanotron_train.launch`): a user error is then one line and status 2, and a
    preemption exits 0.
    """
    argv = list(sys.argv if argv is None else argv)
    env = os.environ if env is None else env
    if not argv or not argv[0].replace("\\", "/").endswith("nanotron_train/__main__.py"):
        return []
    args = argv[1:]
    python = sys.executable or "python"
    if "LOCAL_WORLD_SIZE" not in env and "TORCHELASTIC_RUN_ID" not in env:
        return [python, "-m", "nanotron_train", *args]
    nproc = env.get("LOCAL_WORLD_SIZE") or env.get("WORLD_SIZE", "1")
    nnodes = int(env.get("GROUP_WORLD_SIZE") or 1)
    if nnodes <= 1:
        launcher = ["--standalone", f"--nproc_per_node={nproc}"]
    else:  # run the same command on every node
        endpoint = f"{env.get('MASTER_ADDR', 'localhost')}:{env.get('MASTER_PORT', '29500')}"
        launcher = [
            f"--nnodes={nnodes}",
            f"--nproc_per_node={nproc}",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={endpoint}",
        ]
    return [python, "-m", "nanotron_train.launch", *launcher, *args]


def resumed_from(
    resume_path: str | None, checkpoints_path: str | None, step: int | None
) -> dict[str, Any] | None:
    """{run_id (when the checkpoint names its run), step, path} of the checkpoint resumed from.

    Without a run id the dashboard links the runs through the checkpoint's path.
    """
    if not resume_path or step is None:
        return None
    info: dict[str, Any] = {"run_id": None, "step": int(step), "path": None}
    try:
        from nanotron_train.checkpoints.load import resolve_checkpoint

        folder = resolve_checkpoint(resume_path, checkpoints_path)
        info["path"] = str(folder)
        meta = json.loads((Path(folder) / CHECKPOINT_METADATA).read_text())
        run_id = meta.get("run_id")
        info["run_id"] = run_id if isinstance(run_id, str) and run_id else None
    except (OSError, ValueError, ImportError):
        pass  # the trainer already resumed from it; the link is a nicety
    return info


def checkpoint_message(info: Mapping[str, Any] | str | os.PathLike) -> dict[str, Any]:
    """A `checkpoint` message from a saved folder (its metadata) or from a ready dict."""
    if isinstance(info, Mapping):
        return dict(info)
    folder = Path(os.path.abspath(info))  # the resume command then works from any directory
    msg: dict[str, Any] = {"path": str(folder), "complete": False}
    try:
        meta = json.loads((folder / CHECKPOINT_METADATA).read_text())
    except (OSError, ValueError):
        msg["step"] = int(folder.name) if folder.name.isdigit() else 0
        return msg
    files = meta.get("files") or []
    msg.update(
        step=int(meta.get("step", 0)),
        consumed_tokens=meta.get("consumed_tokens"),
        consumed_samples=meta.get("consumed_samples"),
        topology=meta.get("topology") or {},
        size=sum(int(f.get("size") or 0) for f in files if isinstance(f, dict)),
        complete=True,  # save_checkpoint returns only sealed folders
        created=meta.get("created"),
    )
    return msg


def client_from_config(
    dashboard_url: str | None,
    *,
    run_id: str,
    token: str | None = None,
    metrics_file: str | None = None,
    **kwargs: Any,
) -> DashboardClient | None:
    """The client for `logging.dashboard_url`; NANOTRON_DASHBOARD_URL / _TOKEN override it.

    None when no URL is set. A malformed URL is one warning and no client: training goes on.
    """
    import logging

    url = os.environ.get("NANOTRON_DASHBOARD_URL") or dashboard_url
    token = os.environ.get("NANOTRON_DASHBOARD_TOKEN") or token
    if not url:
        return None
    try:
        return DashboardClient(url, run_id=run_id, token=token, metrics_file=metrics_file, **kwargs)
    except ValueError as e:  # a malformed URL: one warning, training goes on
        logging.getLogger("nanotron_train.dashboard").warning(
            "%s; not streaming to the dashboard", e
        )
        return None


def checkpoint_run_id(checkpoints_path: str | None) -> str | None:
    """The run id recorded in the latest checkpoint under `checkpoints_path` (or None)."""
    info = resumed_from("latest", checkpoints_path, 0) if checkpoints_path else None
    return info["run_id"] if info else None
