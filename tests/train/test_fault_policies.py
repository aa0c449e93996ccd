"""Fault tolerance in one process: non-finite policies, loss spikes, save failures on a full
disk (a real tiny tmpfs), asynchronous checkpoints, the data-cache builder's failure."""

from __future__ import annotations

import io
import json
import math
import shutil
import subprocess
import threading
import time
from pathlib import Path

import pytest
import torch
import yaml

from nanotron_parallel.context import ParallelContext
from nanotron_parallel.testing import shared_default_group
from nanotron_train.checkpoints.files import read_verified
from nanotron_train.config import config_from_dict
from nanotron_train.fault.errors import TrainingStopped
from nanotron_train.fault.spikes import LossSpikeDetector
from nanotron_train.trainer import Trainer
from tests.train.test_checkpoint import tiny_config
from tests.train.test_data_tokenize import make_tokenizer

ONE = {"dp": 1, "tp": 1, "pp": 1}


def config(ckpt: Path | None, steps: int, interval: int = 2, **sections) -> dict:
    raw = tiny_config(ONE, str(ckpt) if ckpt else None, steps=steps)
    raw["checkpoints"]["checkpoint_interval"] = interval
    for section, values in sections.items():
        raw.setdefault(section, {}).update(values)
    return raw


class Injector:
    """Scales the loss of chosen data steps (NaN, or a spike) and notes, for each forward,
    the data step and a checksum of the weights it ran with."""

    def __init__(self, trainer: Trainer, factors: dict[int, float]) -> None:
        self.factors, self.seen = factors, []
        self.model = trainer.state.model
        data = trainer.state.data
        original = data.micro_batches

        def micro_batches(data_step):
            self.current = data_step
            return original(data_step)

        data.micro_batches = micro_batches
        self.model.register_forward_hook(self._hook)

    def _hook(self, module, args, out):
        weights = sum(float(p.detach().double().sum()) for p in self.model.parameters())
        self.seen.append((self.current, weights))
        return out * self.factors.get(self.current, 1.0)


def train(raw: dict, factors: dict[int, float] | None = None, made: list | None = None):
    """Train in this process; returns (records, injector, trainer); `made` gets the trainer
    even when training raises."""
    cfg = config_from_dict(raw, "test")
    with shared_default_group():
        pc = ParallelContext(1, 1, 1)
        try:
            trainer = Trainer(cfg, pc, stream=io.StringIO())
            if made is not None:
                made.append(trainer)
            injector = Injector(trainer, factors or {})
            records: list[dict] = []
            trainer.train(on_record=records.append)
            return records, injector, trainer
        finally:
            pc.destroy()


def by_step(seen):
    """Weights checksum at the first forward of each data step (one forward per micro-batch)."""
    out = {}
    for step, weights in seen:
        out.setdefault(step, weights)
    return out


def test_nonfinite_stop_names_the_step_and_first_parameter(capsys):
    raw = config(None, 6, fault_tolerance={"nonfinite_policy": "stop"})
    made: list[Trainer] = []
    with pytest.raises(TrainingStopped) as err:
        train(raw, {3: math.nan}, made)
    text = str(err.value)
    assert text.startswith("non-finite values at step 3: lm_loss=nan, grad_norm=nan;"), text
    name = text.split("first parameter with a non-finite gradient: ")[1]
    first = next(iter(made[0].state.model.named_parameters()))[0]
    assert name == f"{first} (rank 0) (fault_tolerance.nonfinite_policy: stop)", text
    assert made[0].state.step == 2  # the non-finite step was not applied


def test_nonfinite_skip_keeps_weights_and_counts_and_spikes_are_flagged():
    raw = config(None, 12, fault_tolerance={"nonfinite_policy": "skip", "loss_spike_window": 8})
    records, inj, _ = train(raw, {3: math.nan, 4: math.inf, 12: 30.0})
    assert [r["step"] for r in records] == list(range(1, 13))
    assert [r.get("nonfinite") for r in records[2:4]] == ["skip", "skip"]
    assert [r.get("skipped_steps") for r in records] == [None, None, 1, 2] + [2] * 8
    weights = by_step(inj.seen)
    assert weights[3] == weights[4] == weights[5] != weights[2]  # no update at steps 3 and 4
    assert weights[6] != weights[5]  # training resumed
    spikes = [r["step"] for r in records if "loss_spike_z" in r]
    assert spikes == [12] and records[11]["loss_spike_z"] > 6.0


