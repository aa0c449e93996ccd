"""A random-weight Hugging Face Llama folder with the architecture and tokenizer of a training
config, built locally with transformers (nothing downloaded): the stand-in for a pretrained
model in the SFT-from-Hugging-Face walk-through of docs/sft.md.

    python examples/sft/make_tiny_hf_llama.py --config-file configs/tiny-sft-cpu.yaml --out DIR

DIR holds what `save_pretrained` writes for a model and its tokenizer: config.json,
model.safetensors, tokenizer.json, tokenizer_config.json and, with transformers >= 4.50, the
chat template in chat_template.jinja.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import yaml

# the model_config keys a Hugging Face LlamaConfig names alike
ARCH_KEYS = (
    "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "vocab_size", "max_position_embeddings", "rms_norm_eps",
    "rope_theta", "tie_word_embeddings", "hidden_act", "initializer_range",
)  # fmt: skip


def make_tiny_hf_llama(config_file: str | Path, out: str | Path, seed: int = 0) -> Path:
    """Write the folder; its norms are random too, so a swapped norm would show."""
    import transformers

    raw = yaml.safe_load(Path(config_file).read_text())
    mc = raw["model"]["model_config"]
    tokenizer = transformers.AutoTokenizer.from_pretrained(
        raw["tokenizer"]["tokenizer_name_or_path"]
    )
    eos = tokenizer.eos_token_id
    hf_config = transformers.LlamaConfig(
        **{k: mc[k] for k in ARCH_KEYS if k in mc}, bos_token_id=eos, eos_token_id=eos
    )
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(hf_config).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return Path(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config-file", required=True, help="the training config to mirror")
    p.add_argument("--out", required=True, help="the Hugging Face folder to write")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    out = make_tiny_hf_llama(args.config_file, args.out, args.seed)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
