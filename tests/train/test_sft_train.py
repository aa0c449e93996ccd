"""Supervised fine-tuning in the trainer (`sft_dataloader: true`, data/sft.py and
data/token_weighting.py) on the committed tiny chat data (configs/sft-data/): the loss of a
step is the token-weighted mean over the global batch (the hand computation, not a mean of
per-micro-batch means), a label of a token that is not the assistant's gets no gradient, and
dp=2, pp=2, tp=2 and cp=2 train the same model as one process (loss and grad norm, 1e-5)."""

from __future__ import annotations

import copy
import io
import math
from pathlib import Path

import pytest
import torch
import yaml

from nanotron_parallel.testing import run_distributed, shared_default_group

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs" / "tiny-sft-cpu.yaml"
DATA = REPO / "configs" / "sft-data"
STEPS = 2


def sft_config(layout: dict) -> dict:
    """configs/tiny-sft-cpu.yaml, smaller (2 layers, width 32), 2 steps, global batch 4."""
    raw = yaml.safe_load(CONFIG.read_text())
    raw["model"]["model_config"].update(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2,
    )  # fmt: skip
    raw["tokenizer"]["tokenizer_name_or_path"] = str(DATA / "tokenizer")
    dataset = raw["data_stages"][0]["data"]["dataset"]
    dataset.update(hf_dataset_or_datasets=str(DATA / "chat.jsonl"), debug_max_samples=24)
    raw["data_stages"][0]["data"]["num_loading_workers"] = 0
    raw["tokens"].update(train_steps=STEPS, micro_batch_size=layout["mbs"])
    raw["tokens"]["batch_accumulation_per_replica"] = layout["accum"]
    raw["checkpoints"]["checkpoints_path"] = None
    raw["logging"]["metrics_file"] = None
    raw["validation"] = {"dataset": {"hf_dataset_or_datasets": str(DATA / "chat.jsonl"),
                                     "sft_dataloader": True, "debug_max_samples": 10}}  # fmt: skip
    raw["tokens"]["val_check_interval"] = -1  # the held-out answers' loss after the last step
    raw["parallelism"].update(dp=layout["dp"], tp=layout["tp"], pp=layout["pp"])
    raw["parallelism"]["context_parallel_size"] = layout.get("cp", 1)
    return raw


def _train(layouts: list[dict]) -> list[dict]:
    """Each layout's per-step lm_loss, grad_norm and labelled tokens (one shared group)."""
    import torch.distributed as dist

    from nanotron_parallel.context import ParallelContext
    from nanotron_train.config import config_from_dict
    from nanotron_train.trainer import Trainer

    out = []
    for layout in layouts:
        cfg = config_from_dict(sft_config(copy.deepcopy(layout)), "sft.yaml", world_size=None)
        pc = ParallelContext(dp=layout["dp"], tp=layout["tp"], pp=layout["pp"],
                             cp=layout.get("cp", 1))  # fmt: skip
        try:
            records: list[dict] = []
            Trainer(cfg, pc, stream=io.StringIO()).train(on_record=records.append)
        finally:
            dist.barrier()
            pc.destroy()
        keys = ("lm_loss", "grad_norm", "labelled_tokens")
        out.append({k: [r[k] for r in records] for k in keys})
        out[-1]["val_loss"] = [records[-1]["val_loss"]]
    return out


def run_layouts(layouts: list[dict]) -> list[dict]:
    torch.set_num_threads(1)
    with shared_default_group():
        return _train(layouts)


ONE = {"dp": 1, "tp": 1, "pp": 1, "mbs": 2, "accum": 2}
LAYOUTS = [  # the same global batch of 4 rows, cut into micro-batches differently
    {"dp": 2, "tp": 1, "pp": 1, "mbs": 1, "accum": 2},
    {"dp": 1, "tp": 1, "pp": 2, "mbs": 1, "accum": 4},
    {"dp": 1, "tp": 2, "pp": 1, "mbs": 2, "accum": 2},
    {"dp": 1, "tp": 1, "pp": 1, "cp": 2, "mbs": 2, "accum": 2},  # the loss's 1/cp, doc masks
]


def test_sft_layouts_equal_one_process():
    ref = run_layouts([ONE])[0]
    assert len(ref["lm_loss"]) == STEPS and all(math.isfinite(x) for x in ref["lm_loss"])
    results = run_distributed(run_layouts, 2, LAYOUTS, timeout=300)[0]
    for layout, res in zip(LAYOUTS, results, strict=True):
        assert res["labelled_tokens"] == ref["labelled_tokens"], layout
        for key in ("lm_loss", "grad_norm", "val_loss"):
            for a, b in zip(res[key], ref[key], strict=True):
                assert abs(a - b) <= 1e-5 * abs(b), (layout, key, res[key], ref[key])