def test_nonfinite_rollback_reloads_last_checkpoint_and_skips_the_data(tmp_path):
    ck = tmp_path / "ck"
    raw = config(ck, 6, fault_tolerance={"nonfinite_policy": "rollback"})
    records, inj, trainer = train(raw, {5: math.nan})
    data_steps = [s for s, _ in inj.seen]
    # steps 1-4 fine, 5 non-finite -> back to step 4; steps 5, 6 take data steps 6, 7
    assert list(dict.fromkeys(data_steps)) == [1, 2, 3, 4, 5, 6, 7]
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 5, 6]
    assert records[4]["nonfinite"] == "rollback"
    weights = by_step(inj.seen)
    assert weights[6] == weights[5]  # the rolled-back step 5 starts from checkpoint 4's weights
    assert trainer.state.data_step_offset == 1
    state = json.loads((ck / "6" / "data_state.json").read_text())
    assert state["data_step_offset"] == 1 and (ck / "latest.txt").read_text().strip() == "6"

    # Non-finite whatever the data: three rollbacks to step 4, then a stop.
    raw = config(tmp_path / "ck2", 6, fault_tolerance={"nonfinite_policy": "rollback"})
    with pytest.raises(
        TrainingStopped, match="again after 3 rollbacks to the checkpoint of step 4"
    ):
        train(raw, {s: math.nan for s in range(5, 20)})


def test_loss_spike_detector_uses_a_robust_window():
    det = LossSpikeDetector(window=10, threshold=6.0)
    losses = [3.0 + 0.01 * ((i * 7) % 5) for i in range(12)]
    assert [det.observe(x) for x in losses] == [None] * 12
    assert det.observe(3.5) > 6.0  # far outside the window's spread
    assert det.observe(3.02) is None  # the spike barely moves a median-based window
    assert det.observe(math.nan) is None


@pytest.fixture
def tiny_disk(tmp_path):
    disk = tmp_path / "disk"
    disk.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=480k", "tmpfs", str(disk)], check=True)
    yield disk
    subprocess.run(["umount", str(disk)], check=True)


def verify_complete(folder: Path) -> None:
    meta = json.loads((folder / "checkpoint_metadata.json").read_text())
    for rec in meta["files"]:
        read_verified(folder / rec["path"], rec)  # size and sha256


def test_disk_full_during_a_save_keeps_the_previous_checkpoint(tiny_disk, capsys):
    from nanotron_train.__main__ import main

    ck = tiny_disk / "ck"  # room for one checkpoint (~320 kB), not two
    for policy, steps in (("stop", 6), ("continue", 6)):
        shutil.rmtree(ck, ignore_errors=True)
        raw = config(ck, steps, checkpoints={"on_save_error": policy})
        cfg = tiny_disk.parent / f"{policy}.yaml"
        cfg.write_text(yaml.safe_dump(raw))
        code = main(["--config-file", str(cfg)])
        err = capsys.readouterr().err
        assert (ck / "latest.txt").read_text().strip() == "2", policy
        verify_complete(ck / "2")
        assert sorted(p.name for p in ck.iterdir()) == ["2", "latest.txt"], policy
        line = f"checkpoint of step 4 not saved: {ck}/.tmp-4: writing the checkpoint failed"
        assert line in err and "No space left on device" in err, err
        assert f"{ck}/2 stays latest" in err
        if policy == "stop":
            assert code == 1 and err.count("\n") == 1 and err.startswith("error: "), err
        else:
            assert code == 0 and "checkpoint of step 6 not saved" in err, err


def checkpoint_hashes(folder: Path) -> dict[str, str]:
    meta = json.loads((folder / "checkpoint_metadata.json").read_text())
    return {f["path"]: f["sha256"] for f in meta["files"] if f["path"] != "config.yaml"}


def test_async_save_writes_the_same_bytes_as_a_sync_save(tmp_path):
    sync, _, _ = train(config(tmp_path / "sync", 4, interval=1))
    asyn, _, _ = train(config(tmp_path / "async", 4, interval=1, checkpoints={"async_save": True}))
    assert [r["lm_loss"] for r in asyn] == [r["lm_loss"] for r in sync]
    for step in (1, 2, 3, 4):
        assert checkpoint_hashes(tmp_path / "async" / str(step)) == checkpoint_hashes(
            tmp_path / "sync" / str(step)
        )
    assert (tmp_path / "async" / "latest.txt").read_text().strip() == "4"


