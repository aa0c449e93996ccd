"""Loss-spike recovery (fault_tolerance.loss_spike_policy: rollback): a run whose data has a
poisoned stretch (batches whose loss the test's forward hook scales 30x, as
test_fault_policies.py does) goes back to an older checkpoint, skips exactly the configured
batches, and then trains bitwise as a run whose data never had them; resumes are bitwise; a
spike past max_spike_rollbacks stops the run. In one process and at world 2 (dp2, ZeRO-1)."""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path

import pytest
import torch

from nanotron_parallel.testing import run_distributed, shared_default_group
from tests.train.test_checkpoint import tiny_config

ONE = {"dp": 1, "tp": 1, "pp": 1}
DP2 = {"dp": 2, "tp": 1, "pp": 1, "zero": 1}
POISON = {12: 30.0, 13: 30.0, 14: 30.0}  # data batches 12-14 spike the loss
STEPS = 16
# spike at step 12 -> back to checkpoint 8 (<= 12 - 3); batches 9..12 not replayed, 13, 14 skipped
RECOVERY = {
    "loss_spike_window": 8,
    "loss_spike_policy": "rollback",
    "spike_rollback_min_steps": 3,
    "spike_skip_batches": 2,
    "max_spike_rollbacks": 1,
}
SKIPPED = list(range(9, 15))


def _config(layout: dict, ckpt: str, resume: str | None = None) -> dict:
    raw = tiny_config(layout, ckpt, steps=STEPS, resume=resume)
    raw["checkpoints"]["checkpoint_interval"] = 2
    raw["optimizer"]["learning_rate_scheduler"]["lr_decay_steps"] = STEPS
    raw["fault_tolerance"] = dict(RECOVERY)
    return raw


def _hook_data(trainer, poison: dict[int, float], drop: list[int], seen: list[int]) -> None:
    """Test-side hooks on a built trainer: the data step of each forward goes to `seen`, the
    loss of a `poison` step is scaled, and the reference run's stream leaves out the batches
    `drop` (drawn and discarded when the first of them is due)."""
    data, model = trainer.state.data, trainer.state.model
    original, current = data.micro_batches, [0]

    def micro_batches(step: int):
        if drop and step == drop[0]:
            for _ in drop:
                original(step)
        current[0] = step + (len(drop) if drop and step >= drop[0] else 0)  # stream position
        return original(step)

    data.micro_batches = micro_batches

    def hook(module, args, out):
        seen.append(current[0])
        return out * poison.get(current[0], 1.0)

    model.register_forward_hook(hook)


def spike_jobs(jobs: list[dict]) -> list[dict]:
    """On every rank: each job (layout, ckpt, resume, poison, drop, fault overrides); rank 0
    gets {loss: {step: [losses in order]}, records, seen data steps, stopped: message}."""
    import torch.distributed as dist

    from nanotron_parallel.context import ParallelContext
    from nanotron_train.config import config_from_dict
    from nanotron_train.fault.errors import TrainingStopped
    from nanotron_train.trainer import Trainer

    torch.set_num_threads(1)
    out = []
    with shared_default_group():
        for job in jobs:
            lay = job["layout"]
            raw = _config(lay, job["ckpt"], job.get("resume"))
            raw["fault_tolerance"].update(job.get("fault", {}))
            raw["logging"]["metrics_file"] = job.get("metrics")
            raw["checkpoints"]["async_save"] = job.get("async_save", False)
            cfg = config_from_dict(raw, "test", world_size=None)
            pc = ParallelContext(dp=lay["dp"], tp=lay["tp"], pp=lay["pp"])
            records: list[dict] = []
            seen: list[int] = []
            stopped = None
            try:
                trainer = Trainer(cfg, pc, stream=io.StringIO())
                _hook_data(trainer, job.get("poison", {}), job.get("drop", []), seen)
                trainer.train(on_record=records.append)
            except TrainingStopped as exc:
                stopped = str(exc)
            finally:
                dist.barrier()
                pc.destroy()
            out.append({"records": records, "seen": list(dict.fromkeys(seen)), "stopped": stopped})
    return out


def _losses(records: list[dict]) -> list[tuple[int, float]]:
    return [(r["step"], r["lm_loss"]) for r in records]


def _jobs(layout: dict, root: Path, tag: str) -> list[dict]:
    """Poisoned; the same with the skipped batches never in its stream; poisoned past K."""
    return [
        {
            "layout": layout,
            "ckpt": str(root / f"{tag}-spike"),
            "poison": POISON,
            "metrics": str(root / f"{tag}.jsonl"),
        },
        {"layout": layout, "ckpt": str(root / f"{tag}-clean"), "drop": SKIPPED},
        {"layout": layout, "ckpt": str(root / f"{tag}-again"), "poison": {**POISON, 20: 30.0}},
    ]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("spike")
    async_save = {"layout": ONE, "ckpt": str(root / "async"), "poison": POISON, "async_save": True}
    single = spike_jobs([*_jobs(ONE, root, "one"), async_save])
    world2 = run_distributed(spike_jobs, 2, _jobs(DP2, root, "dp2"), timeout=300)[0]
    return {"root": root, "one": single, "dp2": world2}


