"""The logging rank's optional sinks: TensorBoard and wandb (offline) read back with the logged
values, a missing package as one clear message, and the dashboard sink's pieces (run id,
relaunch command, checkpoint message, replay limited to this launch's records)."""

from __future__ import annotations

import glob
import io
import json
import math
import socket
import struct
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from nanotron_train.reporting.dashboard_sink import (
    DashboardClient,
    checkpoint_message,
    launch_command,
    new_run_id,
    resumed_from,
)
from nanotron_train.reporting.metrics import MetricsLogger, MetricsSinkError, RunInfo
from nanotron_train.reporting.record import StepMeasure, make_record


def records(n: int = 3) -> list[dict]:
    """Real records (make_record), with a loss that is not float32-exact on purpose; step 2
    evaluated (val_loss, val_ppl as the trainer merges them)."""
    out = []
    for s in range(1, n + 1):
        m = StepMeasure(s, 128 * s, 8.0 / s + 1e-9 * s, 0.5 + 0.1 * s, 1e-3 * s, 0.25, 128)
        out.append(make_record(m, 2, 1e6, None, 1 << 20, 4))  # mfu None: not numeric
    if n >= 2:
        out[1].update(val_loss=4.5 + 1e-9, val_ppl=math.exp(4.5 + 1e-9))
    return out


def test_tensorboard_scalars_read_back(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logger = MetricsLogger(None, tensorboard_dir=str(tmp_path / "tb"), stream=io.StringIO())
    recs = records()
    for rec in recs:
        logger.log(rec)
    logger.close()
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"lm_loss", "grad_norm", "lr", "tokens_per_sec", "consumed_tokens", "memory"} <= tags
    assert "mfu" not in tags and "step" not in tags
    for tag in ("lm_loss", "grad_norm", "lr"):
        events = acc.Scalars(tag)
        assert [e.step for e in events] == [1, 2, 3]
        # TensorBoard's scalar summaries are float32
        assert [e.value for e in events] == [float(np.float32(r[tag])) for r in recs]
    for tag in ("val_loss", "val_ppl"):
        assert [(e.step, e.value) for e in acc.Scalars(tag)] == [(2, np.float32(recs[1][tag]))]


