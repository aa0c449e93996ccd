"""The Mamba-1 family's parameters and sizes: its tensor-parallel plan, init spec, block names
and costs, parameter count, FLOPs and activation memory.

Names: `embedding`, `decoder.{i}` (`norm` + `mixer`), `final_norm`, `lm_head`, `loss`; a mixer
keeps Hugging Face's names (`in_proj`, `conv1d`, `x_proj`, `dt_proj`, `A_log`, `D`, `out_proj`).

Tensor parallel, Megatron's split of the inner channels I: a rank keeps I/tp of them, its block
of EACH section of in_proj [x | z] (cut part by part, as q/k/v are), its conv channels, its rows
of dt_proj, A_log and D, its columns of x_proj (whose partial products are all-reduced: the sum
Nanotron's example leaves out) and of the row-parallel out_proj.

Initialisation, Nanotron's example's (`init_model_randomly`): the embedding normal with
init_method.initializer_range; linears and the conv PyTorch's default (kaiming uniform: here a
normal of the same variance, 1 / (3 fan_in)), out_proj divided by sqrt(n_residuals_per_layer *
layers) when rescale_prenorm_residual; the conv bias uniform in +-1/sqrt(K); dt_proj per the
ssm_cfg dt keys (its bias as mamba_ssm sets it: Nanotron's example overwrites that bias with a
uniform draw after the fact, which ignores dt_min/dt_max); A_log = log(1..N), D = 1. Special
values are drawn whole from a (seed, name) generator and each rank keeps its rows.
"""

from __future__ import annotations

import math

import torch

from ..init import InitSpec, param_seed
from ..mixers import mamba1_dt_init
from ..tp_plan import Split, TPPlan
from .config import MambaConfig

TIED_KEY = "embedding.weight"
FILLED = ("dt_proj.weight", "dt_proj.bias", "A_log", "conv1d.bias")  # drawn whole, then cut

MAMBA1_TP_PLAN = TPPlan(
    {
        "embedding": Split.VOCAB,
        "lm_head": Split.COLUMN,
        "mixer.in_proj": Split.COLUMN,
        "mixer.conv1d": Split.COLUMN,
        "mixer.dt_proj": Split.COLUMN,
        "mixer.out_proj": Split.ROW,
    },
    parameters={"mixer.x_proj.weight": 1, "mixer.A_log": 0, "mixer.D": 0},
)


def _kaiming_std(fan_in: int) -> float:
    return 1.0 / math.sqrt(3 * fan_in)


def mamba1_init_spec(
    config: MambaConfig, name: str, init_std: float, tp: int,
    scaling_method: str = "NUM_LAYERS", residuals_per_layer: int = 1,
) -> InitSpec:  # fmt: skip
    """How parameter `name` is made (full shape, std) and cut over tp (the plan)."""
    c, h = config, config.d_model
    d = c.mamba_dims
    i, n, r, k = d.intermediate_size, d.state_size, d.time_step_rank, d.conv_kernel
    split = MAMBA1_TP_PLAN.shard_dim(name)
    vpad = c.padded_vocab_size(tp)
    if name == "embedding.weight" or (name == "lm_head.weight" and c.tie_word_embeddings):
        return InitSpec(TIED_KEY, (c.vocab_size, h), init_std, split, pad_rows_to=vpad,
                        embedding=True)  # fmt: skip
    if name == "lm_head.weight":
        return InitSpec(name, (c.vocab_size, h), init_std, split, pad_rows_to=vpad,
                        fan=(h, c.vocab_size))  # fmt: skip
    if name.endswith("norm.weight"):
        return InitSpec(name, (h,), None, split)
    leaf = name.split(".mixer.", 1)[-1]
    rescale = math.sqrt(residuals_per_layer * c.num_hidden_layers)
    out_std = _kaiming_std(i) / (rescale if scaling_method == "NUM_LAYERS" else 1.0)
    table = {
        "in_proj.weight": ((2 * i, h), _kaiming_std(h), (i, i), (h, 2 * i)),
        "in_proj.bias": ((2 * i,), 0.0, (i, i), None),
        "conv1d.weight": ((i, 1, k), _kaiming_std(k), None, None),
        "conv1d.bias": ((i,), 0.0, None, None),
        "x_proj.weight": ((r + 2 * n, i), _kaiming_std(i), None, (i, r + 2 * n)),
        "dt_proj.weight": ((i, r), 0.0, None, None),
        "dt_proj.bias": ((i,), 0.0, None, None),
        "A_log": ((i, n), 0.0, None, None),
        "D": ((i,), None, None, None),
        "out_proj.weight": ((h, i), out_std, None, (i, h)),
        "out_proj.bias": ((h,), 0.0, None, None),
    }
    if leaf not in table:
        raise KeyError(f"no initialisation rule for parameter {name!r}")
    shape, std, sections, fan = table[leaf]
    return InitSpec(name, shape, std, split, sections, fan=fan)


