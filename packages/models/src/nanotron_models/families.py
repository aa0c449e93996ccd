"""Model families by name: one row per family, the one place callers look a family up.

A row gathers what the rest of the stack needs of a family: its config class; its blocks
(names in forward order, their relative costs for pipeline placement, the builder of a
stage holding some of them, which blocks are its layers); its parameters (the global names'
init rule, the tensor-parallel plan, the name tied parameters share); its size, FLOPs and
activation memory; its decoding state; the config fields that make two models the same
architecture; and its Hugging Face and Nanotron mappings (the row type: family_row.py).
Llama, Nanotron's Qwen2, Mamba-2 and its hybrids, Mamba-1 (Nanotron's example), Qwen3-Next.

Everything outside a family's own modules reaches the family through its row and the stage
interface (stage.py), never through its functions (tests/train/test_import_graph.py checks
this): another family is its modules plus one row in `FAMILIES`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from torch import nn

from .config import LlamaConfig, ModelConfigError
from .family_row import HFMapping, ModelFamily, NanotronNames
from .flops import (
    llama_activation_elements,
    llama_block_costs,
    llama_block_names,
    num_parameters,
    training_flops_per_token,
)
from .hf_llama_family import LLAMA_HF, QWEN2_HF
from .init import LLAMA_TP_PLAN, llama_init_spec
from .kv_cache import KVCache
from .mamba1 import hf as mamba1_hf
from .mamba1.config import MambaConfig
from .mamba1.names import MAMBA1_NANOTRON_LAYER_NAMES
from .mamba1.spec import (
    MAMBA1_TP_PLAN,
    mamba1_activation_elements,
    mamba1_block_costs,
    mamba1_block_names,
    mamba1_init_spec,
    mamba1_layer_comm,
    mamba1_num_parameters,
    mamba1_training_flops_per_token,
)
from .mamba1.stage import build_mamba1_stage, new_mamba1_decode_state
from .mamba2_hybrid import hf as mamba2_hf
from .mamba2_hybrid.comm import hybrid_layer_comm
from .mamba2_hybrid.config import Mamba2HybridConfig
from .mamba2_hybrid.decode_state import new_hybrid_decode_state
from .mamba2_hybrid.names import HYBRID_NANOTRON_LAYER_NAMES
from .mamba2_hybrid.spec import (
    MAMBA2_HYBRID_TP_PLAN,
    hybrid_activation_elements,
    hybrid_block_costs,
    hybrid_block_names,
    hybrid_init_spec,
    hybrid_num_parameters,
    hybrid_training_flops_per_token,
)
from .mamba2_hybrid.stage import build_hybrid_stage
from .materialise import load_full_tensors, missing_parameters, shard_full_tensors
from .model import TIED_KEY, build_llama_stage
from .nanotron_names import LLAMA_NANOTRON_LAYER_NAMES, LLAMA_NANOTRON_TOP_NAMES
from .qwen2 import Qwen2Config
from .qwen3_next import hf as qwen3_next_hf
from .qwen3_next.comm import qwen3_next_layer_comm
from .qwen3_next.config import Qwen3NextConfig
from .qwen3_next.names import QWEN3_NEXT_NANOTRON_LAYER_NAMES
from .qwen3_next.spec import (
    QWEN3_NEXT_TP_PLAN,
    qwen3_next_activation_elements,
    qwen3_next_block_costs,
    qwen3_next_block_names,
    qwen3_next_init_spec,
    qwen3_next_num_parameters,
    qwen3_next_training_flops_per_token,
)
from .qwen3_next.stage import build_qwen3_next_stage, new_qwen3_next_decode_state

LLAMA = ModelFamily(
    name="llama",
    config_class=LlamaConfig,
    build_stage=build_llama_stage,
    block_names=llama_block_names,
    block_costs=llama_block_costs,
    layer_prefix="decoder.",
    init_spec=llama_init_spec,
    tp_plan=LLAMA_TP_PLAN,
    tied_key=TIED_KEY,
    num_parameters=num_parameters,
    training_flops_per_token=training_flops_per_token,
    activation_elements=llama_activation_elements,
    arch_keys=(
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "vocab_size",
        "tie_word_embeddings",
        "rms_norm_eps",
        "rope_theta",
        "rope_scaling",
        "hidden_act",
        "rope_interleaved",
    ),  # fmt: skip
    # Qwen2's biases, windows, NoPE layers and position interpolation: a Llama checkpoint
    # still resumes under a Qwen2 config that turns none of them on.
    optional_arch_keys=(
        "attention_bias",
        "sliding_window_size",
        "no_rope_layer",
        "rope_seq_len_interpolation_factor",
    ),  # fmt: skip
    new_decode_state=lambda config: KVCache(),
    hf=LLAMA_HF,
    nanotron_names=NanotronNames(LLAMA_NANOTRON_TOP_NAMES, LLAMA_NANOTRON_LAYER_NAMES),
    yaml_marker="is_llama_config",
)


# Nanotron's Qwen2 (SmolLM3's architecture): Llama's blocks and names, the family's attention
# said by its config (q/k/v biases, NoPE layers, sliding windows, document masking), and its
# mixture-of-experts layers (moe_config: Hugging Face's Qwen2-MoE).
QWEN2 = dataclasses.replace(
    LLAMA,
    name="qwen2",
    config_class=Qwen2Config,
    hf=QWEN2_HF,
    yaml_marker="is_qwen2_config",
)

# Mamba-2 and its hybrids (mamba2_hybrid/): HF Mamba2ForCausalLM, and Nemotron-H's layer
# pattern (M Mamba-2, * attention, - MLP, E experts) as NemotronHForCausalLM.
MAMBA2 = ModelFamily(
    name="mamba2",
    config_class=Mamba2HybridConfig,
    build_stage=build_hybrid_stage,
    block_names=hybrid_block_names,
    block_costs=hybrid_block_costs,
    layer_prefix="decoder.",
    init_spec=hybrid_init_spec,
    tp_plan=MAMBA2_HYBRID_TP_PLAN,
    tied_key=TIED_KEY,
    num_parameters=hybrid_num_parameters,
    training_flops_per_token=hybrid_training_flops_per_token,
    activation_elements=hybrid_activation_elements,
    arch_keys=(
        "vocab_size",
        "hidden_size",
        "num_hidden_layers",
        "hybrid_override_pattern",
        "num_heads",
        "head_dim",
        "n_groups",
        "state_size",
        "conv_kernel",
        "use_conv_bias",
        "use_bias",
        "layer_norm_epsilon",
        "time_step_limit",
        "tie_word_embeddings",
        "num_attention_heads",
        "num_key_value_heads",
        "attention_head_dim",
        "attention_bias",
        "intermediate_size",
        "mlp_hidden_act",
        "mlp_bias",
        "n_routed_experts",
        "num_experts_per_tok",
        "moe_intermediate_size",
        "moe_shared_expert_intermediate_size",
        "n_group",
        "topk_group",
        "norm_topk_prob",
        "routed_scaling_factor",
    ),  # fmt: skip
    optional_arch_keys=(),
    new_decode_state=new_hybrid_decode_state,
    hf=HFMapping(
        model_type="mamba2",
        architectures=("Mamba2ForCausalLM", "NemotronHForCausalLM"),
        config_from_hf=mamba2_hf.config_from_hf,
        config_to_hf=mamba2_hf.config_to_hf,
        state_dict_from_hf=mamba2_hf.state_dict_from_hf,
        state_dict_to_hf=mamba2_hf.state_dict_to_hf,
        model_types=("mamba2", "nemotron_h"),
        architecture_of=mamba2_hf.architecture,
    ),
    nanotron_names=NanotronNames(LLAMA_NANOTRON_TOP_NAMES, HYBRID_NANOTRON_LAYER_NAMES),
    yaml_marker="is_mamba2_config",
    layer_comm=hybrid_layer_comm,
)

# Mamba-1 (mamba1/): Nanotron's examples/mamba (is_mamba_config), HF MambaForCausalLM. Nanotron's
# example names its layers' parameters as ours (its in_proj rows interleave x and z).
MAMBA1 = ModelFamily(
    name="mamba1",
    config_class=MambaConfig,
    build_stage=build_mamba1_stage,
    block_names=mamba1_block_names,
    block_costs=mamba1_block_costs,
    layer_prefix="decoder.",
    init_spec=mamba1_init_spec,
    tp_plan=MAMBA1_TP_PLAN,
    tied_key=TIED_KEY,
    num_parameters=mamba1_num_parameters,
    training_flops_per_token=mamba1_training_flops_per_token,
    activation_elements=mamba1_activation_elements,
    arch_keys=(
        "vocab_size",
        "d_model",
        "num_hidden_layers",
        "ssm_cfg",
        "rms_norm",
        "rms_norm_eps",
        "residual_in_fp32",
        "tie_word_embeddings",
    ),  # fmt: skip
    optional_arch_keys=(),
    new_decode_state=new_mamba1_decode_state,
    hf=HFMapping(
        model_type="mamba",
        architectures=("MambaForCausalLM",),
        config_from_hf=mamba1_hf.config_from_hf,
        config_to_hf=mamba1_hf.config_to_hf,
        state_dict_from_hf=mamba1_hf.state_dict_from_hf,
        state_dict_to_hf=mamba1_hf.state_dict_to_hf,
        architecture_of=mamba1_hf.architecture,
    ),
    nanotron_names=NanotronNames(LLAMA_NANOTRON_TOP_NAMES, MAMBA1_NANOTRON_LAYER_NAMES),
    yaml_marker="is_mamba_config",
    layer_comm=mamba1_layer_comm,
)

# Qwen3-Next (qwen3_next/): Gated DeltaNet (G) and gated full-attention (*) layers, each with
# a mixture of experts (E) or a dense MLP (-), as Qwen3NextForCausalLM.
QWEN3_NEXT = ModelFamily(
    name="qwen3_next",
    config_class=Qwen3NextConfig,
    build_stage=build_qwen3_next_stage,
    block_names=qwen3_next_block_names,
    block_costs=qwen3_next_block_costs,
    layer_prefix="decoder.",
    init_spec=qwen3_next_init_spec,
    tp_plan=QWEN3_NEXT_TP_PLAN,
    tied_key=TIED_KEY,
    num_parameters=qwen3_next_num_parameters,
    training_flops_per_token=qwen3_next_training_flops_per_token,
    activation_elements=qwen3_next_activation_elements,
    arch_keys=(
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "rms_norm_eps",
        "tie_word_embeddings",
        "rope_theta",
        "partial_rotary_factor",
        "attention_bias",
        "linear_conv_kernel_dim",
        "linear_key_head_dim",
        "linear_value_head_dim",
        "linear_num_key_heads",
        "linear_num_value_heads",
        "decoder_sparse_step",
        "moe_intermediate_size",
        "shared_expert_intermediate_size",
        "num_experts_per_tok",
        "num_experts",
        "norm_topk_prob",
        "mlp_only_layers",
        "layer_types",
    ),  # fmt: skip
    optional_arch_keys=(),
    new_decode_state=new_qwen3_next_decode_state,
    hf=HFMapping(
        model_type="qwen3_next",
        architectures=("Qwen3NextForCausalLM",),
        config_from_hf=qwen3_next_hf.config_from_hf,
        config_to_hf=qwen3_next_hf.config_to_hf,
        state_dict_from_hf=qwen3_next_hf.state_dict_from_hf,
        state_dict_to_hf=qwen3_next_hf.state_dict_to_hf,
        architecture_of=qwen3_next_hf.architecture,
    ),
    nanotron_names=NanotronNames(LLAMA_NANOTRON_TOP_NAMES, QWEN3_NEXT_NANOTRON_LAYER_NAMES),
    yaml_marker="is_qwen3_next_config",
    layer_comm=qwen3_next_layer_comm,
    moe_balance_over_cp=True,
)

FAMILIES: dict[str, ModelFamily] = {
    "llama": LLAMA, "qwen2": QWEN2, "mamba2": MAMBA2, "mamba1": MAMBA1,
    "qwen3_next": QWEN3_NEXT,
}  # fmt: skip


def family(name: str) -> ModelFamily:
    """The family called `name`; an unknown one is an error listing the known ones."""
    if name not in FAMILIES:
        raise ModelConfigError(f"model family {name!r} is not one of {sorted(FAMILIES)}")
    return FAMILIES[name]


def family_of_yaml(model_config: Any) -> ModelFamily:
    """The family a Nanotron YAML's model_config mapping names (`is_qwen2_config: true`, ...);
    Llama when none does, as Nanotron's loader tries LlamaConfig first."""
    if isinstance(model_config, dict):
        for row in FAMILIES.values():
            if row.yaml_marker and model_config.get(row.yaml_marker) is True:
                return row
    return LLAMA


