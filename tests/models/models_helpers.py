"""Helpers of the model tests: tiny configs and Hugging Face references."""

from __future__ import annotations

import torch

from nanotron_models import LlamaConfig
from nanotron_models.hf import config_to_hf

LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}


def tiny_config(tie: bool = False, **overrides) -> LlamaConfig:
    """hidden 64, 4 heads / 2 kv heads (GQA), 2 layers, odd vocab, rope_theta != 10000."""
    fields = dict(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=101,
        max_position_embeddings=64,
        rope_theta=500000.0,
        rope_scaling=dict(LLAMA3_SCALING),
        tie_word_embeddings=tie,
        eos_token_id=2,
        bos_token_id=1,
    )
    fields.update(overrides)
    return LlamaConfig(**fields)


def hf_model(config: LlamaConfig, seed: int = 0):
    import transformers

    torch.manual_seed(seed)
    hc = config_to_hf(config)
    hc._attn_implementation = "eager"
    model = transformers.LlamaForCausalLM(hc).float()
    # HF leaves norms at 1; randomise them so a swapped norm would show.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    return model


def hf_reference(config: LlamaConfig, seed: int = 0, batch: int = 2, seq: int = 12) -> dict:
    """HF state dict, a batch, and HF's logits, masked mean loss and gradients on it."""
    model = hf_model(config, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    ids = torch.randint(0, config.vocab_size, (batch, seq + 1), generator=gen)
    mask = torch.rand(batch, seq, generator=gen) > 0.25
    input_ids, label_ids = ids[:, :-1].contiguous(), ids[:, 1:].contiguous()
    logits = model(input_ids).logits
    loss = torch.nn.functional.cross_entropy(logits[mask], label_ids[mask])
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    if config.tie_word_embeddings:
        grads["lm_head.weight"] = grads["model.embed_tokens.weight"]
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return {
        "hf_sd": sd,
        "batch": {"input_ids": input_ids, "label_ids": label_ids, "label_mask": mask},
        "logits": logits.detach(),
        "loss": loss.detach(),
        "grads": grads,
    }


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| relative to max |b|."""
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp(min=1e-30))