def _wandb_records(path: Path):
    """Decode a .wandb file: a W&B header, then LevelDB-log records of protobuf `Record`s."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    block, pos, pending = 32768, 7, b""
    while pos + 7 <= len(data):
        room = block - pos % block
        if room < 7:  # a block's tail too short for a header is padding
            pos += room
            continue
        length, kind = struct.unpack("<HB", data[pos + 4 : pos + 7])
        chunk = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind == 0 and length == 0:
            continue
        pending += chunk
        if kind in (1, 4):  # FULL or LAST
            rec = pb.Record()
            rec.ParseFromString(pending)
            pending = b""
            yield rec


def test_wandb_offline_records_the_run(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    recs = records()
    logger = MetricsLogger(
        None,
        wandb_project="sinks-test",
        wandb_entity="my-team",  # general.entity
        run_name="tiny",
        config={"tokens": {"train_steps": 3}},
        stream=io.StringIO(),
    )
    for rec in recs:
        logger.log(rec)
    logger.close()
    files = glob.glob(str(tmp_path / "wandb" / "offline-run-*" / "run-*.wandb"))
    assert len(files) == 1
    # wandb's service process writes the file behind finish(): wait for its exit record
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        recs_read = list(_wandb_records(Path(files[0])))
        if any(r.WhichOneof("record_type") == "exit" for r in recs_read):
            break
        time.sleep(0.1)
    history: dict[int, dict] = {}
    config: dict = {}
    for rec in recs_read:
        kind = rec.WhichOneof("record_type")
        if kind == "history":
            items = {i.key or ".".join(i.nested_key): i.value_json for i in rec.history.item}
            row = history.setdefault(rec.history.step.num, {})
            row.update({k: json.loads(v) for k, v in items.items()})
        elif kind == "run":
            assert rec.run.project == "sinks-test" and rec.run.display_name == "tiny"
            assert rec.run.entity == "my-team"
            config.update({i.key: json.loads(i.value_json) for i in rec.run.config.update})
        elif kind == "config":  # config may also come as its own record
            config.update({i.key: json.loads(i.value_json) for i in rec.config.update})
    assert config.get("tokens") == {"train_steps": 3}, config
    assert sorted(history) == [1, 2, 3], history
    for step, r in zip(sorted(history), recs):
        h = history[step]
        assert h["lm_loss"] == r["lm_loss"] and h["lr"] == r["lr"]  # full precision
        assert "mfu" not in h
        assert h.get("val_loss") == r.get("val_loss") and h.get("val_ppl") == r.get("val_ppl")


@pytest.mark.parametrize(
    ("key", "module", "extra"),
    [
        ("tensorboard_dir", "torch.utils.tensorboard", "tensorboard"),
        ("wandb_project", "wandb", "wandb"),
    ],
)
def test_missing_sink_package_is_one_clear_message(tmp_path, monkeypatch, key, module, extra):
    monkeypatch.setitem(sys.modules, module, None)  # `import` now raises ImportError
    kwargs = {key: str(tmp_path / "x")}
    with pytest.raises(MetricsSinkError) as err:
        MetricsLogger(None, **kwargs)
    msg = str(err.value)
    assert f"logging.{key}" in msg and f"nanotron-train[{extra}]" in msg
    assert isinstance(err.value, ValueError)  # the entry point prints it as one line, exit 2


def test_missing_sink_package_at_the_command_line(tmp_path, monkeypatch, capsys):
    from nanotron_train.__main__ import main
    from tests.train.test_cli import small_config, write

    monkeypatch.setitem(sys.modules, "tensorboard", None)
    data = small_config(tmp_path)
    data["logging"]["tensorboard_dir"] = str(tmp_path / "tb")
    code = main(["--config-file", str(write(tmp_path, data))])
    err = capsys.readouterr().err
    assert code == 2
    assert err.count("\n") == 1 and "logging.tensorboard_dir" in err and "Traceback" not in err


def test_run_id_is_fresh_and_readable():
    a, b = new_run_id("my proj", "run/1"), new_run_id("my proj", "run/1")
    assert a != b
    assert a.startswith("my_proj-run_1-") and all(c.isalnum() or c in "-_." for c in a)


def test_launch_command_rebuilds_torchrun():
    main_py = "/x/site-packages/nanotron_train/__main__.py"
    argv = [main_py, "--config-file", "c.yaml", "--override", "tokens.train_steps=5"]
    env = {
        "LOCAL_WORLD_SIZE": "4",
        "WORLD_SIZE": "4",
        "GROUP_WORLD_SIZE": "1",
        "TORCHELASTIC_RUN_ID": "x",
    }
    cmd = launch_command(argv, env)
    assert (
        cmd
        == [
            sys.executable,
            "-m",
            "nanotron_train.launch",  # the launcher's form: one-line errors, preemption exits 0
            "--standalone",
            "--nproc_per_node=4",
            *argv[1:],
        ]
    )
    env2 = {
        **env,
        "GROUP_WORLD_SIZE": "2",
        "WORLD_SIZE": "8",
        "MASTER_ADDR": "n0",
        "MASTER_PORT": "29400",
    }
    cmd2 = launch_command(argv, env2)
    assert (
        "--nnodes=2" in cmd2 and "--rdzv-endpoint=n0:29400" in cmd2 and "--standalone" not in cmd2
    )
    assert launch_command(argv, {}) == [sys.executable, "-m", "nanotron_train", *argv[1:]]
    assert launch_command(["/usr/bin/pytest", "-k", "x"], env) == []  # a library call


def test_checkpoint_message_and_resumed_from(tmp_path):
    folder = tmp_path / "ck" / "20"
    folder.mkdir(parents=True)
    meta = {
        "step": 20,
        "consumed_tokens": 2560,
        "consumed_samples": 40,
        "topology": {"dp": 2, "tp": 1, "pp": 2, "zero_stage": 1},
        "created": 1700000000.5,
        "files": [{"path": "a", "size": 100}, {"path": "b", "size": 23}],
        "run_id": "proj-run-1",
    }
    (folder / "checkpoint_metadata.json").write_text(json.dumps(meta))
    (tmp_path / "ck" / "latest.txt").write_text("20\n")
    msg = checkpoint_message(folder)
    assert msg == {
        "path": str(folder),
        "complete": True,
        "step": 20,
        "consumed_tokens": 2560,
        "consumed_samples": 40,
        "topology": meta["topology"],
        "size": 123,
        "created": 1700000000.5,
    }
    assert checkpoint_message({"step": 1, "path": "p"}) == {"step": 1, "path": "p"}
    got = resumed_from("latest", str(tmp_path / "ck"), 20)
    assert got["run_id"] == "proj-run-1" and got["step"] == 20 and got["path"].endswith("ck/20")
    assert resumed_from(None, str(tmp_path / "ck"), None) is None


def test_replay_covers_only_this_launch(tmp_path, monkeypatch):
    """An appended metrics file holds an earlier run's steps: they are not this run's points."""
    monkeypatch.delenv("NANOTRON_DASHBOARD_URL", raising=False)
    path = tmp_path / "metrics.jsonl"
    old = [{"step": s, "lm_loss": 9.0} for s in (1, 2, 3)]
    path.write_text("".join(json.dumps(r) + "\n" for r in old))
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    run = RunInfo("p", "n", {}, 1, {"dp": 1, "tp": 1, "pp": 1})
    logger = MetricsLogger(
        str(path), dashboard_url=f"http://127.0.0.1:{port}", run=run, stream=io.StringIO()
    )
    client = logger._dashboard
    assert isinstance(client, DashboardClient) and client.start_offset == path.stat().st_size
    new = records(2)
    for rec in new:
        logger.log(rec)
    replay = client._records_after(-1)
    logger.close()
    assert [r["step"] for r in replay] == [1, 2]
    assert [r["lm_loss"] for r in replay] == [r["lm_loss"] for r in new]


def test_logger_without_dashboard_sends_nothing(monkeypatch, tmp_path):
    monkeypatch.delenv("NANOTRON_DASHBOARD_URL", raising=False)
    run = RunInfo("p", "n", {}, 1, {"dp": 1, "tp": 1, "pp": 1})
    logger = MetricsLogger(str(tmp_path / "m.jsonl"), run=run, stream=io.StringIO())
    assert logger._dashboard is None
    logger.log(records(1)[0])
    logger.checkpoint({"step": 1, "path": "x"})
    logger.close()
    lines = (tmp_path / "m.jsonl").read_text().splitlines()
    assert json.loads(lines[0])["lm_loss"] == records(1)[0]["lm_loss"]


class RecordingClient:
    """Stands in for the dashboard client: records what the logger sends."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.side: list[tuple] = []  # the planner's prediction and telemetry, not checked here

    def run_start(self, **kwargs) -> None:
        self.calls.append(("run_start", kwargs))

    def metrics(self, step: int, values: dict) -> None:
        self.calls.append(("metrics", step, values["lm_loss"]))

    def checkpoint(self, info: dict) -> None:
        self.calls.append(("checkpoint", info))

    def prediction(self, msg: dict) -> None:
        self.side.append(("prediction", msg))

    def telemetry(self, msg: dict) -> None:
        self.side.append(("telemetry", msg))

    def run_end(self, status: str, error: str | None = None) -> None:
        self.calls.append(("run_end", status, error))

    def close(self, timeout: float = 5.0) -> None:
        self.calls.append(("close",))


