"""Supervised fine-tuning from Hugging Face weights and back (docs/sft.md's walk-through): a
random transformers Llama with a chat-template tokenizer (examples/sft/make_tiny_hf_llama.py)
-> `convert from-hf` -> a few SFT steps in the trainer from it (`model.init_method.path`) ->
`convert to-hf` -> transformers. The run starts from the imported weights (every tensor), its
loss goes down, the export's logits equal our final checkpoint's
(1e-5), and the export's tokenizer renders a conversation with `apply_chat_template` as the
fine-tune rendered it."""

from __future__ import annotations

import importlib.util
import io
from pathlib import Path

import torch
import yaml

from nanotron_parallel.testing import shared_default_group
from tests.train.test_sft_train import DATA, ONE, REPO, sft_config

STEPS = 8
CHAT = [
    {"role": "system", "content": "loss zero tensor"},
    {"role": "user", "content": "where is ada?"},
    {"role": "assistant", "content": "oslo"},
    {"role": "user", "content": "where is gus?"},
]


def _make_hf(config_file: Path, out: Path) -> Path:
    path = REPO / "examples" / "sft" / "make_tiny_hf_llama.py"
    spec = importlib.util.spec_from_file_location("make_tiny_hf_llama", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.make_tiny_hf_llama(config_file, out)


def _finetune(raw: dict, imported: Path) -> list[dict]:
    """The run's records; its model starts as the checkpoint `imported` (every tensor)."""
    from nanotron_parallel.context import ParallelContext
    from nanotron_train.config import config_from_dict
    from nanotron_train.inference.model_io import full_model_tensors, open_checkpoint
    from nanotron_train.trainer import Trainer

    records: list[dict] = []
    want = full_model_tensors(open_checkpoint(imported))
    with shared_default_group():
        pc = ParallelContext(1, 1, 1)
        try:
            cfg = config_from_dict(raw, "sft.yaml", world_size=None)
            trainer = Trainer(cfg, pc, stream=io.StringIO())
            params = dict(trainer.state.model.named_parameters())
            assert sorted(want) == sorted(params) and len(want) > 10
            assert all(torch.equal(params[name], want[name]) for name in want)
            trainer.train(on_record=records.append)
        finally:
            pc.destroy()
    return records


def _our_logits(ckpt: Path, ids: torch.Tensor) -> torch.Tensor:
    from nanotron_parallel.context import ParallelContext
    from nanotron_train.inference.model_io import load_model, open_checkpoint

    with shared_default_group():
        pc = ParallelContext(1, 1, 1)
        try:
            return load_model(open_checkpoint(ckpt), pc).logits(ids)
        finally:
            pc.destroy()


def test_sft_from_hugging_face_weights_and_back(tmp_path, monkeypatch):
    import transformers

    from nanotron_train.convert import main as convert
    from nanotron_train.data import load_tokenizer
    from nanotron_train.data.chat import ChatFormat, chat_template_of

    torch.set_num_threads(1)
    monkeypatch.setenv("NANOTRON_DATA_CACHE", str(tmp_path / "cache"))
    raw = sft_config(ONE)  # a tiny Llama (2 layers, width 32), the committed chats
    del raw["validation"]
    (tmp_path / "sft.yaml").write_text(yaml.safe_dump(raw))
    hf = _make_hf(tmp_path / "sft.yaml", tmp_path / "hf")
    assert (hf / "chat_template.jinja").is_file()  # where transformers 5 saves the template
    assert convert(["from-hf", "--hf-path", str(hf), "--out", str(tmp_path / "imported")]) == 0
    raw["model"]["init_method"] = {"path": str(tmp_path / "imported" / "0")}
    raw["tokenizer"]["tokenizer_name_or_path"] = str(tmp_path / "imported" / "tokenizer")
    raw["tokens"].update(train_steps=STEPS)
    raw["checkpoints"].update(checkpoints_path=str(tmp_path / "sft"), checkpoint_interval=STEPS)
    losses = [r["lm_loss"] for r in _finetune(raw, tmp_path / "imported" / "0")]
    assert len(losses) == STEPS
    assert losses[-1] < losses[0] - 0.3, losses  # the answers are being learnt
    export = tmp_path / "export"
    assert convert(["to-hf", "--ckpt-path", str(tmp_path / "sft"), "--out", str(export)]) == 0

    tokenizer = transformers.AutoTokenizer.from_pretrained(export)
    text = tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    ours = ChatFormat(chat_template_of(str(DATA / "tokenizer" / "tokenizer.json")),
                      load_tokenizer(str(export)))  # fmt: skip
    assert text == ours.render(CHAT, add_generation_prompt=True)
    ids = torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"]])
    assert ids[0].tolist() == ours.tokenizer.encode(text)
    model = transformers.AutoModelForCausalLM.from_pretrained(export).float().eval()
    with torch.no_grad():
        theirs = model(ids).logits
    torch.testing.assert_close(theirs, _our_logits(tmp_path / "sft", ids), rtol=1e-5, atol=1e-5)


def test_export_carries_the_chat_template_the_config_trained_with(tmp_path):
    """A run whose SFT stage gave `dataset.chat_template` exports it as chat_template.jinja
    (read by transformers before tokenizer_config.json's): the tokenizer's own would render
    conversations otherwise than the fine-tune saw them."""
    from nanotron_train.convert import _trained_chat_template, _write_tokenizer
    from nanotron_train.data import load_tokenizer
    from nanotron_train.data.chat import chat_template_of

    raw = sft_config(ONE)
    assert _trained_chat_template(raw) is None  # the tokenizer's: its files carry it
    template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    raw["data_stages"][0]["data"]["dataset"]["chat_template"] = template
    assert _trained_chat_template(raw) == template
    tok = load_tokenizer(str(DATA / "tokenizer"))
    _write_tokenizer(tok, tmp_path, None, _trained_chat_template(raw))
    assert (tmp_path / "chat_template.jinja").read_text() == template
    assert chat_template_of(str(tmp_path / "tokenizer.json")) == template
