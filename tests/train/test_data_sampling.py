"""TrainData: dp independence, exact resume, blending shares, data stages, epochs, label mask."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest
import torch

from nanotron_train.data import DataError, DatasetSpec, Nanoset, StageSpec, TrainData
from nanotron_train.data.testing import make_id_nanoset

torch.set_num_threads(1)
SEQ = 8


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """Three Nanosets with disjoint id ranges: dataset d holds ids in [100d+1, 100d+100)."""
    root = tmp_path_factory.mktemp("nanosets")
    rng = np.random.default_rng(0)
    out = []
    for d, docs in enumerate((300, 200, 150)):
        lengths = rng.integers(3, 40, docs).tolist()
        out.append(
            str(make_id_nanoset(root / f"ds{d}", lengths, low=100 * d + 1, high=100 * d + 100,
                                vocab_size=400, seed=d))
        )  # fmt: skip
    small = make_id_nanoset(root / "small", [20, 21, 21], low=1, high=100)  # 7 samples of 9
    return out + [str(small)]


def make(stages, *, mbs=2, accum=2, dp=1, rank=0, vocab=400):
    return TrainData(
        stages,
        sequence_length=SEQ,
        micro_batch_size=mbs,
        batch_accumulation_per_replica=accum,
        dp_rank=rank,
        dp_size=dp,
        tokenizer_path=None,
        cache_dir="unused",
        model_vocab_size=vocab,
    )


def blend_stage(folders, weights=(0.5, 0.3, 0.2), seed=7):
    return [StageSpec("main", 1, DatasetSpec(folders[:3], list(weights)), seed)]


def source_of(ids: torch.Tensor) -> torch.Tensor:
    """The dataset each row came from (rows hold one dataset's ids besides EOS = 0)."""
    return (ids.max(dim=1).values - 1) // 100


def global_batch(datas, step):
    """Concatenate every dp rank's micro-batches of one step into the global batch."""
    rows = [mb["input_ids"] for d in datas for mb in d.micro_batches(step)]
    return torch.cat(rows)


def test_batch_shapes_and_shift(folders):
    data = make(blend_stage(folders), mbs=3, accum=2)
    mbs = data.micro_batches(1)
    assert len(mbs) == 2
    for mb in mbs:
        assert mb["input_ids"].shape == (3, SEQ) and mb["input_ids"].dtype == torch.int64
        assert mb["label_ids"].shape == (3, SEQ) and mb["label_mask"].dtype == torch.bool
        assert torch.equal(mb["input_ids"][:, 1:], mb["label_ids"][:, :-1])
        assert bool(mb["label_mask"].all())
    assert data.consumed_samples == 6


def test_global_batch_independent_of_dp(folders):
    stages = blend_stage(folders)
    dp1 = [make(stages, mbs=2, accum=4, dp=1)]
    dp2 = [make(stages, mbs=2, accum=2, dp=2, rank=r) for r in range(2)]
    dp4 = [make(stages, mbs=1, accum=2, dp=4, rank=r) for r in range(4)]
    for step in range(1, 31):
        ref = global_batch(dp1, step)
        assert ref.shape == (8, SEQ)
        assert torch.equal(ref, global_batch(dp2, step))
        assert torch.equal(ref, global_batch(dp4, step))
    assert dp2[1].consumed_samples == dp1[0].consumed_samples == 240


def test_resume_is_exact_even_across_dp_change(folders):
    stages = blend_stage(folders)
    ref = make(stages, mbs=2, accum=2)
    expected = [global_batch([ref], s) for s in range(1, 13)]
    first = make(stages, mbs=2, accum=2)
    for s in range(1, 6):
        first.micro_batches(s)
    state = json.loads(json.dumps(first.state_dict()))  # a checkpoint may store it as JSON
    assert state["consumed_samples"] == 20 and state["step"] == 5
    assert sum(state["dataset_consumed_samples"]) == 20
    for layout in ((2, 2, 1), (1, 2, 2)):  # (mbs, accum, dp): same global batch size
        mbs, accum, dp = layout
        resumed = [make(stages, mbs=mbs, accum=accum, dp=dp, rank=r) for r in range(dp)]
        for d in resumed:
            d.load_state_dict(state)
        for s in range(6, 13):
            assert torch.equal(global_batch(resumed, s), expected[s - 1]), (layout, s)
    # a state without the blend counts (e.g. the blend changed) replays them from the count
    partial = {k: v for k, v in state.items() if k != "dataset_consumed_samples"}
    replayed = make(stages)
    replayed.load_state_dict(partial)
    assert replayed.state_dict() == state
    assert torch.equal(global_batch([replayed], 6), expected[5])


def test_repeated_step_gives_same_batch_and_backwards_fails(folders):
    data = make(blend_stage(folders))
    a = global_batch([data], 1)
    assert torch.equal(a, global_batch([data], 1))
    data.micro_batches(3)  # skipping step 2 still consumes its samples
    assert data.consumed_samples == 12
    with pytest.raises(ValueError, match="already past step 3"):
        data.micro_batches(2)


def test_blend_shares_within_one_percent(folders):
    weights = [0.5, 0.3, 0.2]
    data = make(blend_stage(folders, weights), mbs=10, accum=10)  # 100 samples per step
    counts = np.zeros(3)
    for step in range(1, 101):
        for mb in data.micro_batches(step):
            counts += np.bincount(source_of(mb["input_ids"]).numpy(), minlength=3)
    assert counts.sum() == 10_000
    assert np.all(np.abs(counts / 10_000 - weights) < 0.01), counts
    assert data.state_dict()["dataset_consumed_samples"] == counts.astype(int).tolist()


def test_zero_weight_dataset_is_never_drawn(folders):
    data = make(blend_stage(folders, (1, 0, 3)), mbs=4, accum=4)
    ids = torch.cat([mb["input_ids"] for s in range(1, 21) for mb in data.micro_batches(s)])
    source = source_of(ids)
    assert int((source == 1).sum()) == 0
    assert int((source == 0).sum()) == 80 and int((source == 2).sum()) == 240


def test_stage_switch_at_configured_step_and_resume_across_it(folders):
    stages = [
        StageSpec("warmup", 1, DatasetSpec(folders[0]), 1),
        StageSpec("annealing", 4, DatasetSpec(folders[1:3], [1, 1]), 2),
    ]
    data = make(stages)
    sources = {}
    for step in range(1, 8):
        ids = global_batch([data], step)
        sources[step] = set(source_of(ids).tolist())
        if step == 3:
            state = data.state_dict()
            assert state["stage_name"] == "warmup"
    assert all(sources[s] == {0} for s in (1, 2, 3))
    assert all(sources[s] == {1, 2} for s in (4, 5, 6, 7))
    final = data.state_dict()
    assert final["stage_name"] == "annealing" and final["stage_consumed_samples"] == 16
    assert final["stages_consumed_samples"] == {"warmup": 12, "annealing": 16}
    resumed = make(stages)
    resumed.load_state_dict(state)
    fresh = make(stages)
    for s in range(1, 4):
        fresh.micro_batches(s)
    for s in range(4, 8):
        assert torch.equal(global_batch([resumed], s), global_batch([fresh], s))
    assert resumed.state_dict() == fresh.state_dict() == final


def test_epoch_wraparound_reshuffles_and_logs_once(folders, caplog):
    stages = [StageSpec("tiny", 1, DatasetSpec(folders[3]), 3)]
    data = make(stages, mbs=1, accum=7)  # one step = one epoch of the 7 samples
    with caplog.at_level(logging.INFO, logger="nanotron_train.data"):
        epochs = [global_batch([data], s) for s in (1, 2, 3)]
    ns = Nanoset(folders[3])
    every = sorted(tuple(ns.sample(i, SEQ)[:-1].tolist()) for i in range(7))
    for e in epochs:  # each epoch reads every sample exactly once
        assert sorted(tuple(row) for row in e.tolist()) == every
    assert not torch.equal(epochs[0], epochs[1])  # reshuffled
    wraps = [r for r in caplog.records if "starting epoch" in r.getMessage()]
    assert [r.getMessage().split("starting epoch ")[1][:1] for r in wraps] == ["2", "3"]


def test_eod_mask_loss_masks_the_label_after_each_document(folders):
    plain = make([StageSpec("m", 1, DatasetSpec(folders[0]), 0)]).micro_batches(1)
    masked = make([StageSpec("m", 1, DatasetSpec(folders[0], eod_mask_loss=True), 0)])
    masked = masked.micro_batches(1)
    saw_eos = 0
    for a, b in zip(plain, masked):
        assert torch.equal(a["input_ids"], b["input_ids"])
        assert torch.equal(b["label_mask"], a["input_ids"] != 0)  # eos id is 0
        saw_eos += int((a["input_ids"] == 0).sum())
        # predicting EOS (a document's end) stays in the loss
        assert bool(b["label_mask"][a["label_ids"] == 0].all())
    assert saw_eos > 0


@pytest.mark.parametrize(
    ("stages", "match"),
    [
        ([], "at least one stage"),
        ([StageSpec("a", 2, DatasetSpec("x"), 0)], "must start at step 1"),
        (
            [StageSpec("a", 1, DatasetSpec("x"), 0), StageSpec("b", 1, DatasetSpec("x"), 0)],
            r"data_stages\[1\].*must be greater",
        ),
        ([StageSpec("a", 1, DatasetSpec(["x", "y"], [0, 0]), 0)], "sum to a positive number"),
        ([StageSpec("a", 1, DatasetSpec(["x", "y"], [1, -1]), 0)], "non-negative"),
        ([StageSpec("a", 1, DatasetSpec(["x", "y"], [1]), 0)], "1 weights for 2 folders"),
        ([StageSpec("a", 1, DatasetSpec(), 0)], "exactly one of"),
    ],
)
def test_bad_stages_and_weights(stages, match):
    with pytest.raises(DataError, match=match):
        make(stages)


def test_vocab_bigger_than_model_and_too_short_dataset(folders):
    with pytest.raises(DataError, match=r"ds0/metadata.json: tokenizer vocab_size 400 exceeds"):
        make([StageSpec("a", 1, DatasetSpec(folders[0]), 0)], vocab=300)
    stages = [StageSpec("a", 1, DatasetSpec(folders[3]), 0)]
    with pytest.raises(DataError, match="too few for one sample"):
        TrainData(stages, sequence_length=100, micro_batch_size=1,
                  batch_accumulation_per_replica=1, dp_rank=0, dp_size=1, tokenizer_path=None,
                  cache_dir="unused", model_vocab_size=400)  # fmt: skip


def test_unknown_tokenizer_name_is_only_a_warning_for_nanoset_folders(folders, caplog):
    stages = [StageSpec("a", 1, DatasetSpec(folders[0]), 0)]
    with caplog.at_level(logging.WARNING, logger="nanotron_train.data"):
        TrainData(stages, sequence_length=SEQ, micro_batch_size=1,
                  batch_accumulation_per_replica=1, dp_rank=0, dp_size=1,
                  tokenizer_path="org/not-cached", cache_dir="unused", model_vocab_size=400)  # fmt: skip
    assert "not found locally" in caplog.text
    raw = [StageSpec("a", 1, DatasetSpec(hf_dataset_or_datasets=folders[0]), 0)]
    with pytest.raises(DataError, match="may be offline"):
        TrainData(raw, sequence_length=SEQ, micro_batch_size=1,
                  batch_accumulation_per_replica=1, dp_rank=0, dp_size=1,
                  tokenizer_path="org/not-cached", cache_dir="unused", model_vocab_size=400)  # fmt: skip


def test_token_id_outside_the_model_vocab_is_caught_where_data_is_read(tmp_path):
    """The model does not range-check ids (a device sync per micro-batch); the data does, once
    per sample, naming the folder and the sample. A corrupt file: ids past its own vocab."""
    bad = make_id_nanoset(tmp_path / "bad", [40, 40], low=250, high=300, vocab_size=256)
    data = make([StageSpec("a", 1, DatasetSpec(str(bad)), 0)], mbs=1, accum=1, vocab=256)
    with pytest.raises(DataError, match=r"bad: sample \d+ holds token id 2\d\d, outside the mod"):
        data.micro_batches(1)
    ok = make([StageSpec("a", 1, DatasetSpec(str(bad)), 0)], mbs=1, accum=1, vocab=300)
    assert int(ok.micro_batches(1)[0]["input_ids"].max()) >= 256