def test_failing_training_reports_run_end_failed(tmp_path, monkeypatch):
    from nanotron_train.config import load_config
    from nanotron_train.trainer import Trainer, train
    from tests.train.test_cli import small_config, write

    fake = RecordingClient()
    monkeypatch.setattr("nanotron_train.reporting.metrics.client_from_config", lambda *a, **k: fake)
    real_step = Trainer.train_step

    def failing_step(self):
        if self.state.step == 2:
            raise RuntimeError("boom at step 3")
        return real_step(self)

    monkeypatch.setattr(Trainer, "train_step", failing_step)
    cfg = load_config(str(write(tmp_path, small_config(tmp_path))), [], world_size=1)
    with pytest.raises(RuntimeError, match="boom"):
        train(cfg, stream=io.StringIO())
    kinds = [c[0] for c in fake.calls]
    assert kinds == ["run_start", "metrics", "metrics", "run_end", "close"]
    assert [kind for kind, _ in fake.side][:1] == ["prediction"]  # sent once, at the start
    start = fake.calls[0][1]
    assert start["world_size"] == 1 and start["topology"] == {"dp": 1, "tp": 1, "pp": 1}
    assert start["config"]["tokens"]["train_steps"] == 3 and start["resumed_from"] is None
    assert start["command"] == []  # a library call has no command line to record
    logged = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [c[2] for c in fake.calls[1:3]] == [r["lm_loss"] for r in logged]
    _, status, error = fake.calls[3]
    assert status == "failed" and "RuntimeError: boom at step 3" in error