@pytest.fixture(scope="module")
def sft_batches():
    """Step 1's four micro-batches of one row each (packed chat rows, document ids) and a model."""
    from nanotron_models import build_llama
    from nanotron_parallel.context import ParallelContext
    from nanotron_train.config import config_from_dict
    from nanotron_train.data.source import build_data

    with shared_default_group():
        layout = {"dp": 1, "tp": 1, "pp": 1, "mbs": 1, "accum": 4}
        cfg = config_from_dict(sft_config(layout), "sft.yaml", world_size=None)
        pc = ParallelContext(1, 1, 1)
        try:
            batches = build_data(cfg, pc).micro_batches(1)
            config = cfg.model.model_config  # a Llama with document masking
            assert config.document_masking

            def model():
                return build_llama(config, pc, seed=3)

            yield batches, model, pc
        finally:
            pc.destroy()


def _step_loss(model, batches, pc) -> torch.Tensor:
    """What a pipeline step back-propagates (nanotron_parallel's runner: each micro-batch's
    loss / M), after the trainer's token weighting."""
    from nanotron_train.data.token_weighting import weigh_by_labelled_tokens

    batches = [dict(mb) for mb in batches]
    weigh_by_labelled_tokens(batches, pc)
    loss = sum(model(None, mb) / len(batches) for mb in batches)
    loss.backward()
    return loss.detach()


def _grads(model) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters()]


def test_token_weighted_loss_is_the_hand_computation(sft_batches):
    from nanotron_train.data.sft import LABELLED_TOKENS_KEY

    batches, make, pc = sft_batches
    counts = [int(mb[LABELLED_TOKENS_KEY]) for mb in batches]
    assert len(set(counts)) > 1, counts  # unequal labelled tokens per micro-batch
    assert "document_ids" in batches[0] and int(batches[0]["document_ids"].max()) >= 1  # packed
    # by hand: each micro-batch's mean over its labels (the plain loss), weighed by its count
    hand_model, means = make(), []
    hand = torch.zeros(())
    for mb, c in zip(batches, counts):
        plain = {k: v for k, v in mb.items() if k != LABELLED_TOKENS_KEY}
        mean = hand_model(None, plain)
        (mean * c / sum(counts)).backward()
        hand += mean.detach() * c / sum(counts)
        means.append(float(mean.detach()))
    model = make()
    loss = _step_loss(model, batches, pc)
    assert float(loss) == pytest.approx(float(hand), rel=1e-6)
    mean_of_means = sum(means) / len(means)
    assert abs(mean_of_means - float(hand)) > 1e-3  # what the step would be without it
    for g, h in zip(_grads(model), _grads(hand_model), strict=True):
        torch.testing.assert_close(g, h, rtol=1e-5, atol=1e-7)


def test_labels_of_tokens_not_the_assistants_get_no_gradient(sft_batches):
    batches, make, pc = sft_batches
    model = make()
    loss = _step_loss(model, batches, pc)
    grads = _grads(model)
    scrambled = []
    gen = torch.Generator().manual_seed(0)
    for mb in batches:  # every label the mask leaves out replaced by a random other token
        mb = dict(mb)
        other = torch.randint(0, 320, mb["label_ids"].shape, generator=gen)
        mb["label_ids"] = torch.where(mb["label_mask"], mb["label_ids"], other)
        scrambled.append(mb)
    changed = sum(int((a["label_ids"] != b["label_ids"]).sum()) for a, b in zip(scrambled, batches))
    assert changed > 100
    model2 = make()
    assert torch.equal(_step_loss(model2, scrambled, pc), loss)
    for g, h in zip(_grads(model2), grads, strict=True):
        assert torch.equal(g, h)


def test_sft_step_has_no_host_sync():
    """The token weighting adds no host read to a training step: the labelled count is summed
    and all-reduced as a tensor."""
    from nanotron_parallel.context import ParallelContext
    from nanotron_train.config import config_from_dict
    from nanotron_train.trainer import Trainer
    from tests.train.test_step_syncs import SYNC_OPS, _events

    layout = {"dp": 1, "tp": 1, "pp": 1, "mbs": 2, "accum": 2}
    raw = sft_config(layout)
    raw["logging"]["iteration_step_info_interval"] = 1000  # a logged step reads its loss
    cfg = config_from_dict(raw, "sft.yaml", world_size=None)
    with shared_default_group():
        pc = ParallelContext(1, 1, 1)
        try:
            trainer = Trainer(cfg, pc, stream=io.StringIO())
            trainer.train_step()
            step, out = _events(trainer.train_step)
            trainer.close()
        finally:
            pc.destroy()
    assert {op: step.get(op, 0) for op in SYNC_OPS} == dict.fromkeys(SYNC_OPS, 0), step
    assert trainer.records.labelled_steps == 2 and int(trainer.records.labelled) > 0