def test_data_cache_builder_failure_reaches_the_waiting_rank_at_once(tmp_path):
    import torch.distributed as dist

    from nanotron_train.data.cache import cached_nanoset
    from nanotron_train.data.errors import DataError
    from nanotron_train.data.source import BuilderBarrier

    tok_dir = make_tokenizer(tmp_path / "tokenizer", vocab_size=300)
    bad = tmp_path / "raw.jsonl"
    bad.write_text('{"text": "fine"}\n{"body": "no text column"}\n')
    store = dist.HashStore()
    outcome: dict = {}

    def waiter():
        t0 = time.monotonic()
        try:
            cached_nanoset(str(bad), tokenizer_path=str(tok_dir), cache_dir=tmp_path / "c",
                           is_builder=False, barrier=BuilderBarrier(False, store))  # fmt: skip
        except DataError as exc:
            outcome["error"], outcome["after"] = str(exc), time.monotonic() - t0

    thread = threading.Thread(target=waiter)
    thread.start()
    time.sleep(0.5)  # the waiter is waiting
    with pytest.raises(DataError) as built:
        cached_nanoset(str(bad), tokenizer_path=str(tok_dir), cache_dir=tmp_path / "c",
                       is_builder=True, barrier=BuilderBarrier(True, store))  # fmt: skip
    thread.join(timeout=10)
    assert outcome["error"].startswith("the rank building the data cache ")
    assert outcome["error"].endswith(f"failed: {built.value}"), outcome["error"]
    assert torch.tensor(outcome["after"]).item() < 10


def test_sigusr1_finishes_the_step_saves_and_resume_auto_continues_bitwise(tmp_path, capsys):
    import signal

    full, _, _ = train(config(tmp_path / "full", 6, interval=10))
    ck = tmp_path / "ck"

    class Usr1(Injector):
        def _hook(self, module, args, out):
            if self.current == 3:
                signal.raise_signal(signal.SIGUSR1)  # as SLURM sends before its time limit
            return out

    cfg = config_from_dict(config(ck, 6, interval=10), "test")
    with shared_default_group():
        pc = ParallelContext(1, 1, 1)
        try:
            trainer = Trainer(cfg, pc, stream=io.StringIO())
            Usr1(trainer, {})
            cut: list[dict] = []
            trainer.train(on_record=cut.append)
        finally:
            pc.destroy()
    assert "SIGUSR1 received" in capsys.readouterr().err
    assert [r["step"] for r in cut] == [1, 2, 3]
    assert (ck / "latest.txt").read_text().strip() == "3"  # saved although not due
    resumed, _, _ = train(
        config(ck, 6, interval=10, checkpoints={"resume_checkpoint_path": "auto"})
    )
    assert [r["lm_loss"] for r in cut + resumed] == [r["lm_loss"] for r in full]
    assert signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL  # handlers restored


def test_async_save_killed_mid_write_keeps_the_previous_latest(tmp_path):
    import os
    import signal

    from tests.train.test_checkpoint_crash import _start

    ck = tmp_path / "ck"
    raw = config(ck, 6, checkpoints={"async_save": True})
    raw["logging"]["metrics_file"] = str(tmp_path / "metrics.jsonl")
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump(raw))
    proc = _start(cfg, {"NANOTRON_TEST_CKPT_SLOW_WRITE_S": "0.2"})
    shard = ck / ".tmp-4" / "model" / "pp0_tp0.safetensors"
    deadline = time.monotonic() + 120
    try:
        while not shard.exists():  # the background write of step 4 has begun
            assert proc.poll() is None, proc.communicate()[0]
            assert time.monotonic() < deadline, "the save window never came"
            time.sleep(0.02)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.communicate()
    assert (ck / "latest.txt").read_text().strip() == "2"
    assert not (ck / "4").exists() and (ck / ".tmp-4").is_dir()
    verify_complete(ck / "2")
    resumed = _start(cfg, {}, "--resume", "auto")
    out, _ = resumed.communicate(timeout=120)
    assert resumed.returncode == 0, out
    assert f"resumed from {ck / '2'} at step 2" in out and "removing unfinished" in out, out
    assert (ck / "latest.txt").read_text().strip() == "6" and not (ck / ".tmp-4").exists()
    logged: dict[int, list[float]] = {}
    for line in (tmp_path / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        logged.setdefault(rec["step"], []).append(rec["lm_loss"])
    assert sorted(logged) == [1, 2, 3, 4, 5, 6]
    assert all(len(set(v)) == 1 for v in logged.values()), logged  # re-run steps: same losses


class LookupLog:
    """A stand-in for the launcher's store that notes the step of each stop lookup."""

    def __init__(self, trainer: Trainer) -> None:
        self.trainer, self.steps = trainer, []

    def check(self, keys) -> bool:
        self.steps.append(self.trainer.state.step)
        return False


def test_no_stop_lookup_after_the_last_step():
    # The rank hosting the store may leave as soon as the last collective is done; a later
    # lookup on another rank failed the finished run ("the launcher's store does not answer").
    cfg = config_from_dict(config(None, 3, interval=10), "test")
    with shared_default_group():
        pc = ParallelContext(1, 1, 1)
        try:
            trainer = Trainer(cfg, pc, stream=io.StringIO())
            trainer.fault.preemption.store = log = LookupLog(trainer)
            trainer.train()
        finally:
            pc.destroy()
    assert trainer.state.step == 3 and log.steps == [1, 2]
