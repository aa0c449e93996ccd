"""A resume's parent: found without raising on hostile paths and without a scan over every
stored checkpoint (issue 44, findings 2 and 3), on both backends."""

from __future__ import annotations

import json
import os
import threading

from dashboard_helpers import JSON_HEADERS, LOCAL
from fastapi.testclient import TestClient

from nanotron_dashboard.app import Settings, create_app

RESOLVE_BOUND = 96  # lstat calls one run_start may make: twice paths.MAX_STEPS


def post(c, msg):
    r = c.post("/api/ingest", json=msg)
    assert r.status_code == 200, r.text
    return r.json()


def resume_start(c, run_id, target, cwd):
    cmd = ["python", "-m", "nanotron_train", "--resume", str(target)]
    return post(c, {"type": "run_start", "run_id": run_id, "command": cmd, "cwd": str(cwd)})


def test_a_symlink_loop_does_not_break_resumes(db_url, tmp_path):
    """A checkpoint message whose path is a symlink loop (any ingester may send one) does
    not make later resumes answer 500: they are stored with their command and linked to
    their parent; a resume of the loop itself links to nothing. A listed file that is a
    loop makes its checkpoint incomplete, not the listing a 500."""
    (tmp_path / "a").symlink_to(tmp_path / "b")
    (tmp_path / "b").symlink_to(tmp_path / "a")
    step = tmp_path / "ck" / "5"
    step.mkdir(parents=True)
    (step / "x").symlink_to("x")
    meta = {"step": 5, "files": [{"path": "x", "size": 1}]}
    (step / "checkpoint_metadata.json").write_text(json.dumps(meta))
    with TestClient(create_app(Settings(db=db_url)), base_url=LOCAL, headers=JSON_HEADERS) as c:
        post(c, {"type": "checkpoint", "run_id": "planted", "step": 1, "path": f"{tmp_path}/a/1"})
        start = {"type": "run_start", "run_id": "parent", "cwd": str(tmp_path)}
        post(c, {**start, "checkpoints_path": "ck"})
        post(c, {"type": "checkpoint", "run_id": "parent", "step": 5, "path": "ck/5"})
        for run_id, target, parent in (
            ("child", step, {"run_id": "parent", "step": 5}),
            ("looped", tmp_path / "a" / "1", None),
        ):
            resume_start(c, run_id, target, tmp_path)
            run = c.get(f"/api/runs/{run_id}").json()
            assert run["command"][-1] == str(target) and run["cwd"] == str(tmp_path)
            assert run["resumed_from"] == parent
        listed = c.get("/api/runs/parent/checkpoints")
        assert listed.status_code == 200 and listed.json()[0]["complete"] is False


def test_paths_that_cannot_be_resolved_are_not_found(tmp_path):
    """A loop, a path too long, one with a NUL, or deeper than MAX_STEPS existing
    components: None (not found), never an exception; a missing path stays as written."""
    from nanotron_dashboard.paths import MAX_STEPS, real_path

    assert 2 * MAX_STEPS == RESOLVE_BOUND
    (tmp_path / "loop").symlink_to("loop")
    deep = tmp_path.joinpath(*["d"] * (MAX_STEPS + 1))
    deep.mkdir(parents=True)
    for bad in (tmp_path / "loop" / "1", "/tmp/" + "x" * 5000, "/tmp/a\x00b", deep):
        assert real_path(str(bad)) is None
    assert real_path("/nowhere/" + "d/" * (MAX_STEPS + 1)) == "/nowhere" + "/d" * (MAX_STEPS + 1)
    assert real_path("rel/../x", "/base") == "/base/x"


class LstatCount:
    """Counts os.lstat calls (every path resolution makes them, ours and os.path.realpath's)."""

    def __init__(self, monkeypatch) -> None:
        self.n = 0
        self._lock = threading.Lock()
        real = os.lstat

        def counting(*a, **k):
            with self._lock:
                self.n += 1
            return real(*a, **k)

        monkeypatch.setattr(os, "lstat", counting)

    def take(self) -> int:
        n, self.n = self.n, 0
        return n


def test_resume_resolution_is_bounded_whatever_is_stored(db_url, tmp_path, monkeypatch):
    """With N stored checkpoints with long, deep paths, a run_start with --resume resolves
    a bounded number of paths (counted as lstat calls, not timed) and still finds its
    parent, stored or only on disk; storing a checkpoint resolves its path once."""
    n = 300
    deep = "/".join(["d"] * 200)  # ~400 bytes, 200 components, under a folder that exists
    cpaths = {f"r{i}": tmp_path / f"run{i}" for i in range(3)}
    for p in cpaths.values():
        p.mkdir()
    count = LstatCount(monkeypatch)
    with TestClient(create_app(Settings(db=db_url)), base_url=LOCAL, headers=JSON_HEADERS) as c:
        for run_id, p in cpaths.items():
            post(c, {"type": "run_start", "run_id": run_id, "checkpoints_path": str(p)})
        msgs = [
            {
                "type": "checkpoint",
                "run_id": f"r{i % 3}",
                "step": i,
                "path": f"{tmp_path}/{deep}/{i}",
            }
            for i in range(n)
        ]
        msgs.append({"type": "checkpoint", "run_id": "r1", "step": n, "path": f"{cpaths['r1']}/7"})
        count.take()
        r = c.post("/api/ingest", json=msgs)
        assert r.status_code == 200, r.text
        ingest = count.take()
        assert ingest <= 20 * (n + 1), ingest  # a few per message: the existing prefix only
        for run_id, target, parent in (
            ("stored", cpaths["r1"] / "7", {"run_id": "r1", "step": n}),
            ("on-disk", cpaths["r2"] / "99", {"run_id": "r2", "step": 99}),
            ("deep", f"{tmp_path}/{deep}/4", {"run_id": "r1", "step": 4}),
        ):
            resume_start(c, run_id, target, tmp_path)
            work = count.take()
            assert work <= RESOLVE_BOUND, (run_id, work)  # not one resolution per checkpoint
            assert c.get(f"/api/runs/{run_id}").json()["resumed_from"] == parent