def config_from_dict(d: dict[str, Any]) -> Any:
    """A model config of the family `d` names (a checkpoint's or a YAML's model_config)."""
    return family_of_yaml(d).config_class.from_dict(d)


def family_of_hf(hf_config: Any) -> ModelFamily:
    """The family of a Hugging Face config (object or config.json mapping)."""
    get = hf_config.get if isinstance(hf_config, dict) else lambda k: getattr(hf_config, k, None)
    for row in FAMILIES.values():
        if row.hf.reads(get("model_type"), get("architectures")):
            return row
    known = sorted(
        t for row in FAMILIES.values() for t in row.hf.model_types or (row.hf.model_type,)
    )
    raise ModelConfigError(
        f"model_type {get('model_type')!r} (architectures {get('architectures')}) is not one of "
        f"{known}"
    )


def family_of(config: Any) -> ModelFamily:
    """The family whose config class `config` is an instance of."""
    for row in FAMILIES.values():
        if isinstance(config, row.config_class):
            return row
    raise ModelConfigError(f"no model family has the config class {type(config).__name__}")


def shard_full_state_dict(
    full_sd: dict[str, Any], config: Any, tp_rank: int, tp_size: int
) -> dict[str, Any]:
    """Full tensors (our global names; vocab padded or not) -> tp rank `tp_rank`'s shards of
    the model `config` describes, cut and vocab-padded as its family initialises them."""
    return shard_full_tensors(full_sd, config, family_of(config).init_spec, tp_rank, tp_size)


def load_full_state_dict(stage: nn.Module, full_sd: dict[str, Any]) -> None:
    """Copy full tensors (our global names) into this rank's shards of `stage`, a stage of any
    family; a parameter `full_sd` lacks is a ModelConfigError naming them."""
    missing = missing_parameters(stage, full_sd)
    if missing:
        raise ModelConfigError(f"state dict lacks {missing}")
    load_full_tensors(stage, full_sd, family_of(stage.config).init_spec)


def config_classes() -> tuple[type, ...]:
    """Every family's config class, in `FAMILIES`' order (Llama first, as Nanotron tries)."""
    return tuple(row.config_class for row in FAMILIES.values())