def test_each_file_record_names_its_run_and_attempt(tmp_path, monkeypatch):
    """A resumed launch appends to the same file: run id and attempt tell its lines apart, and
    the dashboard's replay of that launch reads only the numbers."""
    fake = RecordingClient()
    monkeypatch.setattr("nanotron_train.reporting.metrics.client_from_config", lambda *a, **k: fake)
    path = tmp_path / "metrics.jsonl"
    run = RunInfo("p", "n", {}, 1, {"dp": 1, "tp": 1, "pp": 1})
    first = MetricsLogger(str(path), run=run, stream=io.StringIO())
    for rec in records(2):
        first.log(rec)
    first.close()
    again = MetricsLogger(str(path), run=run, stream=io.StringIO(), run_id=first.run_id)
    offset = path.stat().st_size
    again.log(records(2)[1])  # step 2 again, after a rollback to a checkpoint
    again.close()
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(r["step"], r["run_id"], r["attempt"]) for r in lines] == [
        (1, first.run_id, first.attempt),
        (2, first.run_id, first.attempt),
        (2, first.run_id, again.attempt),
    ]
    assert len(first.attempt) == 16 and first.attempt != again.attempt
    starts = [c[1]["attempt"] for c in fake.calls if c[0] == "run_start"]
    assert starts == [first.attempt, again.attempt]  # the dashboard's attempt ids
    client = DashboardClient(
        "http://127.0.0.1:9", run_id="r", metrics_file=str(path), start_offset=offset
    )
    replay = client._records_after(-1)
    client.close(0.1)
    assert [sorted(r) for r in replay] == [sorted(k for k in records(2)[1] if k != "mfu")]
    assert replay[0]["lm_loss"] == records(2)[1]["lm_loss"]


@pytest.mark.parametrize(
    ("memory", "shown"),
    [(512, "512 B"), (15_833_497, "15.1 MiB"), (3 << 30, "3.00 GiB"), (1000 << 20, "1000 MiB")],
)
def test_sizes_in_binary_units_in_step_lines_and_checkpoint_listings(memory, shown):
    from nanotron_train.checkpoints.listing import CheckpointEntry, to_table
    from nanotron_train.reporting.step_line import format_line

    rec = {**records(1)[0], "memory": memory}
    assert format_line(rec, 10).endswith(f" | memory: {shown}")
    entry = CheckpointEntry(step=4, path="x/4", size=memory, complete=True)
    assert f" {shown:>10}  complete" in to_table([entry])
    topology = {"dp": 4, "cp": 1, "tp": 1, "pp": 1, "zero_stage": 1, "ep": 2}
    entry = CheckpointEntry(step=4, path="x/4", size=memory, complete=True, topology=topology)
    assert " 4,1,1,1,1,ep=2 " in to_table([entry])