@pytest.mark.parametrize("tag", ["one", "dp2"])
def test_spike_rolls_back_skips_the_batches_and_matches_a_clean_stream(runs, tag):
    spike, clean, again = runs[tag][:3]
    records = spike["records"]
    assert [r["step"] for r in records] == [*range(1, 13), *range(9, STEPS + 1)]
    assert records[11]["loss_spike_z"] > 6.0
    assert records[11]["spike_rollback"] == {
        "number": 1, "spike_step": 12, "to_step": 8, "first_skipped": 9, "last_skipped": 14
    }  # fmt: skip
    # trained on batches 1-12 (12 is the spike), then, from step 9, on 15 onwards
    assert spike["seen"] == [*range(1, 13), *range(15, STEPS + 7)]
    assert clean["seen"] == [*range(1, 9), *range(15, STEPS + 7)]
    after = _losses(records[12:])
    assert after == _losses(clean["records"][8:])  # bitwise, steps 9-16
    assert _losses(records[:8]) == _losses(clean["records"][:8])
    assert spike["stopped"] is None and clean["stopped"] is None
    ck = runs["root"] / f"{tag}-spike"
    # the trajectory into the spike is set aside (step 12 itself is not saved); checkpoint 8
    # carries the skip
    assert sorted(p.name for p in (ck / "rolled_back" / "1-spike-12").iterdir()) == ["10"]
    state8 = json.loads((ck / "8" / "data_state.json").read_text())
    assert state8["data_step_offset"] == 6 and len(state8["spike_rollbacks"]) == 1
    assert (ck / "latest.txt").read_text().strip() == str(STEPS)
    # a second spike (batch 20, step 14) after max_spike_rollbacks=1: a stop, with why
    assert again["stopped"].startswith("loss spike at step 14 (lm_loss="), again["stopped"]
    assert (
        "after 1 spike rollbacks in this run (fault_tolerance.max_spike_rollbacks=1)"
        in (again["stopped"])
    )
    assert again["records"][-1]["step"] == 14 and "spike_rollback" not in again["records"][-1]
    if tag == "one":  # checkpoints written in the background: the same run
        assert _losses(runs[tag][3]["records"]) == _losses(records)


def test_spike_rollback_keys_are_checked():
    from nanotron_train.config import ConfigError, config_from_dict

    cases = {
        ("checkpoints", "checkpoints_path", None): "fault_tolerance.loss_spike_policy",
        ("fault_tolerance", "loss_spike_window", 0): "fault_tolerance.loss_spike_policy",
        ("fault_tolerance", "spike_skip_batches", -1): "fault_tolerance.spike_skip_batches",
        ("fault_tolerance", "max_spike_rollbacks", 0): "fault_tolerance.max_spike_rollbacks",
        ("fault_tolerance", "spike_rollback_min_steps", 0): (
            "fault_tolerance.spike_rollback_min_steps"
        ),
    }
    for (section, key, value), named in cases.items():
        raw = _config(ONE, "ck")
        raw[section][key] = value
        with pytest.raises(ConfigError) as err:
            config_from_dict(raw, "run.yaml")
        assert err.value.key == named, (key, str(err.value))


def test_rollback_is_in_the_metrics_file_and_a_dashboard_event(runs):
    from nanotron_dashboard.messages import parse_messages
    from nanotron_train.telemetry.events import EventReporter, ThroughputWatch, record_events

    lines = [json.loads(x) for x in (runs["root"] / "one.jsonl").read_text().splitlines()]
    flagged = [x for x in lines if "spike_rollback" in x]
    assert [x["step"] for x in flagged] == [12]
    assert flagged[0]["spike_rollback"]["last_skipped"] == 14
    assert [x["step"] for x in lines] == [*range(1, 13), *range(9, STEPS + 1)]

    class Sink:
        def event(self, kind, severity, message, step, details):
            self.msg = {"type": "event", "run_id": "r", "kind": kind, "severity": severity,
                        "message": message, "step": step, "details": details}  # fmt: skip

    sink = Sink()
    record_events(flagged[0], EventReporter(0, lambda: sink), ThroughputWatch(0.5))
    (event,) = parse_messages(json.dumps(sink.msg))  # the dashboard accepts it
    assert (event.kind, event.severity, event.step) == ("spike_rollback", "critical", 12)
    assert event.details == flagged[0]["spike_rollback"]
    assert event.message == (
        "rolling back to the checkpoint of step 8 (spike rollback 1); data batches 9..14 skipped"
    )


def test_resume_after_a_recovery_is_bitwise(runs, tmp_path):
    """From the checkpoint saved again at the rollback (a restart right after it) and from one
    after it: the same losses as the run that went on."""
    spike = runs["one"][0]
    ck = runs["root"] / "one-spike"
    restart = tmp_path / "restart"
    restart.mkdir()
    shutil.copytree(ck / "8", restart / "8")
    (restart / "latest.txt").write_text("8\n")
    later = tmp_path / "later"
    for step in ("8", "10", "12"):  # the run's own after the rollback (14 and 16 not: newer)
        shutil.copytree(ck / step, later / step)
    (later / "latest.txt").write_text("12\n")
    jobs = [
        {"layout": ONE, "ckpt": str(restart), "resume": "auto", "poison": POISON},
        {"layout": ONE, "ckpt": str(later), "resume": "latest", "poison": POISON},
    ]
    from_8, from_12 = spike_jobs(jobs)
    went_on = _losses(spike["records"])
    assert _losses(from_8["records"]) == went_on[12:]
    assert from_8["seen"] == list(range(15, STEPS + 7))  # the skip survives the restart
    assert _losses(from_12["records"]) == went_on[-4:]
