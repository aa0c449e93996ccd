"""Llama built from nanotron-parallel primitives, identical to Hugging Face's LlamaForCausalLM."""

from .attention import resolve_backend
from .config import LlamaConfig, ModelConfigError
from .flops import (
    BlockSpec,
    llama_block_costs,
    llama_block_names,
    llama_block_specs,
    num_parameters,
    training_flops_per_token,
)
from .kv_cache import KVCache
from .model import (
    LlamaStage,
    build_llama,
    build_llama_stage,
    full_state_dict,
    load_full_state_dict,
)

# internals.md name for the stage builder.
build_llama_blocks = build_llama_stage

__all__ = [
    "BlockSpec",
    "KVCache",
    "LlamaConfig",
    "LlamaStage",
    "ModelConfigError",
    "build_llama",
    "build_llama_blocks",
    "build_llama_stage",
    "full_state_dict",
    "llama_block_costs",
    "llama_block_names",
    "llama_block_specs",
    "load_full_state_dict",
    "num_parameters",
    "resolve_backend",
    "training_flops_per_token",
]