def _full_special(c: MambaConfig, leaf: str, gen: torch.Generator) -> torch.Tensor:
    d = c.mamba_dims
    if leaf == "A_log":
        return torch.log(torch.arange(1, d.state_size + 1, dtype=torch.float32)).repeat(
            d.intermediate_size, 1
        )
    if leaf == "conv1d.bias":
        bound = 1 / math.sqrt(d.conv_kernel)
        return torch.empty(d.intermediate_size).uniform_(-bound, bound, generator=gen)
    dt = mamba1_dt_init(
        d.intermediate_size, d.time_step_rank, gen, c.ssm("dt_min"), c.ssm("dt_max"),
        c.ssm("dt_init"), c.ssm("dt_scale"), c.ssm("dt_init_floor"),
    )  # fmt: skip
    return dt[leaf]


@torch.no_grad()
def fill_special_params(stage: torch.nn.Module, config: MambaConfig, seed: int) -> None:
    """dt_proj, A_log and the conv bias as Nanotron's example / mamba_ssm initialise them, the
    full tensors from a generator seeded by (seed, name), each rank keeping its rows: the same
    weights in any layout."""
    for name, param in stage.named_parameters():
        leaf = name.split(".mixer.", 1)[-1]
        if leaf not in FILLED:
            continue
        gen = torch.Generator().manual_seed(param_seed(seed, name))
        full = _full_special(config, leaf, gen)
        part = param.shape[0]
        rank = stage.pc.tp_rank if part < full.shape[0] else 0
        param.copy_(full[rank * part : (rank + 1) * part].to(param.dtype))


# ---- blocks, sizes and FLOPs ----------------------------------------------------------------


def mamba1_block_names(config: MambaConfig) -> list[str]:
    return ["embedding", *(f"decoder.{i}" for i in range(config.num_hidden_layers)),
            "final_norm", "lm_head", "loss"]  # fmt: skip


def _layer_matmul_params(c: MambaConfig) -> int:
    d = c.mamba_dims
    i, r, n = d.intermediate_size, d.time_step_rank, d.state_size
    return c.d_model * 2 * i + i * (r + 2 * n) + r * i + i * c.d_model


def _scan_flops(c: MambaConfig) -> float:
    """Forward FLOPs per token beyond the matmuls: the conv, the scan's decay, input, state
    update and read-out (about 9 I N, mamba_ssm's count) and the skip and gate."""
    d = c.mamba_dims
    return 2.0 * d.intermediate_size * d.conv_kernel + 9.0 * d.intermediate_size * d.state_size


def mamba1_block_costs(config: MambaConfig, seq_len: int) -> list[float]:
    """Forward FLOPs of each block for one sequence (pipeline placement by cost)."""
    c, s, h = config, seq_len, config.d_model
    layer = float(s * (2 * _layer_matmul_params(c) + _scan_flops(c) + 10 * h))
    return [float(s * h), *[layer] * c.num_hidden_layers, float(4 * s * h),
            float(2 * s * c.vocab_size * h), float(5 * s * c.vocab_size)]  # fmt: skip


def mamba1_training_flops_per_token(config: MambaConfig, seq_len: int) -> float:
    """6 N (the matmul weights, lm_head included) + 3 x the scan's forward FLOPs."""
    c = config
    n = c.num_hidden_layers * _layer_matmul_params(c) + c.vocab_size * c.d_model
    return 6.0 * n + 3.0 * c.num_hidden_layers * _scan_flops(c)


def mamba1_num_parameters(config: MambaConfig) -> int:
    """Trainable parameters of the unpadded model (a tied embedding counted once)."""
    c, h, d = config, config.d_model, config.mamba_dims
    i, n, k = d.intermediate_size, d.state_size, d.conv_kernel
    per_layer = h + _layer_matmul_params(c) + i * k + i * c.ssm("conv_bias") + i + i * n + i
    per_layer += (2 * i + h) * c.ssm("bias")
    return (
        c.vocab_size * h * (1 if c.tie_word_embeddings else 2) + h + c.num_hidden_layers * per_layer
    )


def mamba1_activation_elements(
    config: MambaConfig, tp: int, sequence_parallel: bool
) -> tuple[tuple[int, ...], int]:
    """(saved elements per token of a layer, of a layer's input) on a tp rank: the memory check
    before allocation. A layer saves its norm, in_proj's output, the conv's output, x_proj's,
    dt, and the scan's per-state decays, inputs and states (3 I N, fp32) and gated output."""
    c, h = config, config.d_model
    hs = h // tp if sequence_parallel else h
    d = c.mamba_dims
    i = d.intermediate_size // tp
    per = 2 * hs + h + 2 * i + i + (d.time_step_rank + 2 * d.state_size) + i
    per += 2 * (3 * i * d.state_size + 2 * i)  # fp32: two elements of the model's dtype each
    return (per,) * c.num_hidden_layers, hs


def mamba1_layer_comm(
    config: MambaConfig, tp: int, cp: int, cp_rank: int, batch: int, dtype
) -> tuple[tuple[int, int | None], ...]:
    """Per layer (one residual block over tp; no cp exchange modelled): the planner's
    communication model through the family row's `layer_comm`."""
    return ((1, 0),) * config.num_hidden_layers