def test_held_out_sft_loss_is_the_token_weighted_loss_of_its_answers(sft_batches):
    """validation.dataset with sft_dataloader: the Evaluator's val_loss over the held-out rows
    (two validation batches, the last padded with rows without labels) is the sum of their
    answer tokens' losses over their count."""
    from nanotron_train.config import config_from_dict
    from nanotron_train.data.source import build_validation_data
    from nanotron_train.eval.evaluation import Evaluator

    _, make, pc = sft_batches
    cfg = config_from_dict(sft_config(ONE), "sft.yaml", world_size=None)
    data = build_validation_data(cfg, pc, None)
    rows = data.rows
    assert data.num_batches == 2 and len(rows["input_ids"]) % 4 != 0  # a padded last batch
    model = make()
    got = Evaluator(model, pc, "1f1b", data).evaluate()
    with torch.no_grad():
        total = sum(
            float(model(None, {k: torch.from_numpy(v[i : i + 1]) for k, v in rows.items()}))
            * int(rows["label_mask"][i].sum())
            for i in range(len(rows["input_ids"]))
        )
    assert got.tokens == int(rows["label_mask"].sum())
    assert got.loss == pytest.approx(total / got.tokens, rel=1e-6)


@pytest.mark.parametrize(
    "change, key",
    [
        ({"dataset_folder": ["x"], "hf_dataset_or_datasets": None}, "sft_dataloader"),
        ({"sft_dataloader": False}, "debug_max_samples"),
        ({"debug_max_samples": 0}, "debug_max_samples"),
        ({"eod_mask_loss": True}, "eod_mask_loss"),
        ({"hf_dataset_splits": ["validation"]}, "hf_dataset_splits"),
    ],
)
def test_sft_keys_that_do_not_apply_are_one_line_naming_them(change, key):
    from nanotron_train.config import ConfigError, config_from_dict

    raw = sft_config(ONE)
    raw["data_stages"][0]["data"]["dataset"].update(change)
    with pytest.raises(ConfigError) as err:
        config_from_dict(raw, "sft.yaml", world_size=None)
    message = str(err.value)
    assert (
        message.startswith(f"sft.yaml: data_stages.0.data.dataset.{key}: ") and "\n" not in message
    )


def test_prompt_completion_rows_train_on_the_completion_and_its_eos(tmp_path):
    """Nanotron's SFT rows: the text prompt + completion + EOS, labels on the completion."""
    from nanotron_train.data import load_tokenizer
    from nanotron_train.data.sft import read_examples, tokenize_examples

    tok = load_tokenizer(str(DATA / "tokenizer"))
    path = tmp_path / "rows.jsonl"
    path.write_text('{"prompt": "Q: where is ada?\\nA: ", "completion": "oslo"}\n')
    ((ids, mask),) = tokenize_examples(read_examples(str(path)), tok, None, "rows")
    prompt = tok.encode("Q: where is ada?\nA: ")
    assert ids == prompt + tok.encode("oslo") + [tok.eos_token_id]
    assert mask == [False] * len(prompt) + [True] * (len(ids) - len(prompt))


def test_sft_resume_is_exact(tmp_path):
    """A run resumed from its step-2 checkpoint makes step 3 exactly as the run that never
    stopped: the SFT data's position is the step (the same rows, the same token weights)."""
    from nanotron_parallel.context import ParallelContext
    from nanotron_train.config import config_from_dict
    from nanotron_train.trainer import Trainer

    def run(resume: str | None) -> list[dict]:
        raw = sft_config(ONE)
        del raw["validation"]
        raw["tokens"].update(train_steps=3, val_check_interval=-1)
        raw["checkpoints"].update(checkpoints_path=str(tmp_path / ("r" if resume else "ck")),
                                  checkpoint_interval=2, resume_checkpoint_path=resume,
                                  save_final_state=False)  # fmt: skip
        cfg = config_from_dict(raw, "sft.yaml", world_size=None)
        records: list[dict] = []
        with shared_default_group():
            pc = ParallelContext(1, 1, 1)
            try:
                Trainer(cfg, pc, stream=io.StringIO()).train(on_record=records.append)
            finally:
                pc.destroy()
        return records

    full = run(None)
    resumed = run(str(tmp_path / "ck" / "2"))
    assert [r["step"] for r in resumed] == [3]
    for key in ("lm_loss", "grad_norm", "labelled_tokens"):
        assert resumed[0][key] == full[2][key], key
