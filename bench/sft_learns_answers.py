"""A short supervised fine-tune on generated conversations learns the answers (a figure for
nanotron_train/data/chat.py): `.venv/bin/python bench/sft_learns_answers.py`.

Generated data: 8 facts ("where is <name>?" -> "<place>"), each asked in conversations with
random system and filler turns, rendered with a ChatML template, packed several to a row with
document masking, the loss on the assistant's tokens only. A tiny Llama (random init) trains
200 steps (SFT_STEPS) with AdamW on one process. Printed: greedy answers correct before and
after (the prompt tokenized span by span, as in training: ChatFormat.prompt_ids), and the mean
loss of the answer tokens against that of the user's tokens (never trained: it stays high).
Measured (shared 2-core machine, 17 s): 0/8 -> 8/8 answers right, answer-token loss
5.709 -> 0.011, user-token loss 5.749 -> 7.697.
"""

from __future__ import annotations

import os
import random

import numpy as np
import torch

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SEQ, STEPS, ROWS = 256, int(os.environ.get("SFT_STEPS", 200)), 4


def facts(rng: random.Random) -> list[tuple[str, str]]:
    names = ["ada", "bob", "cyd", "dee", "eve", "fay", "gus", "hal"]
    places = ["paris", "rome", "oslo", "lima", "kyiv", "doha", "bern", "riga"]
    rng.shuffle(places)
    return list(zip(names, places))


def conversation(rng: random.Random, pairs) -> list[dict]:
    noise = ["data", "loss", "model", "rank", "zero", "tensor"]
    name, place = rng.choice(pairs)
    messages = [{"role": "system", "content": " ".join(rng.choices(noise, k=3))}]
    if rng.random() < 0.5:
        messages += [
            {"role": "user", "content": " ".join(rng.choices(noise, k=2))},
            {"role": "assistant", "content": "ok"},
        ]
    return messages + [
        {"role": "user", "content": f"where is {name}?"},
        {"role": "assistant", "content": place},
    ]


def answers_correct(model, chat, pairs) -> int:
    from nanotron_train.inference.decoding import generate

    good = 0
    for name, place in pairs:
        asked = [{"role": "system", "content": "data loss model"},
                 {"role": "user", "content": f"where is {name}?"}]  # fmt: skip
        ids = chat.prompt_ids(asked)  # tokenized span by span, as in training
        out = generate(model, [ids], 24, eos_token_id=None).tokens[0]
        text = chat.tokenizer.decode(out)
        good += text.startswith(place + "<|im_end|>")
        if name == pairs[0][0]:
            print(f"  where is {name}? -> {text!r} (expected {place!r})")
    return good


def token_losses(model, batch, chat) -> tuple[float, float]:
    """Mean loss of the answer tokens and of the user's tokens (labels flipped to them)."""
    answer = float(model(None, batch))
    user = dict(batch, label_mask=~batch["label_mask"] & (batch["position_ids"] > 0))
    return answer, float(model(None, user))


def main() -> None:
    import tempfile

    from nanotron_models.config import LlamaConfig
    from nanotron_models.model import build_llama
    from nanotron_parallel.context import ParallelContext
    from nanotron_train.data import load_tokenizer
    from nanotron_train.data.chat import ChatFormat, pack
    from nanotron_train.data.testing import make_tokenizer, tiny_texts

    torch.manual_seed(0)
    rng = random.Random(0)
    pairs = facts(rng)
    with tempfile.TemporaryDirectory() as tmp:
        tok = load_tokenizer(str(make_tokenizer(f"{tmp}/tok", tiny_texts(60), vocab_size=300)))
    chat = ChatFormat(CHATML, tok)
    pc = ParallelContext()
    config = LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=304, max_position_embeddings=SEQ,
        _use_doc_masking=True,
    )  # fmt: skip
    model = build_llama(config, pc, seed=1)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)

    def batch_of(seed: int) -> dict:
        r = random.Random(seed)
        convs = [chat.tokenize(conversation(r, pairs)) for _ in range(ROWS * 3)]
        return {k: torch.from_numpy(np.asarray(v)) for k, v in pack(convs, SEQ, 0).items()}

    held_out = batch_of(10**6)
    model.eval()
    with torch.no_grad():
        before = answers_correct(model, chat, pairs), token_losses(model, held_out, chat)
    model.train()
    for step in range(STEPS):
        loss = model(None, batch_of(step))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    model.eval()
    with torch.no_grad():
        after = answers_correct(model, chat, pairs), token_losses(model, held_out, chat)
    for when, (good, (answer, user)) in (("before", before), ("after", after)):
        print(
            f"{when}: {good}/{len(pairs)} answers right | answer-token loss {answer:.3f} | "
            f"user-token loss (never trained) {user:.3f}"
        )
    pc.destroy()


if __name__ == "__main__":
    main()
