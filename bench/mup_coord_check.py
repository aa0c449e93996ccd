"""Coordinate check of a parametrization: the RMS of each decoder layer's output on a fixed
batch after a few Adam steps, at widths 64..512 (heads of 16 dims, MLP 2x, 2 layers, the
synthetic data, a constant learning rate, no clipping or decay), as a ratio to width 64. A
parametrization that transfers across width keeps the ratios near 1; the standard one grows.

    python bench/mup_coord_check.py [--steps 6] [--lr 1e-2] [--moe]

Compares `model.init_method.std: 0.02` (sp) with `use_mup: true` (Nanotron's spectral µP),
`mup` and `completep`. `--moe`: every MLP a mixture of experts (Qwen2-MoE: 4 experts and a
shared expert, each as wide as the model, top-2); `--part mlp`: the RMS of each layer's MLP
(or MoE) branch output rather than the layer's. One process on the CPU; a few seconds.
"""

from __future__ import annotations

import argparse
import io

import torch

from nanotron_parallel.context import ParallelContext
from nanotron_parallel.testing import shared_default_group
from nanotron_train.config import config_from_dict
from nanotron_train.trainer import Trainer

WIDTHS = (64, 128, 256, 512)
VOCAB, SEQ = 127, 16


def moe_config(width: int) -> dict:
    """Every layer a mixture of experts whose widths grow with the model's."""
    return {"num_experts": 4, "top_k": 2, "moe_intermediate_size": width,
            "shared_expert_intermediate_size": width, "enable_shared_expert": True}  # fmt: skip


def config(
    width: int, init: dict, steps: int, lr: float, layers: int = 2, moe: bool = False
) -> dict:
    init = dict(init)
    param = init.pop("parametrization", None)
    experts = {"is_qwen2_config": True, "moe_config": moe_config(width)} if moe else {}
    return {
        "general": {"project": "bench", "run": "coord", "seed": 5},
        "model": {
            "model_config": {
                "hidden_size": width, "intermediate_size": 2 * width,
                "num_hidden_layers": layers, "num_attention_heads": width // 16,
                "num_key_value_heads": width // 16, "vocab_size": VOCAB,
                "max_position_embeddings": SEQ, "tie_word_embeddings": False, **experts,
            },
            "init_method": init,
            "dtype": "float32",
            **({"parametrization": param} if param else {}),
        },
        "tokens": {"sequence_length": SEQ, "micro_batch_size": 2,
                   "batch_accumulation_per_replica": 2, "train_steps": steps},
        "optimizer": {
            "weight_decay": 0.0, "clip_grad": None,
            "learning_rate_scheduler": {"learning_rate": lr, "lr_warmup_steps": 1,
                                        "lr_decay_style": "linear", "min_decay_lr": lr},
        },
        "logging": {"iteration_step_info_interval": steps},
    }  # fmt: skip


def layer_rms(
    width: int,
    init: dict,
    steps: int,
    lr: float,
    layers: int = 2,
    moe: bool = False,
    part: str | None = None,
) -> list[float]:
    """Each decoder layer's output RMS on a fixed batch after `steps` steps (`part`: of that
    submodule's output instead, e.g. "mlp": the feed-forward or MoE branch)."""
    pc = ParallelContext(1, 1, 1)
    try:
        raw = config(width, init, steps, lr, layers, moe)
        trainer = Trainer(config_from_dict(raw, "bench"), pc, stream=io.StringIO())
        trainer.train()
        model, rms = trainer.state.model, {}
        for name in model.block_names:
            if name.startswith("decoder."):
                block = model.block(name)
                (block.get_submodule(part) if part else block).register_forward_hook(
                    lambda m, a, out, name=name: rms.__setitem__(
                        name, float(out.detach().pow(2).mean().sqrt())
                    )
                )
        ids = torch.randint(0, VOCAB, (2, SEQ + 1), generator=torch.Generator().manual_seed(0))
        batch = {"input_ids": ids[:, :-1], "label_ids": ids[:, 1:],
                 "label_mask": torch.ones(2, SEQ, dtype=torch.bool)}  # fmt: skip
        with torch.no_grad():
            model(None, batch)
        return [rms[k] for k in sorted(rms)]
    finally:
        pc.destroy()


def main() -> None:
    args = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    args.add_argument("--steps", type=int, default=6)
    args.add_argument("--lr", type=float, default=1e-2)
    args.add_argument("--moe", action="store_true", help="every MLP a mixture of experts")
    args.add_argument("--part", default=None, help='a block\'s submodule to measure ("mlp")')
    a = args.parse_args()
    torch.set_num_threads(1)
    what = f"each layer's {a.part} output" if a.part else "layer output"
    print(f"{what} RMS after {a.steps} Adam steps at lr {a.lr}, / width {WIDTHS[0]}'s")
    print("parametrization  layer  " + "  ".join(f"w={w:<4}" for w in WIDTHS))
    with shared_default_group():
        base = {"base_hidden_size": WIDTHS[0], "base_num_layers": 2}
        for label, init in (
            ("sp", {"std": 0.02}),
            ("use_mup", {"use_mup": True}),
            ("mup", {"std": 0.02, "parametrization": {"name": "mup", **base}}),
            ("completep", {"std": 0.02, "parametrization": {"name": "completep", **base}}),
        ):
            table = [layer_rms(w, init, a.steps, a.lr, moe=a.moe, part=a.part) for w in WIDTHS]
            for layer in range(len(table[0])):
                ratios = [row[layer] / table[0][layer] for row in table]
                print(f"{label:<16} {layer:<6} " + "  ".join(f"{r:6.2f}" for r in ratios))


if __name__ == "__main__":
    main()
