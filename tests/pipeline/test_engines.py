"""The pipeline engine registry: what each engine declares, and that callers go through it
(a schedule added to the table is run by name, and the trainer's estimates read its row)."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import get_args, get_type_hints

import pytest
import torch

from nanotron_parallel.pipeline import (
    ENGINES,
    PipelineScheduleError,
    PipelineStepResult,
    engine,
    run_forward_only,
    run_pipeline_step,
)


def test_the_config_offers_exactly_the_registered_engines() -> None:
    from nanotron_train.config.schema import ParallelismArgs

    offered = get_args(get_type_hints(ParallelismArgs)["pp_engine"])
    assert offered == tuple(ENGINES)


def test_each_engine_declares_chunks_in_flight_and_config_facts() -> None:
    rows = {
        name: (
            e.chunks(3),
            e.in_flight(8, 4),
            e.in_flight(3, 4),
            e.micro_batches_multiple_of_pp,
            e.gathers_in_stage_order,
            e.span_kinds,
        )
        for name, e in ENGINES.items()
    }
    assert rows == {
        "afab": (1, 8, 3, False, True, ("forward", "backward")),
        "1f1b": (1, 4, 3, False, True, ("forward", "backward")),
        "interleaved-1f1b": (3, 8, 3, True, False, ("forward", "backward")),
        "zb-h1": (1, 4, 3, False, True, ("forward", "backward", "W")),
        "zbv": (2, 4, 3, False, False, ("forward", "backward", "W")),
    }


def test_an_unknown_engine_names_the_config_key_and_the_choices() -> None:
    with pytest.raises(PipelineScheduleError) as err:
        engine("gpipe")
    assert str(err.value) == (
        "parallelism.pp_engine must be one of ['1f1b', 'afab', 'interleaved-1f1b', 'zb-h1', "
        "'zbv'], got 'gpipe'"
    )
    with pytest.raises(PipelineScheduleError, match="got 'gpipe'"):
        run_forward_only("gpipe", torch.nn.Identity(), [{}], None, [1.0])


def test_a_new_row_is_run_by_name_and_read_by_the_memory_estimate(monkeypatch) -> None:
    from nanotron_train.plan.memory import in_flight

    calls = []

    def train_step(stage, micro_batches, pc, **kwargs):
        calls.append(("train", len(micro_batches), sorted(kwargs)))
        return PipelineStepResult(torch.tensor(2.5, dtype=torch.float64))

    def forward_only(stage, micro_batches, pc, weights):
        calls.append(("eval", len(micro_batches), list(weights)))
        return torch.tensor(1.5, dtype=torch.float64)

    new = dataclasses.replace(
        ENGINES["1f1b"],
        name="zero-bubble",
        train_step=train_step,
        forward_only=forward_only,
        in_flight=lambda m, pp: m + pp,
    )
    monkeypatch.setitem(ENGINES, "zero-bubble", new)
    result = run_pipeline_step("zero-bubble", torch.nn.Identity(), [{}, {}], None)
    total = run_forward_only("zero-bubble", torch.nn.Identity(), [{}], None, [0.5])
    assert (result.loss, float(total)) == (2.5, 1.5)
    assert calls == [
        ("train", 2, ["on_last_backward", "recorder", "track_activations"]),
        ("eval", 1, [0.5]),
    ]
    cfg = SimpleNamespace(
        parallelism=SimpleNamespace(pp_engine="zero-bubble", pp=4),
        tokens=SimpleNamespace(batch_accumulation_per_replica=6),
    )
    assert in_flight(cfg) == 10


def test_each_engine_places_its_chunks_and_its_loss() -> None:
    """Virtual stage of (rank, chunk) at pp=2, and the rank holding the last one (the loss and
    a tied lm_head) at pp=4: zbv's V puts both ends on rank 0."""
    places = {n: [e.stage_of(r, c, 2) for r in (0, 1) for c in (0, 1)] for n, e in ENGINES.items()}
    assert places["interleaved-1f1b"] == [0, 2, 1, 3] and places["zbv"] == [0, 3, 1, 2]
    last = {n: e.last_stage_rank(4, e.chunks(2)) for n, e in ENGINES.items()}
    assert last == {"afab": 3, "1f1b": 3, "interleaved-1f1b": 3, "zb-h1": 3, "zbv": 0}


def test_zbv_needs_two_layers_per_rank(tmp_path) -> None:
    from nanotron_train.config import ConfigError, config_from_dict
    from tests.train.test_checkpoint import tiny_config

    raw = tiny_config({"dp": 1, "tp": 1, "pp": 2, "engine": "zbv"}, str(tmp_path))
    with pytest.raises(ConfigError) as err:
        config_from_dict(raw, "test", world_size=None)
    assert str(err.value).endswith(
        "parallelism.pp: 2 with pp_engine zbv: its 2 chunks per rank make 4 virtual stages, "
        "more than model.model_config.num_hidden_layers=2"
    )
    raw["model"]["model_config"]["num_hidden_layers"] = 4
    assert config_from_dict(raw, "test", world_size=None).parallelism.pp_engine == "zbv"
