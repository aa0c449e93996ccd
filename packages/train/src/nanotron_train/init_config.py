"""`python -m nanotron_train.init_config --preset tiny-llama --out my.yaml`: a starter config.

Presets: tiny-llama (a few-minute CPU run on synthetic tokens) and llama-1b (a ~1.2B Llama for
GPUs in bf16). Every preset goes through the same validation as a file you write by hand.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from nanotron_train.config.errors import ConfigError
from nanotron_train.config.load import config_from_dict, save_config


def _base(
    model: dict[str, Any], tokens: dict[str, Any], lr: float, min_lr: float, dtype: str
) -> dict[str, Any]:
    return {
        "general": {"project": "nanotron", "run": "run", "seed": 42},
        # configs/tiny-llama-cpu.yaml and configs/llama-1b-gpu.yaml are these presets
        # (tests/train/test_train_units.py::test_presets_are_the_shipped_configs).
        "parallelism": {
            "dp": 1,
            "tp": 1,
            "pp": 1,
            "pp_engine": "1f1b",
            "tp_mode": "ALL_REDUCE",
            "tp_recompute_allgather": False,
        },  # fmt: skip
        "model": {
            "model_config": model,
            "init_method": {"std": 0.02},
            "dtype": dtype,
            "make_vocab_size_divisible_by": 1,
        },
        "tokenizer": {"tokenizer_name_or_path": None},
        "tokens": tokens,
        "optimizer": _optimizer(lr, min_lr),
        "checkpoints": {
            "checkpoints_path": "checkpoints",
            "checkpoint_interval": 100,
            "resume_checkpoint_path": None,
            "save_final_state": True,
        },
        "data_stages": [
            {
                "name": "stable",
                "start_training_step": 1,
                "data": {"dataset": None, "seed": 42, "num_loading_workers": 0},
            }
        ],
        "logging": {
            "iteration_step_info_interval": 1,
            "log_level": "info",
            "metrics_file": "metrics.jsonl",
        },
    }


def _optimizer(lr: float, min_lr: float) -> dict[str, Any]:
    """AdamW with a linear warm-up and a cosine decay from `lr` to `min_lr`."""
    return {
        "zero_stage": 0,
        "weight_decay": 0.01,
        "weight_decay_exclude_named_params": [".*norm.*", ".*bias"],
        "clip_grad": 1.0,
        "accumulate_grad_in_fp32": True,
        "learning_rate_scheduler": {
            "learning_rate": lr,
            "lr_warmup_steps": 10,
            "lr_warmup_style": "linear",
            "lr_decay_style": "cosine",
            "lr_decay_steps": None,
            "min_decay_lr": min_lr,
        },
        "optimizer_factory": {
            "name": "adamW",
            "adam_beta1": 0.9,
            "adam_beta2": 0.95,
            "adam_eps": 1.0e-8,
            "torch_adam_is_fused": False,
        },
    }


PRESETS: dict[str, dict[str, Any]] = {
    "tiny-llama": _base(
        model={
            "hidden_size": 64,
            "intermediate_size": 192,
            "num_hidden_layers": 4,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "vocab_size": 256,
            "max_position_embeddings": 256,
            "rms_norm_eps": 1.0e-5,
            "rope_theta": 10000.0,
            "tie_word_embeddings": True,
        },
        tokens={
            "sequence_length": 64,
            "micro_batch_size": 4,
            "batch_accumulation_per_replica": 2,
            "train_steps": 100,
        },
        lr=3.0e-3,
        min_lr=3.0e-4,
        dtype="float32",
    ),
    "llama-1b": _base(
        model={
            "hidden_size": 2048,
            "intermediate_size": 8192,
            "num_hidden_layers": 16,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "vocab_size": 32000,
            "max_position_embeddings": 2048,
            "rms_norm_eps": 1.0e-5,
            "rope_theta": 500000.0,
            "tie_word_embeddings": True,
        },
        tokens={
            "sequence_length": 2048,
            "micro_batch_size": 4,
            "batch_accumulation_per_replica": 8,
            "train_steps": 1000,
        },
        lr=3.0e-4,
        min_lr=3.0e-5,
        dtype="bfloat16",
    ),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m nanotron_train.init_config")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="tiny-llama")
    parser.add_argument("--out", required=True, help="where to write the YAML config")
    args = parser.parse_args(argv)
    try:
        cfg = config_from_dict(PRESETS[args.preset], source=f"preset {args.preset}")
        save_config(cfg, args.out)
    except (ConfigError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {args.out} (preset {args.preset})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
