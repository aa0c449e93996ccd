"""Chat data for supervised fine-tuning (nanotron_train/data/chat.py): conversations rendered
with a chat template read from the tokenizer's files, a label only where the predicted token is
the assistant's, and several conversations packed to a row whose loss (values and gradients)
is the token-weighted loss of each conversation alone."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SEQ = 256


@pytest.fixture(scope="module")
def chat(tmp_path_factory):
    from nanotron_train.data import load_tokenizer
    from nanotron_train.data.chat import ChatFormat, chat_template_of
    from nanotron_train.data.testing import make_tokenizer, tiny_texts

    root = tmp_path_factory.mktemp("chat")
    tok_dir = make_tokenizer(root / "tok", tiny_texts(60), vocab_size=300)
    config = json.loads((tok_dir / "tokenizer_config.json").read_text())
    (tok_dir / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": CHATML}))
    tok = load_tokenizer(str(tok_dir))
    template = chat_template_of(tok.path)
    assert template == CHATML
    return ChatFormat(template, tok)


def _conversations(n: int, seed: int = 0) -> list[list[dict]]:
    rng = random.Random(seed)
    words = ["data", "model", "loss", "def", "return", "import", "zero", "tensor", "rank"]

    def say(k: int) -> str:
        return " ".join(rng.choice(words) for _ in range(k))

    out = []
    for _ in range(n):
        messages = [{"role": "system", "content": say(2)}] if rng.random() < 0.5 else []
        for _ in range(rng.randint(1, 2)):
            messages.append({"role": "user", "content": say(rng.randint(1, 4))})
            messages.append({"role": "assistant", "content": say(rng.randint(1, 3))})
        out.append(messages)
    return out


def test_assistant_tokens_are_exactly_the_answers(chat):
    messages = _conversations(1, seed=3)[0] + [
        {"role": "user", "content": "zero rank"},
        {"role": "assistant", "content": "tensor loss"},
    ]
    text = chat.render(messages)
    assert text.endswith("<|im_start|>assistant\ntensor loss<|im_end|>\n")
    ids, mask = chat.tokenize(messages)
    assert chat.tokenizer.decode(ids) == text
    answers = [m["content"] + "<|im_end|>\n" for m in messages if m["role"] == "assistant"]
    masked = np.asarray(ids)[np.asarray(mask)].tolist()
    assert chat.tokenizer.decode(masked) == "".join(answers)
    # and each answer's tokens are one contiguous run (the header before it is context)
    runs = np.flatnonzero(np.diff(np.asarray(mask, dtype=int)) == 1)
    assert len(runs) == len(answers)
    # asking for the last answer gives exactly the tokens the answer followed in training
    prompt = chat.prompt_ids(messages[:-1])
    assert ids[: len(prompt)] == prompt and all(mask[len(prompt) :]) and not mask[len(prompt) - 1]


def test_no_label_on_a_token_that_is_not_the_assistants(chat):
    from nanotron_train.data.chat import pack

    convs = [chat.tokenize(m) for m in _conversations(12)]
    assert max(len(ids) for ids, _ in convs) <= SEQ + 1  # none is cut
    batch = pack(convs, SEQ, pad_token_id=0)
    rows = batch["input_ids"].shape[0]
    assert rows >= 2 and batch["label_mask"].shape == (rows, SEQ)
    # every answer token of every conversation is labelled exactly once, nothing else is
    expected = sorted(t for ids, mask in convs for t, m in zip(ids[1:], mask[1:]) if m)
    assert sorted(batch["label_ids"][batch["label_mask"]].tolist()) == expected
    # each conversation is a document of its own: positions restart at 0 at its first token
    starts = batch["position_ids"] == 0
    assert len(convs) <= int(starts.sum()) <= len(convs) + rows  # + the padding of each row
    assert np.array_equal(batch["document_ids"], np.cumsum(starts, axis=1))


def _model():
    from nanotron_models.config import LlamaConfig
    from nanotron_models.model import build_llama
    from nanotron_parallel.context import ParallelContext

    pc = ParallelContext()
    config = LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=304, max_position_embeddings=SEQ,
        _use_doc_masking=True,
    )  # fmt: skip
    return pc, build_llama(config, pc, seed=3)


def _loss_and_grads(model, batch: dict) -> tuple[torch.Tensor, dict]:
    model.zero_grad(set_to_none=True)
    loss = model(None, {k: torch.from_numpy(v) for k, v in batch.items()})
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_packed_loss_is_the_token_weighted_loss_of_each_conversation_alone(chat):
    from nanotron_train.data.chat import pack

    convs = [chat.tokenize(m) for m in _conversations(6, seed=1)]
    packed = pack(convs, SEQ, pad_token_id=0)
    assert packed["input_ids"].shape[0] < len(convs)  # several conversations share a row
    pc, model = _model()
    try:
        loss, grads = _loss_and_grads(model, packed)  # the packed micro-batch, as trained
        total = float(packed["label_mask"].sum())
        alone_loss, alone_grads = 0.0, None
        for conv in convs:
            one = pack([conv], SEQ, pad_token_id=0)
            w = float(one["label_mask"].sum()) / total
            l_c, g_c = _loss_and_grads(model, one)
            alone_loss += w * float(l_c)
            alone_grads = {n: w * g for n, g in g_c.items()} if alone_grads is None else {
                n: alone_grads[n] + w * g for n, g in g_c.items()}  # fmt: skip
        assert float(loss) == pytest.approx(alone_loss, rel=1e-6)
        for name, g in grads.items():
            scale = float(alone_grads[name].abs().max()) + 1e-12
            assert float((g - alone_grads[name]).abs().max()) <= 1e-5 * scale, name
    finally:
        pc.destroy()


def test_template_errors_are_one_line(chat):
    from nanotron_train.data.chat import ChatFormat
    from nanotron_train.data.errors import DataError

    with pytest.raises(DataError, match="^chat template: "):
        ChatFormat("{% if %}", chat.tokenizer)
    strict = ChatFormat(
        "{% if messages[0]['role'] != 'user' %}{{ raise_exception('user first') }}{% endif %}",
        chat.tokenizer,
    )
    with pytest.raises(DataError, match="^chat template: user first$"):
        strict.render([{"role": "assistant", "content": "x"}])
    with pytest.raises(DataError, match='needs a "role" and a "content"'):
        chat.tokenize([{"role": "user"}])


def test_conversations_are_read_from_jsonl_with_the_line_of_an_error(tmp_path):
    from nanotron_train.data.chat import read_conversations
    from nanotron_train.data.errors import DataError

    convs = _conversations(3)
    path = tmp_path / "chat.jsonl"
    path.write_text("\n".join(json.dumps({"messages": m}) for m in convs) + "\n\n")
    assert read_conversations(str(path)) == convs
    assert read_conversations(str(path), limit=2) == convs[:2]
    path.write_text(json.dumps({"messages": convs[0]}) + "\n" + '{"messages": "hi"}\n')
    with pytest.raises(DataError, match=f"^{path}:2: a conversation needs"):
        read_conversations(str(path))
